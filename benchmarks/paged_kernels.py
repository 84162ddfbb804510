"""Paged kernels of ``kvjax.kernels.paged_attention``: the cache bytes a pass reads, paged versus
gathered.

    .venv/bin/python benchmarks/paged_kernels.py  # instant: computed from the shapes
    .venv/bin/python benchmarks/paged_kernels.py --page-size 32 --dtype float32

CPU times of the reference and of interpreted kernels say nothing about a TPU or GPU (and none was
available), so this prints what the kernels' design decides instead: the K and V bytes one pass over
the cache reads for a whole model (every layer, one sequence), when per-head budgets differ.

* paged: the kernels read the used pages only, n_pages·P slots per (layer, KV head);
* gathered: gathering each head's pages into the dense [Hk, M·P, K] layout first (what the reference
  does, and what the dense kernels would need) reads M pages per head — M, the page-table width, is
  the largest head's page count over all layers, since one static shape serves every layer (a scan
  over layers) — writes that copy, and the dense kernel reads it again: 3·M·P slots per head.

Cache memory follows the same numbers: the paged pool holds the used pages, a dense cache holds M·P
slots for every (layer, KV head) — and one pass of the dense kernels over it reads all of them.

Allocations, all with the same total (average budget × layers × KV heads), in pages of P tokens (a
head keeps at least one page):

* uniform: every head the average budget;
* adakv: per layer, the heads' shares of the layer's total skewed (log-normal, σ = 1, seeded) —
  AdaKV;
* pyramid: the layers' totals decreasing linearly from 1.8× to 0.2× the average — PyramidKV;
* global: shares of the model's total skewed over all (layer, head) pairs (log-normal, σ = 1).

The slot positions ([M·P] int32 per head; the TPU kernels fetch them up to the last used key block)
and the page tables are not counted: ≤ 4 bytes per slot against 2·K·itemsize bytes of K and V.
"""

from __future__ import annotations

import argparse

import numpy as np

MODELS = {  # name -> (layers, KV heads, head dim)
    "SmolLM2-135M": (30, 3, 64),
    "Llama-3-8B": (32, 8, 128),
}
BUDGETS = (128, 512, 2048)  # average tokens per (layer, KV head)
ALLOCATIONS = ("uniform", "adakv", "pyramid", "global")


def allocate(kind: str, layers: int, heads: int, budget: int, seed: int = 0) -> np.ndarray:
    """[layers, heads] token budgets summing (up to rounding) to layers · heads · budget."""
    r = np.random.default_rng(seed)
    total = layers * heads * budget
    if kind == "uniform":
        share = np.ones((layers, heads))
    elif kind == "adakv":
        share = r.lognormal(0.0, 1.0, (layers, heads))
        share /= share.sum(1, keepdims=True)
    elif kind == "pyramid":
        share = np.repeat(np.linspace(1.8, 0.2, layers)[:, None], heads, axis=1)
    else:
        share = r.lognormal(0.0, 1.0, (layers, heads))
    return np.round(total * share / share.sum()).astype(int)


def pages(budgets: np.ndarray, page_size: int) -> np.ndarray:
    return np.maximum(1, -(-budgets // page_size))


def mib(x) -> str:
    return f"{x / 2**20:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    P, s = args.page_size, 2 if args.dtype == "bfloat16" else 4

    print(
        f"K and V bytes of one pass over the cache, whole model, one sequence; pages of {P} "
        "tokens, "
        f"{args.dtype}. Computed from the shapes (no device timing).\n"
    )
    print(
        "| model | allocation | average budget | table width M (pages) | pages used / L·Hk·M | "
        "paged: pool = pass reads (MiB) | dense cache of width M = pass reads (MiB) | "
        "gathered: gather + copy + pass (MiB) | gathered / paged |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for model, (layers, heads, head_dim) in MODELS.items():
        slot_bytes = 2 * head_dim * s  # K and V of one slot
        for budget in BUDGETS:
            for kind in ALLOCATIONS:
                n = pages(allocate(kind, layers, heads, budget), P)
                width = int(n.max())
                used = int(n.sum()) * P * slot_bytes
                dense = layers * heads * width * P * slot_bytes
                print(
                    f"| {model} | {kind} | {budget} | {width} | "
                    f"{n.sum() / (layers * heads * width):.2f} | "
                    f"{mib(used)} | {mib(dense)} | {mib(3 * dense)} | {3 * dense / used:.1f} |"
                )


if __name__ == "__main__":
    main()
