"""What a compressed 4K-token context allocates on SmolLM2-135M-Instruct, per allocation and budget.

    .venv/bin/python benchmarks/cache_bytes.py

Shapes only (``jax.eval_shape`` of the cache a compressed context decodes from, one spare slot per
head), so it runs in seconds and needs no weights. "keys + values" is what
``kvjax.cache_bytes(cache, kv_only=True)`` reports; "all leaves, SnapKV" adds positions, scorer
state, slot order, page tables and the evicted count; "all leaves, MomentKV" is the same under
``momentkv``, whose moments add their sums (Σk, Σv, Σvkᵀ); "one block per head" is what a dense
layout (every head sized for the largest share an allocation allows, as KVCache-Factory's padded
batches or a masked cache would need) would take for keys and values.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import kvjax
from kvjax.cache.full import FullCache
from kvjax.runtime.options import eviction_from

SMOLLM2 = kvjax.ModelConfig(
    arch="llama",
    vocab_size=49152,
    d_model=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    head_dim=64,
    d_ff=1536,
    max_seq_len=8192,
)


def cache_shape(cfg, batch: int, budget: int, allocation: str, scorer: str):
    """(eviction settings, the abstract cache a context compressed under them decodes from)."""
    ev = eviction_from(
        budget=budget,
        scorer=scorer,
        allocation=allocation,
        n_sink=0 if allocation == "pyramidkv" and budget < 100 else 4,
    )
    return ev, jax.eval_shape(lambda: ev.empty_cache(cfg, batch, ev.decode_spare(0), jnp.float32))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    cfg = SMOLLM2
    print(
        f"SmolLM2-135M-Instruct shapes, float32, a {args.context}-token context; MB = 10^6 bytes; "
        "pages of 16 "
        "tokens\n"
    )
    print(
        "| batch | budget | allocation | keys + values MB | vs uniform | all leaves, SnapKV MB | "
        "all leaves, MomentKV MB | one block per head MB |"
    )
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batches:
        full = jax.eval_shape(lambda: FullCache.init(cfg, batch, args.context, jnp.float32))
        mb = kvjax.cache_bytes(full) / 1e6
        print(f"| {batch} | full cache | – | {mb:.1f} | – | {mb:.1f} | – | – |")
        for budget in args.budgets:
            uniform = None
            for allocation in ("uniform", "pyramidkv", "adakv", "global"):
                ev, shape = cache_shape(cfg, batch, budget, allocation, "snapkv")
                moment = cache_shape(cfg, batch, budget, allocation, "momentkv")[1]
                kv = kvjax.cache_bytes(shape, kv_only=True)
                uniform = uniform or kv
                largest = ev.policy.head_capacity(cfg.n_layers, cfg.n_kv_heads) + 1
                dense = 2 * cfg.n_layers * batch * cfg.n_kv_heads * largest * cfg.head_dim * 4
                print(
                    f"| {batch} | {budget} | {allocation} | {kv / 1e6:.2f} | {kv / uniform:.3f}x | "
                    f"{kvjax.cache_bytes(shape) / 1e6:.2f} | {kvjax.cache_bytes(moment) / 1e6:.2f} "
                    "| "
                    f"{dense / 1e6:.2f} |"
                )


if __name__ == "__main__":
    main()
