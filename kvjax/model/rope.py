"""Rotary position embeddings (Hugging Face "rotate half" layout), with linear and Llama-3.1
scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[K/2] float32 rotation frequencies after the config's scaling rule."""
    exponents = np.arange(0, cfg.head_dim, 2, dtype=np.float32) / np.float32(cfg.head_dim)
    inv = (1.0 / np.power(np.float32(cfg.rope_theta), exponents)).astype(np.float32)
    scaling = dict(cfg.rope_scaling)
    if cfg.rope_type == "linear":
        inv = inv / np.float32(scaling["factor"])
    elif cfg.rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x`` [B, T, N, K] by the angles of ``positions`` [B, T]; computed in float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, K/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + rotated * sin).astype(x.dtype)
