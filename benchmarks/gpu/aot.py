"""XLA:GPU's compile of kvjax's 8B decoding step for an H200, made on a CPU without a GPU (JAX's
deviceless ahead-of-time compilation: a compile-only CUDA client from a target description). What it
reads off the compiled programs: the temporaries XLA allocates, the bytes copied per step by
instructions that only slice or copy (``layers_part.moved_bytes``: a layer's weights taken out of
the stacked arrays), and which library runs the matrix products. No timings: nothing runs.

It needs the device image's JAX with its CUDA plugin, which wants Python 3.12 (about 5 GB of
wheels):

    python3.12 -m venv /tmp/aot && /tmp/aot/bin/pip install "jax[cuda13]==0.11.2" flax
    /tmp/aot/bin/pip install --no-deps -e .
    /tmp/aot/bin/python benchmarks/gpu/aot.py                     # about 3 minutes on 2 cores
    # the programs' text
    /tmp/aot/bin/python benchmarks/gpu/aot.py --caches full --batches 1 --hlo /tmp/hlo
    # what a step reads and writes outside the layer scan, each branch of its conditionals apart,
    # and in the layer scan (a kernel's stacked operand: its layer's share), beside its floor
    /tmp/aot/bin/python benchmarks/gpu/aot.py --caches "adakv 1024" --batches 64 --traffic

Variants: "kvjax" compiles with the options kvjax's programs take on a GPU
(``kvjax.runtime.jit.OPTIONS``: no Triton GEMM fusions, so cuBLAS reads each layer's weights in
place; no rematerialization pass); "triton" with Triton GEMM fusions allowed (XLA's default, and
kvjax's until 2026-11-28); "unstacked" is kvjax's options over ``kvjax.unstack_layers``; "remat" is
kvjax's options with XLA's rematerialization pass on (kvjax's until 2026-11-29). ``--variants``
picks. Checked against the card: call 2's measured temporaries at batch 1 (full cache 437.3 MB,
SnapKV 1024 440.5 MB) against this compile's with Triton GEMM fusions (436.2 and 446.8 MB: one
layer's weights, 436.2 MB, is the copy); call 3's with kvjax's options (full cache at batch 1
0.05 GB, SnapKV 1024 at 64 0.94 GB) against 50.4 and 943.9 MB here, whose copies of SnapKV's keys
and values the card's profile timed (benchmarks/gpu/NOTES.md). Without autotuning, the card's own
compile may choose other kernels for some products.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loop_traffic, step_traffic  # noqa: E402
from layers_part import moved_bytes  # noqa: E402
from model_part import LLAMA_8B, NEW, OUT_WIDTH, step_weight_bytes, tile_state  # noqa: E402

H200 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150754820096 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA" dnn_version_info { major: 9 minor: 28 } runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H200"
"""
TRITON = {"xla_gpu_enable_triton_gemm": True}
REMAT_OFF = "xla_disable_hlo_passes"  # kvjax's option that turns the rematerialization pass off


