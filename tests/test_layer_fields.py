"""How the layer scan hands each layer its slice of the caches' ``LAYER_FIELDS``: scanned over
(stacked outputs; every platform but CUDA) or carried and written in place (CUDA:
``kvjax.model.decoder.FIELDS_CARRIED_ON``). The carried form is lowered only for CUDA, so here it is
forced onto the CPU and must give the very tokens and logits of the scanned form, for every kind of
cache field: positions and state (SnapKV), moments (MomentKV), page tables (AdaKV), quantized keys
and values, a batch of two prompts of different lengths, and the serving engine's steps (prompt
chunks and decoding rows as groups of one forward)."""

import jax
import numpy as np
import pytest

import kvjax
from kvjax.model import decoder

CASES = {
    "snapkv": dict(scorer="snapkv"),
    "momentkv": dict(scorer="momentkv"),
    "adakv": dict(scorer="adakv"),
    "adakv int8": dict(scorer="adakv", kv_dtype="int8"),
}


def prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 97, n) for n in (90, 60)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_fields_carried_in_place_equal_the_scanned_ones(tiny_llama, monkeypatch, case):
    ev = dict(budget=48, block_size=16, obs_window=8) | CASES[case]
    settings = ev | dict(max_new_tokens=10, stop_ids=())
    scanned = kvjax.generate(tiny_llama, prompts(), **settings)
    context = kvjax.prefill(tiny_llama, prompts(1)[0], **ev)
    monkeypatch.setattr(decoder, "FIELDS_CARRIED_ON", ("cpu",))
    chosen = []  # the platforms of every choice made: CPU -> carried
    choose = jax.lax.platform_dependent

    def spy(*args, **branches):  # the kernels' choices pass through unrecorded
        name = getattr(branches.get("cpu"), "__name__", None)
        if name in ("carried", "scanned"):
            chosen.append(name)
        return choose(*args, **branches)

    monkeypatch.setattr(decoder.jax.lax, "platform_dependent", spy)
    jax.clear_caches()  # the programs above were traced with the scanned form
    carried = kvjax.generate(tiny_llama, prompts(), **settings)
    again = kvjax.prefill(tiny_llama, prompts(1)[0], **ev)
    assert chosen and set(chosen) == {"carried"}, chosen
    np.testing.assert_array_equal(carried, scanned)
    np.testing.assert_array_equal(again.logits, context.logits)
    jax.tree.map(np.testing.assert_array_equal, again.cache, context.cache)
    jax.clear_caches()


def test_the_serving_engine_with_fields_carried_answers_as_generate(tiny_llama, monkeypatch):
    """The engine's steps run prompt chunks and decoding rows as groups of one forward: with the
    carried form, every answer still equals ``kvjax.generate`` of its prompt alone."""
    from kvjax.serving import Driver, Engine

    ev = dict(budget=48, block_size=16, obs_window=8, scorer="momentkv")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 97, n) for n in (60, 20, 45)]
    want = [
        [int(t) for t in kvjax.generate(tiny_llama, p, max_new_tokens=12, stop_ids=(), **ev)]
        for p in prompts
    ]
    monkeypatch.setattr(decoder, "FIELDS_CARRIED_ON", ("cpu",))
    jax.clear_caches()
    driver = Driver(Engine(tiny_llama, slots=2, max_prompt=64, max_new_tokens=12, **ev)).start()
    try:
        requests = [driver.submit(p, max_new_tokens=12, stop_ids=()) for p in prompts]
        got = [r.result(300) for r in requests]
    finally:
        driver.stop()
        jax.clear_caches()
    assert got == want
