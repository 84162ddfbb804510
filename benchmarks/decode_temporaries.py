"""What one more row costs a decoding step on Llama-3.1-8B's shapes: its state and the step's
temporaries, per scorer.

    .venv/bin/python benchmarks/decode_temporaries.py                   # about a minute on 2 cores
    .venv/bin/python benchmarks/decode_temporaries.py --scorers momentkv --layers 4

XLA's buffer assignment of ``kvjax.runtime.decoding.decode_steps`` compiled for this CPU from
abstract shapes (bfloat16 weights and cache, a 4K prompt compressed block-wise to ``--budget``,
evicting one token per step; no weights are allocated), at batch 1 and 8: "per row" is the
difference over 7 rows. The temporaries a row adds are what an eviction reading every slot's keys
and values holds in float32 (MomentKV, FastCAOTE) besides the step's own buffers; those at batch 1
are, on this CPU, mostly float32 copies of the bfloat16 weights. "Copied in the layer scan" is what
the ``copy`` instructions in the bodies of the loops inside the decode loop write per step (each
loop's copies times its trip count: the layers for the layer scan), per row: XLA's copies of stacked
cache arrays that a layer reads and writes back in place. XLA:GPU assigns buffers otherwise; the GPU
run's ``temp_bytes`` (benchmarks/gpu) are the card's figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import kvjax
from kvjax.runtime.decoding import decode_steps, feed_budget
from kvjax.runtime.options import eviction_from
from kvjax.runtime.sampling import Sampling

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from common import copied_bytes, loop_copies  # noqa: E402 - the GPU script's reading of compiled programs
from model_part import LLAMA_8B, OUT_WIDTH, tile_state  # noqa: E402 - the GPU script's 8B shapes and tiling

CONTEXT = 4096


def per_row(params, scorer: str, budget: int) -> dict:
    """MiB of state, of temporaries and of the layer scan's copies per step that one more row adds
    to a decoding step's program (and the temporaries at batch 1)."""
    ev = eviction_from(context=CONTEXT, budget=budget, scorer=scorer)
    tokens = jax.ShapeDtypeStruct((1, CONTEXT), jnp.int32)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    prefill = functools.partial(
        feed_budget, ev=ev, out_width=OUT_WIDTH, decode_spare=ev.decode_spare(OUT_WIDTH)
    )
    one = jax.eval_shape(prefill, params, None, tokens, lengths, lengths, key)
    steps = jax.ShapeDtypeStruct((), jnp.int32)
    found, copied = {}, {}
    for batch in (1, 8):
        state = jax.eval_shape(functools.partial(tile_state, batch=batch), one)
        compiled = (
            jax.jit(decode_steps, static_argnums=(4, 5, 6))
            .lower(params, state, steps, steps, Sampling(), (), ev.decoding())
            .compile()
        )
        found[batch], copied[batch] = (
            compiled.memory_analysis(),
            copied_bytes(loop_copies(compiled.as_text())),
        )
    mib = lambda name: (getattr(found[8], name) - getattr(found[1], name)) / 7 / 2**20  # noqa: E731
    return dict(
        state=mib("argument_size_in_bytes"),
        temporaries=mib("temp_size_in_bytes"),
        fixed=found[1].temp_size_in_bytes / 2**20,
        copied=(copied[8] - copied[1]) / 7 / 2**20,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scorers",
        nargs="+",
        default=["snapkv", "momentkv", "snapkv+caote", "snapkv+fastcaote", "h2o+momentkv-zeroth"],
    )
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument(
        "--layers", type=int, default=LLAMA_8B.n_layers, help="fewer layers compile faster"
    )
    args = parser.parse_args()
    cfg = dataclasses.replace(LLAMA_8B, n_layers=args.layers)
    params = jax.eval_shape(lambda: kvjax.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    print(
        f"Llama-3.1-8B's shapes, {cfg.n_layers} layers, bfloat16; a {CONTEXT}-token prompt "
        "compressed to "
        f"{args.budget} per layer and KV head; XLA:CPU's buffers (jax {jax.__version__}); MiB = "
        "2^20 bytes\n"
    )
    print(
        "| scorer | state per row MiB | step temporaries per row MiB | copied in the layer scan "
        "per row and "
        "step MiB | temporaries at batch 1 MiB |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for scorer in args.scorers:
        r = per_row(params, scorer, args.budget)
        print(
            f"| {scorer} | {r['state']:.1f} | {r['temporaries']:.1f} | {r['copied']:.1f} | "
            f"{r['fixed']:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
