"""Name tables from Hugging Face / GGUF tensor names to kvjax paths, per-layer stacking, and the
fusing of the stored query, key and value projections into ``wqkv`` (and their biases into
``bqkv``)."""

from __future__ import annotations

import re
from typing import Callable, Iterable

import numpy as np
from tqdm.auto import tqdm

from kvjax.checkpoint.errors import CheckpointError
from kvjax.model.config import ModelConfig
from kvjax.model.params import fuse_parts, stored_specs


def _heads_in(n_heads: Callable[[ModelConfig], int]):
    """[N*K, D] (out, in) -> [D, N, K]."""
    return lambda w, cfg: w.T.reshape(w.shape[1], n_heads(cfg), -1)


def _heads_out(w, cfg):
    """[D, H*K] -> [H, K, D]."""
    return w.T.reshape(cfg.n_heads, -1, w.shape[0])


def _bias(n_heads):
    return lambda b, cfg: b.reshape(n_heads(cfg), -1)


def _same(w, cfg):
    return w


def _transpose(w, cfg):
    return w.T


_H = lambda cfg: cfg.n_heads  # noqa: E731
_HK = lambda cfg: cfg.n_kv_heads  # noqa: E731

# our path -> (transform of the stored array, HF name, GGUF name); "{i}" is the layer index. The
# parts of a fused tensor (``kvjax.model.params.FUSED``) have paths of their own here.
TABLE = {
    "embed": (_same, "model.embed_tokens.weight", "token_embd.weight"),
    "final_norm": (_same, "model.norm.weight", "output_norm.weight"),
    "lm_head": (_transpose, "lm_head.weight", "output.weight"),
    "layers.attn_norm": (
        _same,
        "model.layers.{i}.input_layernorm.weight",
        "blk.{i}.attn_norm.weight",
    ),
    "layers.wq": (
        _heads_in(_H),
        "model.layers.{i}.self_attn.q_proj.weight",
        "blk.{i}.attn_q.weight",
    ),
    "layers.wk": (
        _heads_in(_HK),
        "model.layers.{i}.self_attn.k_proj.weight",
        "blk.{i}.attn_k.weight",
    ),
    "layers.wv": (
        _heads_in(_HK),
        "model.layers.{i}.self_attn.v_proj.weight",
        "blk.{i}.attn_v.weight",
    ),
    "layers.wo": (
        _heads_out,
        "model.layers.{i}.self_attn.o_proj.weight",
        "blk.{i}.attn_output.weight",
    ),
    "layers.bq": (_bias(_H), "model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias"),
    "layers.bk": (_bias(_HK), "model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias"),
    "layers.bv": (_bias(_HK), "model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias"),
    "layers.q_norm": (
        _same,
        "model.layers.{i}.self_attn.q_norm.weight",
        "blk.{i}.attn_q_norm.weight",
    ),
    "layers.k_norm": (
        _same,
        "model.layers.{i}.self_attn.k_norm.weight",
        "blk.{i}.attn_k_norm.weight",
    ),
    "layers.mlp_norm": (
        _same,
        "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.ffn_norm.weight",
    ),
    "layers.w_gate": (
        _transpose,
        "model.layers.{i}.mlp.gate_proj.weight",
        "blk.{i}.ffn_gate.weight",
    ),
    "layers.w_up": (_transpose, "model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    "layers.w_down": (
        _transpose,
        "model.layers.{i}.mlp.down_proj.weight",
        "blk.{i}.ffn_down.weight",
    ),
}
HF, GGUF = 1, 2


def _patterns(column: int) -> list[tuple[re.Pattern, str]]:
    return [
        (re.compile(re.escape(row[column]).replace(r"\{i\}", r"(\d+)") + "$"), path)
        for path, row in TABLE.items()
    ]


def convert(
    cfg: ModelConfig,
    names: Iterable[str],
    read: Callable[[str], np.ndarray],
    column: int,
    skip: Iterable[str] = (),
    desc: str = "converting",
) -> dict[str, np.ndarray]:
    """Read every tensor named in ``names`` through the table into a flat dict of stacked arrays
    (``param_specs``' paths: the query, key and value parts fused).

    ``read(name)`` returns the stored array (already in the HF orientation). All shape problems are
    collected and raised together in one ``CheckpointError``.
    """
    specs = stored_specs(cfg)
    patterns = _patterns(column)
    per_layer: dict[str, dict[int, np.ndarray]] = {}
    flat, problems, seen = {}, [], set()
    names = [n for n in names if n not in set(skip)]
    for name in tqdm(names, desc=desc, unit="tensor", leave=False):
        for pattern, path in patterns:
            if m := pattern.match(name):
                break
        else:
            problems.append(f"{name}: unexpected tensor (no kvjax parameter has this name)")
            continue
        if path not in specs:
            problems.append(f"{name}: unexpected tensor for this config ({path} is not used)")
            continue
        seen.add(path)
        arr = read(name)
        spec_shape = specs[path].shape[1:] if path.startswith("layers.") else specs[path].shape
        try:
            arr = TABLE[path][0](arr, cfg)
        except ValueError:
            pass  # the shape check below reports it
        if tuple(arr.shape) != spec_shape:
            problems.append(f"{name} -> {path}: expected {spec_shape}, found {tuple(arr.shape)}")
            continue
        if path.startswith("layers."):
            layer = int(m.group(1))
            if layer >= cfg.n_layers:
                problems.append(f"{name}: layer {layer} beyond n_layers={cfg.n_layers}")
                continue
            per_layer.setdefault(path, {})[layer] = arr
        else:
            flat[path] = arr
    for path, layers in per_layer.items():
        if missing := sorted(set(range(cfg.n_layers)) - set(layers)):
            problems.append(f"{path}: missing layers {missing}")
        else:
            flat[path] = np.stack([layers[i] for i in range(cfg.n_layers)])
    problems += [
        f"{path}: expected {spec.shape}, missing"
        for path, spec in specs.items()
        if path not in seen
    ]
    if problems:
        raise CheckpointError(
            f"checkpoint does not match the config ({len(problems)} problems):\n  "
            + "\n  ".join(problems)
        )
    return fuse_parts(flat)