def compile_only_sharding() -> NamedSharding:
    """A sharding on one compile-only H200; Pallas' Triton lowering, which asks the local GPU for
    its compute capability, is told the H200's."""
    jax.config.update("jax_platforms", "cpu")
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: h200
    topology = topologies.get_topology_desc(platform="cuda", target_config=H200, topology="1x1x1")
    return NamedSharding(
        topologies.make_mesh(topo=topology, mesh_shape=(1,), axis_names=("x",)), PartitionSpec()
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--caches", nargs="+", default=["full", "snapkv 1024", "momentkv 1024", "adakv 1024"]
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument(
        "--hlo", type=Path, help="write each compiled program's text to this directory"
    )
    parser.add_argument(
        "--traffic",
        action="store_true",
        help="also print what kvjax's program reads and writes per step outside its loops "
        "(``common.step_traffic``): every step, and each branch of its conditionals; in each "
        "loop (``common.loop_traffic``: the layer scan); and the step's floor bytes",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["kvjax", "triton", "unstacked"],
        choices=["kvjax", "triton", "unstacked", "remat"],
        help="unstacked: at batch 1, full and SnapKV 1024 only",
    )
    parser.add_argument(
        "--top", type=int, default=10, help="with --traffic: the largest instructions counted"
    )
    args = parser.parse_args()
    on = compile_only_sharding()

    import kvjax
    from kvjax.runtime.decoding import decode_steps, feed_budget, feed_full
    from kvjax.runtime.inputs import round_capacity
    from kvjax.runtime.jit import OPTIONS
    from kvjax.runtime.options import eviction_from
    from kvjax.runtime.sampling import Sampling

    def place(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on), tree)

    params = place(
        jax.eval_shape(lambda: kvjax.init_params(LLAMA_8B, jax.random.key(0), jnp.bfloat16))
    )
    unstacked = place(jax.eval_shape(kvjax.unstack_layers, params))
    # a step's floor: the weights it reads, and each row's kept keys and values (bfloat16: the
    # budget and the new token per layer and KV head, or the whole context)
    weight_bytes = step_weight_bytes(params)
    cfg = LLAMA_8B

    def floor_kv_bytes(cache: str, batch: int) -> int:
        kept = args.context if cache == "full" else int(cache.split()[1])
        return batch * cfg.n_layers * cfg.n_kv_heads * (kept + 1) * 2 * cfg.head_dim * 2

    tokens = jax.ShapeDtypeStruct((1, args.context), jnp.int32)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    n = jax.ShapeDtypeStruct((), jnp.int32, sharding=on)

    def state(cache: str, batch: int):
        if cache == "full":
            feed = functools.partial(
                feed_full, capacity=round_capacity(args.context + NEW), out_width=OUT_WIDTH
            )
            return jax.eval_shape(
                functools.partial(tile_state, batch=batch),
                jax.eval_shape(feed, params, tokens, lengths, key),
            ), None
        scorer, budget, *every = cache.split()  # "snapkv 1024", "snapkv 1024 every 16"
        options = {"evict_every": int(every[1])} if every else {}
        ev = eviction_from(context=args.context, budget=int(budget), scorer=scorer, **options)
        feed = functools.partial(
            feed_budget, ev=ev, out_width=OUT_WIDTH, decode_spare=ev.decode_spare(OUT_WIDTH)
        )
        one = jax.eval_shape(feed, params, None, tokens, lengths, lengths, key)
        return jax.eval_shape(functools.partial(tile_state, batch=batch), one), ev

    print(
        f"XLA:GPU (jax {jax.__version__}, compile-only NVIDIA H200), Llama-3.1-8B's shapes in "
        "bfloat16, "
        f"{args.context}-token context, one program of the decoding loop per row\n"
    )
    print(
        "| cache | batch | variant | temporaries MB | sliced or copied per step MB | products: "
        "cuBLAS / Triton "
        "| compile s |"
    )
    print("| --- | ---: | --- | ---: | ---: | --- | ---: |")
    for cache in args.caches:
        for batch in args.batches:
            variants = [v for v in args.variants if v != "unstacked"] + (
                ["unstacked"]
                if "unstacked" in args.variants and batch == 1 and cache in ("full", "snapkv 1024")
                else []
            )
            for variant in variants:
                s, ev = state(cache, batch)
                t0 = time.perf_counter()
                lowered = decode_steps.lower(
                    unstacked if variant == "unstacked" else params,
                    place(s),
                    n,
                    n,
                    Sampling(),
                    (),
                    None if ev is None else ev.decoding(),
                )
                compiled = lowered.compile(
                    TRITON
                    if variant == "triton"
                    else {k: v for k, v in OPTIONS["gpu"].items() if k != REMAT_OFF}
                    if variant == "remat"
                    else OPTIONS["gpu"]
                )
                seconds = time.perf_counter() - t0
                text = compiled.as_text()
                if args.hlo:
                    args.hlo.mkdir(parents=True, exist_ok=True)
                    (args.hlo / f"{cache.replace(' ', '')}-{batch}-{variant}.txt").write_text(text)
                cublas, triton = (
                    text.count('custom_call_target="__cublas'),
                    text.count("__triton_nested_gemm"),
                )
                print(
                    f"| {cache} | {batch} | {variant} | "
                    f"{compiled.memory_analysis().temp_size_in_bytes / 1e6:.1f} "
                    f"| {moved_bytes(text) / 1e6:.1f} | {cublas} / {triton} | {seconds:.1f} |",
                    flush=True,
                )
                if args.traffic and variant in ("kvjax", "remat"):
                    floor = weight_bytes + floor_kv_bytes(cache, batch)
                    print(f"    {cache} at {batch}, floor: {floor / 1e9:.2f} GB", flush=True)
                    items = []
                    moved = {**step_traffic(text, items), **loop_traffic(text, items)}
                    for where, nbytes in moved.items():
                        print(f"    {cache} at {batch}, {where}: {nbytes / 1e9:.2f} GB", flush=True)
                    for nbytes, where, name, op, line in sorted(items, reverse=True)[: args.top]:
                        shape = line.split(" = ", 1)[1].split(f" {op}(")[0][:60]
                        print(f"      {nbytes / 1e9:.2f} GB {where}: {name} {op} {shape}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
