"""Run by tests/test_serving.py with two fake CPU devices: an engine on a mesh (slots split over
``data``) gives each request the tokens of kvjax.generate alone on one device, and an engine of
contexts on the mesh answers each question as kvjax.decode of its context alone."""

import jax
import numpy as np

import kvjax
from kvjax.serving import Driver, Engine

assert jax.device_count() == 2, jax.devices()
cfg = kvjax.ModelConfig(
    arch="llama",
    vocab_size=97,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=48,
    max_seq_len=512,
    rope_theta=10000.0,
    norm_eps=1e-5,
    eos_token_ids=(3,),
    pad_token_id=0,
)
params = kvjax.init_params(cfg, jax.random.key(0), scale=0.3)
eviction = dict(budget=24, scorer="snapkv", obs_window=8, block_size=16)
prompts = [np.random.default_rng(i).integers(4, 97, n) for i, n in enumerate((30, 9, 27))]
engine = Engine(
    params, slots=2, max_prompt=32, max_new_tokens=12, mesh=kvjax.make_mesh("data=2"), **eviction
)
state, filling = engine.init_state()
assert state.cache.k.sharding.spec[1] == "data"  # [L, B, Hk, S, K]: slots split
assert (
    filling.cache.k.sharding.spec[1] == "data" and engine.prefill_rows == 2
)  # and the prompt rows
driver = Driver(engine).start()
outputs = [r.result(300) for r in [driver.submit(p, max_new_tokens=12) for p in prompts]]
driver.stop()
for p, out in zip(prompts, outputs):
    assert out == [int(t) for t in kvjax.generate(params, p, max_new_tokens=12, **eviction)]
print("mesh ok")

# An engine of contexts on the mesh: contexts compressed on one device continue in slots split over
# data=2, each answer equal to kvjax.decode of the context alone on one device.
compressed = dict(budget=16, scorer="snapkv", obs_window=8)
contexts = [kvjax.prefill(params, p, **compressed) for p in prompts[:2]]
engine = Engine(
    params,
    slots=2,
    max_prompt=16,
    max_new_tokens=8,
    mesh=kvjax.make_mesh("data=2"),
    contexts=contexts[0].ev,
)
driver = Driver(engine).start()
questions = [
    np.random.default_rng(10 + i).integers(4, 97, n).astype(np.int32)
    for i, n in enumerate((5, 11, 3))
]
pairs = [(0, 0), (1, 1), (0, 2)]
outputs = [
    r.result(300)
    for r in [
        driver.submit(questions[q], context=contexts[c], max_new_tokens=8, stop_ids=())
        for c, q in pairs
    ]
]
driver.stop()
for (c, q), out in zip(pairs, outputs, strict=True):
    alone = kvjax.decode(params, contexts[c], questions[q], 8, evict=False, stop_ids=())
    assert out == [int(t) for t in alone], (c, q, out, alone)
print("contexts on the mesh ok")
