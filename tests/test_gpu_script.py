"""The GPU script (benchmarks/gpu/run.py) works before any device minute is spent on it: ``--smoke``
runs every part on CPU with tiny shapes (the Pallas GPU kernels under the interpreter), and its
report combines runs."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import GPU_SCRIPT, gpu_script

ROOT = Path(__file__).resolve().parent.parent
# kvpress's own environment (benchmarks/kvpress_baseline/setup.sh): torch, transformers 5.2, kvpress
KVPRESS_PYTHON = ROOT / "benchmarks" / "kvpress_baseline" / ".venv" / "bin" / "python"


def smoke(out, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``run.py --smoke ARGS --out OUT`` from the repository root, its output captured."""
    cmd = [sys.executable, str(GPU_SCRIPT / "run.py"), "--smoke", *args, "--out", str(out)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_smoke_runs_every_part_and_reports_every_row(tmp_path):
    """Every part but "server" (six servers started: test_smoke_server_part, slow)."""
    parts = "kernels,layers,model,serve,peer"
    done = smoke(tmp_path, "--parts", parts, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    merged = json.loads((tmp_path / "results.json").read_text())
    parts = merged["parts"]
    tables = ("kernel_checks", "kernel_times", "layers", "prefill", "compress", "decode", "serve")
    for table in tables:
        rows = parts[table]
        assert rows, table
        failed = [r for r in rows if "error" in r]
        assert not failed, (table, failed[:3])
    # KVzip and Expected Attention by kvjax.prefill at both contexts, cut to the budget
    assert sorted((r["scorer"], r["context"]) for r in parts["compress"]) == [
        (s, c) for s in ("expected-attention", "kvzip") for c in (256, 512)
    ]
    assert all(r["kept_per_head"] == 64 for r in parts["compress"])
    kernels_part, VARIANTS = gpu_script("kernels_part"), gpu_script("layers_part").VARIANTS
    checks = parts["kernel_checks"]
    # every kernel (dense, paged, MomentKV-corrected, the dense and paged caches' decoding
    # evictions) and the full cache's prompt attention (XLA's on a CPU)
    assert {r["op"] for r in checks} == {
        *kernels_part.OPS,
        kernels_part.PROMPT,
        *kernels_part.PLACE_OPS,
    }
    assert {r.get("attention") for r in checks if r["op"] == kernels_part.PROMPT} == {"xla"}
    assert all(r["ok"] and r["max_err"] < 1e-2 for r in checks)
    times = parts["kernel_times"]
    assert {r["impl"] for r in times} == {
        "pallas_gpu",
        kernels_part.WIDE,
        *kernels_part.SPLITS,
        "xla",
        "cudnn",
    }
    assert {r["op"] for r in times if r["impl"] == kernels_part.WIDE} == {*kernels_part.WIDE_OPS}
    # the decoding evictions' kernels, against the XLA forms they replace
    for impl in ("pallas_gpu", "xla"):
        assert {r["op"] for r in times if r["impl"] == impl} >= {*kernels_part.PLACE_OPS}
    # the dense decode kernel by its splits, at a budget cache's slots
    assert {(r["op"], r["slots"]) for r in times if r["impl"] in kernels_part.SPLITS} == {
        ("decode", 129)
    }
    decode = parts["decode"]
    quantized = {f"{c} {kv}" for c in ("full", "snapkv 64") for kv in ("int8", "float8_e4m3fn")}
    assert {r["cache"] for r in decode if r.get("largest_batch")} == {
        "full",
        "snapkv 64",
    } | quantized
    # every scorer of issue 59's targets, evicting at every step and every 16 (periodic: its state
    # given budget + 16 slots)
    scorers = ("snapkv 64", "momentkv 64", "adakv 64", "expected-attention 64")
    periodic = {f"{c} every 16" for c in scorers}
    assert {r["cache"] for r in decode} >= {"full", *scorers, *periodic} | quantized
    at_2 = {r["cache"]: r for r in decode if r["batch"] == 2 and not r.get("largest_batch")}
    for cache in periodic:  # room for 16 new tokens per head beside the budget
        base = at_2[cache.removesuffix(" every 16")]
        assert at_2[cache]["kv_bytes_allocated"] > base["kv_bytes_allocated"], cache
    # a quantized row's kept bytes count its scales: 8-bit codes and a bfloat16 scale per token
    by = {(r["cache"], r["batch"], r["context"]): r for r in decode if not r.get("largest_batch")}
    for kv in ("int8", "float8_e4m3fn"):
        row, base = by[(f"snapkv 64 {kv}", 2, 256)], by[("snapkv 64", 2, 256)]
        head_dim = 16  # the smoke model's
        assert row["kv_bytes_kept"] * 2 * head_dim == base["kv_bytes_kept"] * (head_dim + 2)
    assert all(r["ms_per_step"] > 0 and r["floor_ms"] > 0 for r in decode)
    # the floor two ways: over the copy rate and over the read rate, both measured in the part
    for part, rows in (("model", decode), ("layers", parts["layers"])):
        ceilings = merged["meta"][part]["ceilings"]
        assert ceilings["copy_gb_s"] > 0 and ceilings["read_gb_s"] > 0, ceilings
        for r in rows:
            assert r["read_floor_ms"] / r["floor_ms"] == pytest.approx(
                ceilings["copy_gb_s"] / ceilings["read_gb_s"]
            ), r
            assert r["ms_per_step"] / r["read_floor_ms"] == pytest.approx(
                r["step_over_read_floor"]
            ), r
    assert {r["impl"] for r in decode} == {"default"} and {r["impl"] for r in parts["prefill"]} == {
        "default",
        "xla",
    }
    # block-wise prefill in a larger block than CAOTE's 128 (the card: 512 and 2048, both contexts)
    assert [r["context"] for r in parts["prefill"] if r["cache"] == "snapkv 64 block 512"] == [512]
    full = {r["impl"]: r for r in parts["prefill"] if r["cache"] == "full"}
    assert {r["prompt_attention"] for r in full.values()} == {"xla"}  # no cuDNN on a CPU
    assert max(full["xla"]["vs_default"].values()) < 1e-6  # the same computation here
    profiled = {(r["cache"], r["impl"], r["batch"]): r["profile"] for r in decode if "profile" in r}
    assert set(profiled) == {
        ("full", "default", 1),
        ("full", "default", 2),
        ("snapkv 64", "default", 2),
        ("momentkv 64", "default", 2),
        ("adakv 64", "default", 2),
        ("expected-attention 64", "default", 2),
    }
    assert all(
        "error" not in p and p["ms_per_step"] > 0 and p["ops_per_step"] >= 1 and p["top"]
        for p in profiled.values()
    ), profiled
    adakv = profiled["adakv 64", "default", 2][
        "kinds"
    ]  # the kinds told apart; evicting one token per head, AdaKV's
    assert adakv["matmul"] > 0 and adakv["cache write"] > 0 and "sort" not in adakv, (
        adakv
    )  # step sorts nothing
    assert {r["slots"] for r in parts["serve"]} == {1, 4}
    assert {r["variant"] for r in parts["layers"]} == set(VARIANTS) and {
        r["batch"] for r in parts["layers"]
    } == {1}
    assert sorted(p.name for p in (tmp_path / "hlo").iterdir()) == [
        "scan+Triton-GEMMs.txt",
        "scan+cuBLAS.txt",
        "scan.txt",
        "unstacked+cache-per-layer.txt",
        "unstacked.txt",
    ]
    assert all(
        "matches XLA's" in merged["meta"][part]["decode_attention"] for part in ("layers", "model")
    )
    peer = parts["peer"]
    assert "error" not in peer and "stopped" not in peer
    for table in ("prefill", "decode"):
        assert peer[table] and not [r for r in peer[table] if "error" in r], peer[table]
    # eager rows first (the earlier calls' record), then the compiled ones, their warm-up apart
    modes = [r["mode"] for r in peer["decode"]]
    assert modes == sorted(modes, key=["eager", "compiled"].index) and modes[-1] == "compiled"
    compiled = [r for t in ("prefill", "decode") for r in peer[t] if r["mode"] == "compiled"]
    assert {(r["context"], r.get("batch")) for r in compiled} == {(256, 1), (256, 4), (256, None)}
    assert all(r["compile_s"] > 0 and r["tokens_per_s"] > 0 for r in compiled)
    report = (tmp_path / "results.md").read_text()
    assert (
        "### Targets" in report and report.strip() == done.stdout.strip()
    )  # the table is printed last
    assert "step / read floor" in report and "| decode | compiled | 256 | 4 |" in report


@pytest.mark.slow
def test_smoke_server_part(tmp_path):
    """The server part on the CPU: each case's server started, benchmarked over HTTP and stopped; a
    row per case with the benchmark's figures and the server's capacity, the busy cases beside their
    raw decode."""
    done = smoke(tmp_path, "--parts", "server", timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((tmp_path / "results.json").read_text())["parts"]["server"]
    assert [r["case"] for r in rows] == [
        "busy",
        "call4b",
        "long-full",
        "long-snapkv",
        "documents",
        "documents-whole",
    ]
    assert all(
        "error" not in r and r["exit"] == 0 and r["completed"] == 8 and "slots" in r["capacity"]
        for r in rows
    )
    assert (
        all(r["raw_decode_tokens_per_s"] > 0 for r in rows[:2]) and rows[4]["context_seconds"] > 0
    )
    assert "### Server over HTTP" in done.stdout and "server (busy)" in done.stdout


def test_kernel_ops_checks_only_the_ops_named_and_refuses_an_unknown_one(tmp_path):
    run = ("--parts", "kernels", "--no-kernel-timings")
    done = smoke(tmp_path, *run, "--kernel-ops", "prompt,decode")
    assert done.returncode == 0, done.stderr[-4000:]
    checks = json.loads((tmp_path / "results.json").read_text())["parts"]["kernel_checks"]
    assert {r["op"] for r in checks} == {"prompt", "decode"} and all(r["ok"] for r in checks)
    bad = smoke(tmp_path, *run, "--kernel-ops", "decode,flash", timeout=120)
    assert bad.returncode == 2 and "--kernel-ops: unknown ['flash']" in bad.stderr


def test_report_combines_runs_and_keeps_only_what_no_run_reached():
    combine = gpu_script("report").combine
    label = {"cache": "full", "impl": "default", "context": 4096, "batch": 1}
    first = {
        "meta": {"model": {}},
        "parts": {
            "decode": [
                {**label, "error": "not run: the part's deadline passed"},
                {**label, "batch": 8, "error": "not run: the part's deadline passed"},
            ],
            "peer": {"decode": []},
        },
    }
    second = {"meta": {"model": {}}, "parts": {"decode": [{**label, "ms_per_step": 15.0}]}}
    merged = combine([first, second], ["a", "b"])
    rows = merged["parts"]["decode"]
    assert [(r["batch"], r["run"], "error" in r) for r in rows] == [(8, "a", True), (1, "b", False)]
    assert merged["parts"]["peer"]["run"] == "a" and set(merged["meta"]) == {"a", "b"}


def test_moved_bytes_counts_what_a_layer_scan_slices_out_once_per_trip():
    """The layers part's count of bytes written by slicing: XLA on CPU copies each layer's weight
    out of the stacked array before its product (once per trip of the loop), and slices nothing from
    weights passed one per layer."""
    import jax
    import jax.numpy as jnp

    moved_bytes = gpu_script("layers_part").moved_bytes
    L, n = 6, 512
    stacked = jnp.ones((L, n, n), jnp.float32)
    scan = jax.jit(lambda w, x: jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, w)[0])
    loop = jax.jit(lambda ws, x: [x := jnp.tanh(x @ w) for w in ws][-1])
    x = jnp.ones((1, n), jnp.float32)
    assert moved_bytes(scan.lower(stacked, x).compile().as_text()) >= L * n * n * 4
    assert moved_bytes(loop.lower(list(stacked), x).compile().as_text()) < n * n * 4


def test_step_traffic_counts_a_decoding_loops_body_outside_its_layer_scan():
    """``aot.py --traffic``'s count (``common.step_traffic``) on a loop shaped like the decoding
    loop: its layer scan is left out (more layers, the same count), a gather of 8 elements counts
    what it takes, not the array it takes them from (a larger array, the same count), and each
    branch of a conditional is counted apart (the one that rewrites a 1 MB array reads and writes
    it)."""
    import jax
    import jax.numpy as jnp

    step_traffic = gpu_script("common").step_traffic
    n = 1 << 18  # 1 MB of float32

    def traffic(layers: int, table: int) -> dict:
        def body(i, carry):
            x, big, ws, lookup = carry
            x = jax.lax.scan(lambda h, w: (jnp.tanh(w @ h), None), x, ws)[0]
            big = jax.lax.cond(x[0] > 2.0, lambda b: b * 2.0 + 1.0, lambda b: b, big)
            return x + lookup[jnp.arange(8) * 7 + i].sum(), big, ws, lookup

        loop = jax.jit(lambda *carry: jax.lax.fori_loop(0, 5, body, carry))
        args = jnp.ones(64), jnp.ones(n), jnp.ones((layers, 64, 64)), jnp.ones(table)
        return step_traffic(loop.lower(*args).compile().as_text())

    base = traffic(2, n)
    branches = sorted(v for k, v in base.items() if k != "step")
    assert len(base) == 3 and len(branches) == 2 and branches[1] >= 2 * 4 * n
    assert traffic(8, n) == base  # the layer scan is not counted
    assert traffic(2, 4 * n) == base  # nor what the gather does not read


# A fusion as XLA:GPU prints the decode kernel's merge of its splits, cut down: partial outputs
# [2, 6, 16, 8] (16 rows of which 4 are real) weighted, summed over the 6 splits, cast, and the 4
# real rows sliced; and one whose elementwise result is its output.
MERGE_FUSION = [
    "  %param_0 = f32[2,6,16,8]{3,2,1,0} parameter(0)",
    "  %param_1 = f32[2,6,16]{2,1,0} parameter(1)",
    "  %b = f32[2,6,16,8]{3,2,1,0} broadcast(%param_1), dimensions={0,1,2}",
    "  %m = f32[2,6,16,8]{3,2,1,0} multiply(%param_0, %b)",
    "  %z = f32[] constant(0)",
    "  %r = f32[2,16,8]{2,1,0} reduce(%m, %z), dimensions={1}, to_apply=%add",
    "  %c = bf16[2,16,8]{2,1,0} convert(%r)",
    "  ROOT %s = bf16[2,4,8]{2,1,0} slice(%c), slice={[0:2], [0:4], [0:8]}",
]
WHOLE_FUSION = [
    "  %param_0 = f32[2,16]{1,0} parameter(0)",
    "  %e = f32[2,16]{1,0} exponential(%param_0)",
    "  %s = f32[2,4]{1,0} slice(%e), slice={[0:2], [0:4]}",
    "  ROOT %t = (f32[2,16]{1,0}, f32[2,4]{1,0}) tuple(%e, %s)",
]


def test_fused_reads_count_the_share_a_slice_keeps():
    """A loop fusion computes the elements it outputs: a slice of a value computed element by
    element (through a reduction over another axis) reads that share of the parameters (a quarter
    of the partial outputs and of their weights); where the whole value is also an output, all."""
    fused_reads = gpu_script("common")._fused_reads
    assert fused_reads(MERGE_FUSION, 0, 2 * 6 * 16 * 8 * 4) == 2 * 6 * 4 * 8 * 4
    assert fused_reads(MERGE_FUSION, 1, 2 * 6 * 16 * 4) == 2 * 6 * 4 * 4
    assert fused_reads(WHOLE_FUSION, 0, 2 * 16 * 4) == 2 * 16 * 4


# A decoding loop as XLA:GPU prints it, cut down: the decode loop's body holds a layer scan of 4
# trips whose kernel (a custom call) is handed the whole stacked cache [4, 2, 64] float32, and a
# fusion that slices one layer out of it and gathers 1 row of 64 floats.
TRIPS = ', backend_config={"known_trip_count":{"n":"%d"}}'
LOOPS_HLO = "\n".join(
    [
        "%fused_take (param_0.1: f32[4,2,64], param_1.1: s32[]) -> f32[1,64] {",
        "  %param_0.1 = f32[4,2,64]{2,1,0} parameter(0)",
        "  %param_1.1 = s32[] parameter(1)",
        "  %c = s32[] constant(0)",
        "  %ds = f32[1,2,64]{2,1,0} dynamic-slice(%param_0.1, %param_1.1, %c, %c), "
        "dynamic_slice_sizes={1,2,64}",
        "  %layer = f32[2,64]{1,0} bitcast(%ds)",
        "  %idx = s32[1,1]{1,0} constant({ {1} })",
        "  ROOT %g = f32[1,64]{1,0} gather(%layer, %idx), offset_dims={1}, "
        "collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,64}",
        "}",
        "",
        "%layers (p.1: (s32[], f32[4,2,64])) -> (s32[], f32[4,2,64]) {",
        "  %p.1 = (s32[], f32[4,2,64]{2,1,0}) parameter(0)",
        "  %i = s32[] get-tuple-element(%p.1), index=0",
        "  %cache = f32[4,2,64]{2,1,0} get-tuple-element(%p.1), index=1",
        '  %kernel = f32[2,8]{1,0} custom-call(%cache), custom_call_target="__gpu$xla.gpu.triton"',
        "  %take = f32[1,64]{1,0} fusion(%cache, %i), kind=kLoop, calls=%fused_take",
        "  ROOT %t.1 = (s32[], f32[4,2,64]{2,1,0}) tuple(%i, %cache)",
        "}",
        "",
        "%decode (p.2: (s32[], f32[4,2,64])) -> (s32[], f32[4,2,64]) {",
        "  %p.2 = (s32[], f32[4,2,64]{2,1,0}) parameter(0)",
        "  %w = (s32[], f32[4,2,64]{2,1,0}) while(%p.2), condition=%cond, body=%layers" + TRIPS % 4,
        "  %x = f32[4,2,64]{2,1,0} get-tuple-element(%w), index=1",
        "  %n = f32[4,2,64]{2,1,0} negate(%x)",
        "  ROOT %t.2 = (s32[], f32[4,2,64]{2,1,0}) tuple(%i, %n)",
        "}",
        "",
        "ENTRY %main (p.3: (s32[], f32[4,2,64])) -> (s32[], f32[4,2,64]) {",
        "  %p.3 = (s32[], f32[4,2,64]{2,1,0}) parameter(0)",
        "  ROOT %w.1 = (s32[], f32[4,2,64]{2,1,0}) while(%p.3), condition=%cond, body=%decode"
        + TRIPS % 5,
        "}",
    ]
)


def test_loop_traffic_counts_the_layer_scan_a_kernel_reading_its_layer_in_place():
    """``aot.py --traffic``'s count of the decoding loop's loops (``common.loop_traffic``): every
    trip of the layer scan; the kernel handed the stacked cache [4, 2, 64] reads one layer of it
    (512 bytes) and writes its [2, 8] result (64 bytes); the fusion that slices a layer (512 bytes)
    and gathers a row counts the row (256 bytes, read and written) and the layer index (4 bytes);
    the decode loop's own negate (outside the scan) is ``step_traffic``'s alone."""
    common = gpu_script("common")
    items = []
    loops = common.loop_traffic(LOOPS_HLO, items)
    assert loops == {"loop w (4 trips)": 4 * ((512 + 64) + (256 + 4 + 256))}, loops
    assert sorted((n, op) for _, _, n, op, _ in items) == [
        ("kernel", "custom-call"),
        ("take", "fusion"),
    ]
    assert common.step_traffic(LOOPS_HLO) == {"step": 2 * 4 * 2 * 64 * 4}


def test_moved_bytes_reads_xla_gpus_asynchronous_slice_copies():
    """On XLA:GPU's compile of the 8B decoding step
    (``benchmarks/gpu/aot.py --caches full --batches 1 --hlo``, full cache, batch 1; jax 0.11.2),
    the Triton GEMM fusions' copies of each layer's weights are asynchronous ``fusion-start``s: wq,
    wo and the three MLP matrices of every layer (wk and wv are read in place); with kvjax's options
    (cuBLAS) nothing is copied."""
    import gzip

    moved_bytes = gpu_script("layers_part").moved_bytes
    cfg = gpu_script("model_part").LLAMA_8B
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.d_ff
    per_layer = 2 * (2 * d * cfg.n_heads * hd + 3 * d * f)

    def read(name):
        return gzip.decompress((Path(__file__).parent / "data" / name).read_bytes()).decode()

    triton = read("xla_gpu_8b_decode_triton_gemms.hlo.gz")
    assert "fusion-start" in triton
    assert 0 <= moved_bytes(triton) - cfg.n_layers * per_layer < 1000  # and a few indices
    assert moved_bytes(read("xla_gpu_8b_decode_kvjax_options.hlo.gz")) < 1000


def test_moved_bytes_reads_slices_whose_fusion_wraps_the_layer_index():
    """XLA:GPU's compile of SnapKV 1024's decoding step at batch 64 before 2026-11-28
    (``set_layer_slots`` wrote each layer's updated slice back;
    ``aot.py --caches "snapkv 1024" --batches 64 --hlo``): each layer's keys and values [1, 64, 8,
    1025, 128] are sliced out by fusions that also wrap the layer index (scalar compare, add,
    select). The card's profile put 5.2 ms per step in them; they count, 32 layers × 2 × 134 MB."""
    import gzip

    moved_bytes = gpu_script("layers_part").moved_bytes
    text = gzip.decompress(
        (
            Path(__file__).parent / "data" / "xla_gpu_8b_decode_snapkv1024_b64_write_back.hlo.gz"
        ).read_bytes()
    ).decode()
    per_layer = 2 * 64 * 8 * 1025 * 128 * 2
    assert 32 * per_layer <= moved_bytes(text) < 32 * per_layer + 10**9


def test_a_failing_decode_kernel_sends_every_row_to_xla(monkeypatch):
    """common.decode_attention: a decode kernel that raises, or that is off XLA's output, makes the
    parts run XLA's attention, and says why."""
    import kvjax.kernels

    decode_attention = gpu_script("common").decode_attention
    real = kvjax.kernels.decode_attention_with_scores

    def broken(*args, impl=None, **kwargs):
        if impl != "xla":
            raise RuntimeError("triton: unsupported layout")
        return real(*args, impl=impl, **kwargs)

    monkeypatch.setattr(kvjax.kernels, "decode_attention_with_scores", broken)
    impl, why = decode_attention()
    assert impl == "xla" and "failed" in why and "unsupported layout" in why

    def off(*args, impl=None, **kwargs):
        out = real(*args, impl=impl, **kwargs)
        return out if impl == "xla" else (out[0] * 1.5, *out[1:])

    monkeypatch.setattr(kvjax.kernels, "decode_attention_with_scores", off)
    impl, why = decode_attention()
    assert impl == "xla" and "off XLA's" in why


def test_report_renders_stored_results_made_before_the_read_floor_and_compiled_peers():
    """Calls 1–4's files have no read rate, no read floor and no peer mode: the report still
    renders them, blanks where a figure is missing, every eager peer row beside kvjax's."""
    report = gpu_script("report")
    results = GPU_SCRIPT / "results"
    names = ["2026-11-26-h200-call1", "2026-11-28-h200-call4a"]
    text = report.render(report.combine([report.load(results / n) for n in names], names), names)
    assert "read rate not measured (before call 5); the H200's specification: 4.8 TB/s" in text
    # call 4a's batch-1 row: its floor, no read floor
    assert "| full | default | 4096 | 1 | 5.35 | 187 | 4.70 | 1.14 |  |  | 0.54 |" in text
    # transformers' batch 32 (eager), beside kvjax's full cache: 3198 / 336 tokens/s
    assert "| decode | eager | 4096 | 32 | 336 | 95.32 |  | 3198 | 9.53 |" in text
    assert "kvjax (full) decode >= transformers (eager) at batch 32, 4096 | 3198 vs 336" in text
    # no compiled peer rows and no kvpress table; issue 59's targets "not measured" (call 4a's
    # MomentKV and AdaKV at batch 64 measured)
    assert "| decode | compiled" not in text and "### kvpress" not in text
    assert "decode >= transformers (compiled) at batch 1, 4096 |  | not measured |" in text
    assert "batch-64 decode within 1.3x of its floor (momentkv 1024, 4096) | 28.46 ms" in text


def test_report_puts_both_floors_and_the_peers_beside_kvjax():
    report = gpu_script("report")
    full = {"cache": "full", "impl": "default", "context": 4096}
    merged = {
        "meta": {
            "model": {
                "device": "gpu:NVIDIA H200 x1",
                "ceilings": {
                    "copy_gb_s": 3300.0,
                    "copy_bytes": 1,
                    "read_gb_s": 4000.0,
                    "read_bytes": 1,
                    "matmul_tflops": 700.0,
                    "matmul_n": 8192,
                },
            }
        },
        "parts": {
            "decode": [
                {
                    **full,
                    "batch": b,
                    "ms_per_step": ms,
                    "tokens_per_s": b / ms * 1e3,
                    "floor_ms": 4.7,
                    "step_over_floor": ms / 4.7,
                    "read_floor_ms": 3.9,
                    "step_over_read_floor": ms / 3.9,
                    "kv_bytes_kept": 5e8,
                    "compile_s": 3.0,
                }
                for b, ms in ((1, 5.0), (32, 10.0))
            ],
            "prefill": [
                {
                    **full,
                    "cache": c,
                    "tokens_per_s": t,
                    "seconds": 0.1,
                    "first_call_s": 1.0,
                    "compile_s": 1.0,
                }
                for c, t in (("full", 40000.0), ("snapkv 1024", 17000.0), ("adakv 1024", 11000.0))
            ],
            "compress": [
                {
                    "scorer": c,
                    "budget": 1024,
                    "context": 4096,
                    "kept_per_head": 1024.0,
                    "seconds": 4096 / t,
                    "tokens_per_s": t,
                    "first_call_s": 9.0,
                }
                for c, t in (("kvzip", 12000.0), ("expected-attention", 30000.0))
            ],
            "peer": {
                "transformers": "5.17.0",
                "torch": "2.11.0",
                "device_name": "NVIDIA H200",
                "compile": "torch.compile(model.forward, mode='reduce-overhead')",
                "prefill": [],
                "decode": [
                    {
                        "mode": "eager",
                        "context": 4096,
                        "batch": 32,
                        "ms_per_step": 100.0,
                        "tokens_per_s": 320.0,
                    },
                    {
                        "mode": "compiled",
                        "context": 4096,
                        "batch": 32,
                        "ms_per_step": 20.0,
                        "tokens_per_s": 1600.0,
                        "compile_s": 80.0,
                    },
                    {"mode": "compiled", "context": 4096, "batch": 8, "error": "not run: 3 s left"},
                ],
            },
            "kvpress": {
                "kvpress": "0.5.5",
                "budget": 1024,
                "stubbed": ["datasets"],
                "prefill": [{"context": 4096, "seconds": 0.2, "tokens_per_s": 20480.0}],
                "compress": [
                    {
                        "press": p,
                        "context": 4096,
                        "compression_ratio": 0.75,
                        "kept_per_head": 1024.0,
                        "seconds": s,
                        "tokens_per_s": 4096 / s,
                        "timed": 2,
                        "prefill_s": 0.2,
                        "overhead_s": s - 0.2,
                    }
                    for p, s in (("KVzipPress", 0.8), ("ExpectedAttentionPress", 0.256))
                ],
            },
        },
    }
    text = report.render(merged)
    assert (
        "copy 3300 GB/s counting bytes read and written, read 4000 GB/s (a sum over the same "
        "array, bytes read); the H200's specification: 4.8 TB/s (read at 83% of it)"
    ) in text
    assert "| full | default | 4096 | 1 | 5.00 | 200 | 4.70 | 1.06 | 3.90 | 1.28 |" in text
    assert "5.00 ms vs floor 4.70 ms = 1.06x (read floor 3.90 ms: 1.28x) | yes |" in text
    # each transformers row beside kvjax's full cache at its shape (3200 tokens/s at batch 32)
    assert "| decode | eager | 4096 | 32 | 320 | 100.00 |  | 3200 | 10.00 |" in text
    assert "| decode | compiled | 4096 | 32 | 1600 | 20.00 | 80.0 | 3200 | 2.00 |" in text
    assert "| decode | compiled | 4096 | 8 | not run: 3 s left |" in text
    assert "kvjax (full) decode >= transformers (compiled) at batch 32, 4096 | 3200 vs 1600" in text
    assert "| KVzipPress | 4096 | 0.75000 | 1024.0 | 0.800 | 5120 | 2 | 0.200 | 0.600 |" in text
    # kvpress's presses beside kvjax's compressions and prefills at the same budget
    assert "| kvzip | 1024 | 4096 | 1024.0 | 0.341 | 12000 | 9.00 |" in text
    assert (
        "| context | kvjax kvzip 1024 | kvjax expected-attention 1024 | kvjax full | "
        "kvjax snapkv 1024 | transformers, no press | KVzipPress | ExpectedAttentionPress |"
    ) in text
    assert "| 4096 | 12000 | 30000 | 40000 | 17000 | 20480 | 5120 | 16000 |" in text


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_peer_script_starts_no_row_after_its_deadline(tmp_path):
    """peer_transformers.py at a deadline already passed: every row, eager and compiled, is a "not
    run" row, the object says where it stopped, and the file it keeps is what it prints."""
    out = tmp_path / "peer.json"
    done = subprocess.run(
        [
            sys.executable,
            str(GPU_SCRIPT / "peer_transformers.py"),
            "--smoke",
            "--seconds",
            "0",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    peer = json.loads(done.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == peer
    rows = peer["prefill"] + peer["decode"]
    assert len(rows) == 2 + 6 + 2 + 1 and all(r["error"].startswith("not run") for r in rows)
    assert {r["mode"] for r in rows} == {"eager", "compiled"} and "stopped" in peer


@pytest.mark.slow  # needs kvpress's own environment, like the kvpress evaluations
@pytest.mark.skipif(not KVPRESS_PYTHON.exists(), reason="benchmarks/kvpress_baseline/setup.sh")
def test_kvpress_part_compresses_to_the_budget_under_its_interpreter(tmp_path):
    """The kvpress part, run by run.py under kvpress's own environment (``--peer-python``): both
    presses at both contexts keep kvjax's smoke budget (64) per KV head, KVzip through its chunked
    path, and the report shows them."""
    done = smoke(tmp_path, "--parts", "kvpress", "--peer-python", str(KVPRESS_PYTHON))
    assert done.returncode == 0, done.stderr[-4000:]
    kv = json.loads((tmp_path / "results.json").read_text())["parts"]["kvpress"]
    assert "error" not in kv and kv["kvpress"] == "0.5.5" and kv["budget"] == 64, kv
    rows = kv["compress"]
    assert [(r["press"], r["context"]) for r in rows] == [
        (p, c) for c in (256, 512) for p in ("KVzipPress", "ExpectedAttentionPress")
    ]
    assert all("error" not in r and r["kept_per_head"] == 64 and r["seconds"] > 0 for r in rows)
    assert [r["compression_ratio"] for r in rows] == [0.75, 0.75, 0.875, 0.875]
    assert (
        "### kvpress 0.5.5" in done.stdout
        and "| KVzipPress | 512 | 0.87500 | 64.0 |" in done.stdout
    )


def test_targets_judge_the_plain_snapkv_row_not_its_variants():
    """The targets' SnapKV is "snapkv N" at the largest budget, never a variant of a row (here a
    quantized cache at a larger budget; until this test, a variant of the same budget could be
    picked by set order)."""
    report = gpu_script("report")
    rows = [
        {
            "cache": cache,
            "impl": "default",
            "context": 4096,
            "batch": 1,
            "tokens_per_s": 100.0,
            "ms_per_step": 10.0,
            "floor_ms": 8.0,
            "step_over_floor": 1.25,
            "read_floor_ms": 7.0,
            "step_over_read_floor": 1.43,
        }
        for cache in ("full", "snapkv 1024", "snapkv 2048 int8")
    ]
    text = "\n".join(report.targets({"meta": {}, "parts": {"decode": rows}}))
    assert "(snapkv 1024, 4096)" in text and "budget 1024 >= 3x" in text
    assert "int8" not in text
