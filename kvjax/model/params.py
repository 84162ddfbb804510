"""Parameter pytrees and the one table that declares every tensor's shape and logical axes.

Shapes use: L layers, V vocab, D d_model, H query heads, Hk KV heads, G = H / Hk query heads per
KV head, K head_dim, F d_ff.

The query, key and value projections are one tensor ``wqkv`` [L, D, Hk, G + 2, K] (``fuse_qkv``):
per KV head, the G query heads that share it, then its key and its value. One product reads it
where three would read wq, wk and wv; XLA:GPU hands it to cuBLAS at batch 1, where it computed the
smaller wk and wv products as slow reductions (docs/performance.md, "On a GPU").

``Params.layers`` is stacked: every ``LayerParams`` leaf carries the leading L axis, and the forward
pass scans over it. ``unstack_layers`` gives a tuple of one ``LayerParams`` per layer instead (no L
axis), which the forward pass runs as an unrolled loop (docs/performance.md, "Stacked or unstacked
layers").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.model.config import ModelConfig


@struct.dataclass
class LayerParams:
    attn_norm: jax.Array  # [L, D]
    wqkv: jax.Array  # [L, D, Hk, G + 2, K]
    wo: jax.Array  # [L, H, K, D]
    mlp_norm: jax.Array  # [L, D]
    w_gate: jax.Array  # [L, D, F]
    w_up: jax.Array  # [L, D, F]
    w_down: jax.Array  # [L, F, D]
    bqkv: jax.Array | None = None  # [L, Hk, G + 2, K] (Qwen2)
    q_norm: jax.Array | None = None  # [L, K] (Qwen3)
    k_norm: jax.Array | None = None  # [L, K]


@struct.dataclass
class Params:
    """Model weights plus their (static) config."""

    config: ModelConfig = struct.field(pytree_node=False)
    embed: jax.Array  # [V, D]
    layers: LayerParams | tuple[LayerParams, ...]  # stacked, or one per layer (``unstack_layers``)
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [D, V]; None when tied to ``embed``

    @property
    def dtype(self):
        return self.embed.dtype


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, one per dim
    init: str = "normal"  # "normal" or "ones" (norm scales)


def param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Flat ``path -> ParamSpec`` for every tensor ``cfg`` has (``layers.wqkv`` etc.)."""
    L, V, D, H, Hk, G, K, F = (
        cfg.n_layers,
        cfg.vocab_size,
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.group_size,
        cfg.head_dim,
        cfg.d_ff,
    )
    s = {
        "embed": ParamSpec((V, D), ("vocab", "embed")),
        "final_norm": ParamSpec((D,), ("embed",), "ones"),
        "layers.attn_norm": ParamSpec((L, D), ("layers", "embed"), "ones"),
        "layers.wqkv": ParamSpec(
            (L, D, Hk, G + 2, K), ("layers", "embed", "kv_heads", "qkv", "head_dim")
        ),
        "layers.wo": ParamSpec((L, H, K, D), ("layers", "heads", "head_dim", "embed")),
        "layers.mlp_norm": ParamSpec((L, D), ("layers", "embed"), "ones"),
        "layers.w_gate": ParamSpec((L, D, F), ("layers", "embed", "ffw")),
        "layers.w_up": ParamSpec((L, D, F), ("layers", "embed", "ffw")),
        "layers.w_down": ParamSpec((L, F, D), ("layers", "ffw", "embed")),
    }
    if not cfg.tie_embeddings:
        s["lm_head"] = ParamSpec((D, V), ("embed", "vocab"))
    if cfg.qkv_bias:
        s["layers.bqkv"] = ParamSpec((L, Hk, G + 2, K), ("layers", "kv_heads", "qkv", "head_dim"))
    if cfg.qk_norm:
        s["layers.q_norm"] = ParamSpec((L, K), ("layers", "head_dim"), "ones")
        s["layers.k_norm"] = ParamSpec((L, K), ("layers", "head_dim"), "ones")
    return s


# each fused tensor and the parts checkpoints store apart (``stored_specs``)
FUSED = {
    "layers.wqkv": ("layers.wq", "layers.wk", "layers.wv"),
    "layers.bqkv": ("layers.bq", "layers.bk", "layers.bv"),
}


def stored_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """``param_specs`` with each fused tensor replaced by the parts checkpoints store: wq
    [L, D, H, K], wk and wv [L, D, Hk, K]; bq [L, H, K], bk and bv [L, Hk, K]."""
    specs = param_specs(cfg)
    for fused, parts in FUSED.items():
        if spec := specs.pop(fused, None):
            *lead, hk, _, k = spec.shape
            for part, h, axis in zip(
                parts, (cfg.n_heads, hk, hk), ("heads", "kv_heads", "kv_heads"), strict=True
            ):
                specs[part] = ParamSpec((*lead, h, k), (*spec.axes[:-3], axis, "head_dim"))
    return specs


