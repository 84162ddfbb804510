"""The programs ``kvjax.generate`` runs, lowered whole for TPU from this CPU machine, as a Colab TPU
runs them: SmolLM2-135M's shapes in bfloat16 (head dim 64, 3 KV heads, 30 layers), two rows of 1,024
tokens, budget 256. For each scorer name (``covering``: every base and alias, each modifier once),
the protocols alternating, and for the quantized caches, the prompt's program (``feed_budget``) and
the decoding loop (``decode_steps``) lower with ``jax.export(platforms=["tpu"])``, each holding
Mosaic kernels (``tpu_custom_call``). The kernels' own lowerings are checked one by one in
tests/test_kernels.py and its neighbours; this checks them composed, at a real model's geometry.
KVzip's names need a repeat prompt and a scoring pass of XLA alone (no kernel): they are left out.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from helpers import covering

from kvjax.checkpoint.random_model import SHAPES
from kvjax.eviction import SCORERS
from kvjax.model.params import init_params
from kvjax.runtime.decoding import decode_steps, feed_budget
from kvjax.runtime.options import eviction_from
from kvjax.runtime.sampling import Sampling

ROWS, CONTEXT, BUDGET, NEW = 2, 1024, 256, 64
NAMES = [n for n in covering(list(SCORERS)) if not n.startswith("kvzip")]


def lowered(scorer: str, protocol: str, **options) -> tuple[str, str]:
    """The StableHLO of the prompt's program and of the decoding loop, exported for TPU."""
    cfg = SHAPES["smollm2-135m"]
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), jnp.bfloat16))
    tokens = jax.ShapeDtypeStruct((ROWS, CONTEXT), jnp.int32)
    lengths = jax.ShapeDtypeStruct((ROWS,), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    n = jax.ShapeDtypeStruct((), jnp.int32)
    ev = eviction_from(context=CONTEXT, budget=BUDGET, scorer=scorer, protocol=protocol, **options)
    feed = functools.partial(feed_budget, ev=ev, out_width=NEW, decode_spare=ev.decode_spare(NEW))
    args = (params, None, tokens, lengths, lengths, key)
    prompt = jax.export.export(jax.jit(feed), platforms=["tpu"])(*args).mlir_module()
    state = jax.eval_shape(feed, *args)
    decoding = jax.export.export(decode_steps, platforms=["tpu"])(
        params, state, n, n, Sampling(), (), ev.decoding()
    ).mlir_module()
    return prompt, decoding


@pytest.mark.parametrize("index", range(len(NAMES)), ids=NAMES)
def test_every_scorer_lowers_for_tpu(index):
    """Each name in one protocol, the protocols alternating."""
    prompt, decoding = lowered(NAMES[index], ("blockwise", "prefill")[index % 2])
    assert "tpu_custom_call" in prompt and "tpu_custom_call" in decoding


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "float8_e4m3fn"])
def test_quantized_caches_lower_for_tpu(kv_dtype):
    """The dense cache's kernels take every kind of codes. The paged cache's TPU kernels take them
    in pages of 32 or more (8-bit codes fill a 32-row sublane tile, docs/kernels.md): its quantized
    pools' default pages; in pages of 16 its attention is the XLA reference on TPU."""
    assert eviction_from(budget=BUDGET, scorer="adakv", kv_dtype=kv_dtype).page_size == 32
    for scorer in ("snapkv", "adakv"):
        assert all(
            "tpu_custom_call" in text for text in lowered(scorer, "blockwise", kv_dtype=kv_dtype)
        )
    assert not any(
        "tpu_custom_call" in text
        for text in lowered("adakv", "blockwise", kv_dtype=kv_dtype, page_size=16)
    )
