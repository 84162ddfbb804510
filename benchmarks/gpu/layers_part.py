"""Part "layers": where a decode step's bytes go in the layer loop (NOTES.md, call 2: batch-1 decode
ran at 3.3× its byte floor). One step of the 8B-shaped model's layers (``decode_hidden``: no
sampling, no logits) against a full cache of 4K tokens, at batch 1 and 64, five ways (on a CPU: its
first 4 layers in float32, batch 1 and 8; ``python benchmarks/gpu/run.py --parts layers --out DIR``
runs it there too):

- ``scan``: a ``lax.scan`` over the stacked layers, as kvjax runs them, compiled with XLA's defaults
  (XLA slices each layer's weights and keys and values out of the stacked arrays);
- ``scan, cuBLAS``: the same program compiled with kvjax's options on a GPU (``kvjax.runtime.jit``:
  no Triton GEMM fusions, so that cuBLAS, through XLA's dynamic-slice fusion, reads the slices in
  place);
- ``scan, Triton GEMMs``: compiled with ``xla_gpu_triton_gemm_any`` (every product a Triton GEMM
  fusion, which may read its operand through the slice);
- ``unstacked``: ``decode_hidden`` of ``kvjax.unstack_layers(params)``, every layer's weights a
  separate array run by an unrolled loop (no weight slicing; the cache is still stacked);
- ``unstacked, cache per layer``: the same loop written here with a cache per layer (nothing sliced
  at all).

Each row: ms per step, its floor (weights but the embedding table, plus the cache's keys and values,
over the copy bandwidth measured in this part; ``read_floor_ms``: over the read bandwidth), and the
bytes the compiled program writes per step by instructions that only slice or copy (read from the
optimized HLO, loop bodies counted once per trip). Each variant's batch-1 HLO is written to
``OUT/hlo/``.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
from common import (
    HLO_BYTES,
    Compiler,
    Deadline,
    Hlo,
    Results,
    decode_attention,
    floors,
    guarded,
    log,
    measure_ceilings,
    median_seconds,
)
from model_part import LLAMA_8B, sizes

import kvjax
from kvjax.cache.full import FullCache
from kvjax.model.decoder import decode_hidden, decoder_layer, rms_norm
from kvjax.model.rope import inverse_frequencies
from kvjax.model.segment import Segment
from kvjax.runtime.jit import OPTIONS as KVJAX_OPTIONS

VARIANTS = ("scan", "scan, cuBLAS", "scan, Triton GEMMs", "unstacked", "unstacked, cache per layer")
OPTIONS = {  # the scan variants compiled with XLA options
    "scan, cuBLAS": KVJAX_OPTIONS["gpu"],
    "scan, Triton GEMMs": {
        "xla_gpu_triton_gemm_any": True
    },  # Triton GEMM fusions may take the slice as operand
}
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(")
_SLICING = {"slice", "dynamic-slice"}
_FREE = {"parameter", "constant", "bitcast"}


def moved_bytes(hlo: str) -> int:
    """Bytes written per call of an optimized HLO module by instructions that only slice or copy:
    ``copy``, ``slice`` and ``dynamic-slice`` ops and fusions of nothing else but scalar index
    arithmetic (``fusion`` or XLA:GPU's asynchronous ``fusion-start``), outside fused computations;
    those in ``while`` bodies times their loops' known trip counts. (Until 2026-11-28 the index
    arithmetic, JAX's wrapping of a negative layer index, hid the budget caches' per-layer copies of
    their keys and values.)"""
    prog = Hlo.parse(hlo)

    # (op, bytes written, line); op None: a tuple's or a
    def parse(
        line: str,
    ) -> tuple[str | None, int, str]:
        m = _INSTR.match(line)  # scalar's
        if m is None or not m.group(3):
            return None, 0, line
        return (
            m.group(4),
            HLO_BYTES.get(m.group(2), 4) * math.prod(int(d) for d in m.group(3).split(",")),
            line,
        )

    instrs = {name: [parse(line) for line in body] for name, body in prog.lines.items()}
    called = lambda line: re.findall(r"calls=%([\w.\-]+)", line)  # noqa: E731
    fused = {c for body in prog.lines.values() for line in body for c in called(line)}
    only_slices = {
        c
        for c in fused
        if c in instrs
        and {op for op, _, _ in instrs[c] if op is not None} - _FREE <= _SLICING | {"copy"}
    }
    root = {
        c: next((size for _, size, line in instrs[c] if line.lstrip().startswith("ROOT")), 0)
        for c in only_slices
    }
    total = 0
    for name, body in instrs.items():
        if name in fused:
            continue
        times = prog.times(name)
        for op, size, line in body:
            if op in _SLICING | {"copy"}:
                total += times * size
            elif re.search(r" fusion(?:-start)?\(", line):
                total += times * sum(root[c] for c in called(line) if c in root)
    return total


def per_layer_caches_step(cfg, layers, embed, tokens, caches, seg):
    """``decode_hidden`` of unstacked ``layers`` over a list of caches of one layer each."""
    inv_freq = inverse_frequencies(cfg)
    x = jnp.take(embed, tokens, axis=0)
    for i, p in enumerate(layers):
        (x,), (caches[i],) = decoder_layer(
            cfg, (x,), p, jnp.int32(0), (caches[i],), (seg,), inv_freq
        )
    return x, caches


def layer_sizes(smoke: bool) -> tuple:
    """(config, dtype, context, batches): the 8B-shaped model in bfloat16 on a GPU; on a CPU its
    first 4 layers in float32 (the CPU emulates bfloat16 products); tiny, batch 1 alone, for the
    smoke run."""
    if smoke:
        sz = sizes(True)
        return sz.cfg, jnp.bfloat16, sz.contexts[0], (1,)
    if jax.default_backend() == "cpu":
        return dataclasses.replace(LLAMA_8B, n_layers=4), jnp.float32, 4096, (1, 8)
    return LLAMA_8B, jnp.bfloat16, 4096, (1, 64)


def run(results: Results, deadline: Deadline, compiler: Compiler, smoke: bool) -> None:
    cfg, dtype, context, batches = layer_sizes(smoke)
    ceilings = measure_ceilings(smoke)
    results.meta["ceilings"] = ceilings.__dict__
    attention, results.meta["decode_attention"] = decode_attention()
    log(f"layers: {results.meta['decode_attention']}")
    params = jax.block_until_ready(
        jax.jit(kvjax.init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), dtype)
    )
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params.layers)) + (
        params.final_norm.size * params.final_norm.dtype.itemsize
    )
    unstacked = kvjax.unstack_layers(params)
    hlo_dir = results.path.parent.parent / "hlo"
    hlo_dir.mkdir(parents=True, exist_ok=True)
    log(f"layers: {cfg.n_layers} layers, weights {weight_bytes / 1e9:.2f} GB, context {context}")

    def per_layer_caches(layers, embed, tokens, caches, seg):
        x, caches = per_layer_caches_step(cfg, layers, embed, tokens, caches, seg)
        return rms_norm(x, params.final_norm, cfg.norm_eps), caches

    def inputs(variant: str, batch: int, key=None):
        """(tokens, cache, segment) of one step; with ``key`` None, the cache's shapes alone."""
        tokens = jnp.ones((batch, 1), jnp.int32)
        seg = Segment(positions=jnp.full((batch, 1), context - 1, jnp.int32), from_start=False)
        per_layer = variant == "unstacked, cache per layer"
        one = dataclasses.replace(cfg, n_layers=1) if per_layer else cfg
        shape = jax.eval_shape(lambda: FullCache.init(one, batch, context, dtype, attention))

        def fill(i):  # random, never a zero copy
            if key is None:
                return shape
            k, v = jax.random.fold_in(key, 2 * i), jax.random.fold_in(key, 2 * i + 1)
            return shape.replace(
                k=jax.random.normal(k, shape.k.shape, shape.k.dtype),
                v=jax.random.normal(v, shape.v.shape, shape.v.dtype),
            )

        cache = [fill(i) for i in range(cfg.n_layers)] if per_layer else fill(0)
        return tokens, cache, seg

    def program(variant: str) -> tuple:
        if variant.startswith("scan") or variant == "unstacked":
            return jax.jit(decode_hidden, donate_argnums=2), (
                unstacked if variant == "unstacked" else params,
            )
        return jax.jit(per_layer_caches, donate_argnums=3), (unstacked.layers, params.embed)

    futures = {}  # every program compiles in the background, in the order measured
    for batch in batches:
        for variant in VARIANTS:
            fn, args = program(variant)
            options = OPTIONS.get(variant)
            futures[variant, batch] = compiler.submit(
                fn, *args, *inputs(variant, batch), options=options
            )

    for batch in batches:
        for variant in VARIANTS:
            label = {
                "variant": variant,
                "layers": cfg.n_layers,
                "dtype": jnp.dtype(dtype).name,
                "context": context,
                "batch": batch,
            }
            if deadline.passed():
                results.add("layers", {**label, "error": "not run: the part's deadline passed"})
                continue

            def measure(variant=variant, batch=batch):
                compiled, compile_s = futures[variant, batch].result(
                    timeout=max(1.0, deadline.left())
                )
                hlo = compiled.as_text()
                if batch == batches[0]:
                    (hlo_dir / f"{variant.replace(', ', '+').replace(' ', '-')}.txt").write_text(
                        hlo
                    )
                args = program(variant)[1]
                tokens, cache, seg = inputs(variant, batch, jax.random.key(batch))
                state = {"cache": cache}

                def step():
                    out, state["cache"] = compiled(*args, tokens, state["cache"], seg)
                    return out

                seconds = median_seconds(step, 7)
                kv_bytes = (
                    2
                    * batch
                    * cfg.n_layers
                    * cfg.n_kv_heads
                    * context
                    * cfg.head_dim
                    * jnp.dtype(dtype).itemsize
                )
                floor = floors(ceilings, weight_bytes + kv_bytes)
                return {
                    "ms_per_step": 1e3 * seconds,
                    "floor_ms": 1e3 * floor["floor_s"],
                    "ratio": seconds / floor["floor_s"],
                    "read_floor_ms": 1e3 * floor["read_floor_s"],
                    "step_over_read_floor": seconds / floor["read_floor_s"],
                    "moved_gb_per_step": moved_bytes(hlo) / 1e9,
                    "kv_gb": kv_bytes / 1e9,
                    "compile_s": compile_s,
                }

            row = guarded(results, "layers", label, measure)
            if row:
                log(
                    f"layers {variant}, batch {batch}: {row['ms_per_step']:.2f} ms/step, "
                    f"{row['ratio']:.2f}× floor, {row['moved_gb_per_step']:.3g} GB sliced or copied"
                )


def tables(results: Results) -> list[str]:
    rows = results.rows("layers")
    if not rows:
        return []
    out = [
        "### The layer loop: one decode step of the layers over a full cache",
        "",
        "| variant | layers | dtype | context | batch | ms/step | floor ms | step / floor | "
        "read floor ms | step / read floor | sliced or copied GB per step | K/V GB |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        head = f"| {r['variant']} | {r['layers']} | {r['dtype']} | {r['context']} | {r['batch']} |"
        if "error" in r:
            out.append(f"{head} {r['error'][:200]} | | | | | | |")
        else:
            # the read floor: absent before call 5
            read = (
                f"{r['read_floor_ms']:.2f} | {r['step_over_read_floor']:.2f}"
                if "read_floor_ms" in r
                else " |"
            )
            out.append(
                f"{head} {r['ms_per_step']:.2f} | {r['floor_ms']:.2f} | "
                f"{r['ratio']:.2f} | {read} | {r['moved_gb_per_step']:.3g} | {r['kv_gb']:.3g} |"
            )
    return out + [""]
