"""The model, prompts and settings shared by the two-process run and its one-process reference."""

import jax
import numpy as np

import kvjax

PROMPTS = [np.arange(4, 4 + n, dtype=np.int32) * 7 % 120 + 4 for n in (37, 20, 29, 11)]
SETTINGS = {
    "full": {},
    "snapkv": dict(budget=16, scorer="snapkv", obs_window=4, window=4),
    "adakv": dict(budget=16, scorer="adakv", obs_window=4, window=4),
}


def model():
    cfg = kvjax.ModelConfig(
        arch="llama",
        vocab_size=128,
        d_model=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=4,
        head_dim=8,
        d_ff=128,
        max_seq_len=512,
        eos_token_ids=(3,),
        pad_token_id=0,
    )
    return jax.tree.map(np.asarray, kvjax.init_params(cfg, jax.random.key(0), scale=0.3))