def fuse_parts(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat dict of ``stored_specs``' tensors -> one of ``param_specs``' (the parts fused)."""
    flat = dict(flat)
    for fused, parts in FUSED.items():
        if parts[0] in flat:
            flat[fused] = fuse_qkv(*(flat.pop(part) for part in parts))
    return flat


def fuse_qkv(q, k, v):
    """Query, key and value projections [..., H, K], [..., Hk, K], [..., Hk, K] (NumPy or JAX
    arrays: weights, biases or activations) -> [..., Hk, G + 2, K]. Query head h joins KV head
    h // G, as grouped-query attention pairs them."""
    xp = np if isinstance(q, np.ndarray) else jnp
    *lead, h, dim = q.shape
    groups = q.reshape(*lead, k.shape[-2], h // k.shape[-2], dim)
    return xp.concatenate([groups, k[..., None, :], v[..., None, :]], axis=-2)


def split_qkv(qkv):
    """Inverse of ``fuse_qkv``: [..., Hk, G + 2, K] -> (q [..., H, K], k [..., Hk, K], v)."""
    *lead, hk, g2, dim = qkv.shape
    q = qkv[..., : g2 - 2, :].reshape(*lead, hk * (g2 - 2), dim)
    return q, qkv[..., -2, :], qkv[..., -1, :]


def params_from_flat(cfg: ModelConfig, flat: dict[str, Any]) -> Params:
    """Build ``Params`` from a flat ``path -> array`` dict holding exactly ``param_specs(cfg)``."""
    layers = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith("layers.")}
    return Params(
        config=cfg,
        embed=flat["embed"],
        layers=LayerParams(**layers),
        final_norm=flat["final_norm"],
        lm_head=flat.get("lm_head"),
    )


def params_to_flat(params: Params) -> dict[str, Any]:
    """Inverse of ``params_from_flat`` (absent optional tensors are left out; unstacked layers are
    stacked)."""
    layers = stack_layers(params).layers
    flat = {"embed": params.embed, "final_norm": params.final_norm, "lm_head": params.lm_head}
    flat |= {f"layers.{f.name}": getattr(layers, f.name) for f in dataclasses.fields(LayerParams)}
    return {k: v for k, v in flat.items() if v is not None}


def unstack_layers(params: Params) -> Params:
    """The same weights with ``layers`` as a tuple of one ``LayerParams`` per layer.

    The forward pass then runs an unrolled loop whose products read each layer's own arrays,
    where the scan over stacked arrays slices them (XLA:CPU copies every slice before its product
    reads it). The cost: compile time grows with depth. Unstacked params are returned as they
    are; the result holds new arrays, so drop the stacked ones to free their memory."""
    if isinstance(params.layers, tuple):
        return params
    stacked = params.layers
    return params.replace(
        layers=tuple(
            jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(params.config.n_layers)
        )
    )


def stack_layers(params: Params) -> Params:
    """Inverse of ``unstack_layers`` (stacked params are returned as they are)."""
    if not isinstance(params.layers, tuple):
        return params
    return params.replace(layers=jax.tree.map(lambda *a: jnp.stack(a), *params.layers))


def shape_mismatches(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Every tensor whose shape differs from the spec, or that is missing or unexpected."""
    specs = param_specs(cfg)
    problems = [
        f"{k}: expected {specs[k].shape}, found {tuple(shapes[k])}"
        for k in specs
        if k in shapes and tuple(shapes[k]) != specs[k].shape
    ]
    problems += [f"{k}: expected {specs[k].shape}, missing" for k in specs if k not in shapes]
    problems += [
        f"{k}: unexpected tensor of shape {tuple(shapes[k])}" for k in shapes if k not in specs
    ]
    return problems


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
    """Random weights (normal(0, scale); norm scales near one) for tests and benchmarks: each
    tensor a checkpoint stores (``stored_specs``: wq, wk and wv apart) drawn from its own key,
    then fused."""
    specs = stored_specs(cfg)
    keys = jax.random.split(key, len(specs))
    flat = {}
    for k, (path, spec) in zip(keys, sorted(specs.items())):
        x = jax.random.normal(k, spec.shape, jnp.float32) * scale
        flat[path] = (1.0 + x if spec.init == "ones" else x).astype(dtype)
    return params_from_flat(cfg, fuse_parts(flat))


def cast_params(params: Params, dtype) -> Params:
    """All weights in ``dtype`` (norm scales included; norms compute in float32)."""
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def abstract_flat(cfg: ModelConfig, dtype) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(s.shape, np.dtype(dtype)) for k, s in param_specs(cfg).items()}
