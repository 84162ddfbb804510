"""Run by tests/test_serving.py with two fake CPU devices: an engine on a mesh (slots split over ``data``) gives
each request the tokens of kvjax.generate alone on one device."""

import jax
import numpy as np

import kvjax
from kvjax.serving import Driver, Engine

assert jax.device_count() == 2, jax.devices()
cfg = kvjax.ModelConfig(arch="llama", vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                        d_ff=48, max_seq_len=512, rope_theta=10000.0, norm_eps=1e-5, eos_token_ids=(3,),
                        pad_token_id=0)
params = kvjax.init_params(cfg, jax.random.key(0), scale=0.3)
eviction = dict(budget=24, scorer="snapkv", obs_window=8, block_size=16)
prompts = [np.random.default_rng(i).integers(4, 97, n) for i, n in enumerate((30, 9, 27))]
engine = Engine(params, slots=2, max_prompt=32, max_new_tokens=12, mesh=kvjax.make_mesh("data=2"), **eviction)
assert engine.init_state().cache.k.sharding.spec[1] == "data"  # [L, B, Hk, S, K]: slots split
driver = Driver(engine).start()
outputs = [r.result(300) for r in [driver.submit(p, max_new_tokens=12) for p in prompts]]
driver.stop()
for p, out in zip(prompts, outputs):
    assert out == [int(t) for t in kvjax.generate(params, p, max_new_tokens=12, **eviction)]
print("mesh ok")
