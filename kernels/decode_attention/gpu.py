"""Decode attention (one query per sequence) with eviction scores as Pallas GPU kernels, Triton
backend.

Triton rather than Mosaic GPU for the reasons given in ``kvjax.kernels.block_attention.gpu``: Mosaic
GPU needs Hopper or newer and warpgroup-sized (64-row) tiles, while a decode step has G ≤ 8 rows per
KV head and must run on any CUDA GPU.

A decode step has little parallelism per (row, KV head), so the softmax pass splits the cache
("flash-decoding"): grid (B, Hk, splits), each program runs the online softmax over its run of key
tiles (``gpu_common.softmax_kernel``) and writes partial (o, m, l); the partials are merged in jnp
(a log-sum-exp over the splits of [G, K]; ``gpu_common.decode_splits``: 8, more for a few rows over
a long cache). The "attn" score (the attention column) needs nothing but each slot's logit and the
merged statistics: the softmax pass also writes the G real rows' masked logits, float32 [G, S] per
(row, KV head), and XLA forms exp(z − m) / l from them, so the keys are read once. The other score
kinds read the values and the output too: a scores pass, grid (B, Hk, key tiles), recomputes each
tile's logits with the merged statistics and writes the per-slot scores of the G rows (rows padded
to 16, the minimum of ``tl.dot``; ``gpu_common.head_scores``). Unweighted: the wrapper multiplies by
the query's weight.
The cache is read in masked power-of-two tiles (``gpu_common.load_tile``), never padded in HBM, from
the stacked [L, B, Hk, S, K] arrays at the layer given (a [1] input each program reads): the layer's
keys and values are never sliced out into a copy. ``Quantized`` ones are read alike — codes and
scales [L, B, Hk, S, 1] — and dequantized in registers (``gpu_common.load_values``).

MomentKV's decoding eviction scores every slot by its residual norm (``moment_residual_norms``);
asked for them (``residual_stats``), the softmax pass forms them from each tile it holds
(``moment_residuals.gpu.tile_norms``: S k_j by one ``tl.dot`` against the head's [K, K] sums) and
writes one float a slot, so the step reads the layer's keys and values once, not twice. With
``layer``, the statistics may be every layer's too, read in place like the keys (a layer's
[B, Hk, K, K] sums handed over alone were a copy every step). The same statistics give MomentKV's
correction its terms (``correction.head_terms``), written by split 0 of each head.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kvjax.kernels import gpu_common as common
from kvjax.kernels._shared import (
    NT_DIMS,
    check_score,
    check_shapes,
    every_layer,
    kv_spec,
    next_pow2,
    stacked_layer,
)
from kvjax.kernels.decode_attention.correction import head_terms
from kvjax.kernels.decode_attention.reference import (
    check_correctable,
    check_decode,
    check_fusable,
)
from kvjax.kernels.moment_residuals.gpu import stat_inputs, tile_norms
from kvjax.kernels.moment_residuals.tiles import head_stats


def _heads(layer_ref) -> tuple:
    """The (layer, row, KV head) of this program in the stacked k, v refs."""
    return layer_ref[0], pl.program_id(0), pl.program_id(1)


def _softmax_kernel(
    layer_ref,
    *refs,
    zeroth: bool | None,
    correction_zeroth: bool | None,
    shared: bool,
    stats_layers: tuple[bool, ...],
    stats_sizes: tuple[int, ...],
    **kwargs,
):
    """``gpu_common.softmax_kernel`` over this program's head of the stacked k, v refs. Unless
    zeroth is None, the refs after the query positions' start with MomentKV statistics, and the
    last output takes the residual norms of the tiles the softmax reads; unless correction_zeroth
    is None, the next refs are the correction's statistics (unless ``shared``: the same ones), and
    the split 0 of each head writes its terms into the two outputs after those
    (``correction.head_terms``). ``stats_layers`` and ``stats_sizes``: per set of statistics
    given, whether they are every layer's (read at the layer) or one layer's, and their number
    of refs (3 without Σ v kᵀ)."""
    n_norms = 0 if zeroth is None else stats_sizes[0]
    n_terms = 0 if correction_zeroth is None or shared else stats_sizes[-1]
    inputs, outputs = refs[:5], list(refs[5 + n_norms + n_terms :])
    norm_stats = refs[5 : 5 + n_norms]
    term_stats = norm_stats if shared else refs[5 + n_norms : 5 + n_norms + n_terms]
    head = _heads(layer_ref)
    # the statistics' head: read in place at the layer in every layer's, or in one layer's
    stat_heads = [head if at_layer else head[1:] for at_layer in stats_layers]
    if correction_zeroth is not None:
        *outputs, mass_ref, estimate_ref = outputs

        @pl.when(pl.program_id(2) == 0)
        def _terms():
            count, k_sum, v_sum, vk_sum = head_stats(term_stats, lambda r: r[stat_heads[-1]])
            mass_ref[...], estimate_ref[...] = head_terms(
                inputs[0][...].astype(jnp.float32),
                count[:, None],
                k_sum[None, :],
                v_sum[None, :],
                vk_sum,
                correction_zeroth,
                lambda a, b: common.dot(a, b, NT_DIMS),
            )

    norms = None
    if zeroth is not None:
        *outputs, r_ref = outputs

        def norms(start, tile):
            r = tile_norms(tile.k, tile.v, norm_stats, zeroth, stat_heads[0])
            plgpu.store(r_ref.at[pl.ds(start, r.shape[0])], r)

    common.softmax_kernel(*inputs, *outputs, head=head, after_tile=norms, **kwargs)


def _scores_kernel(
    layer_ref,
    q_ref,
    k_ref,
    v_ref,
    spos_ref,
    qpos_ref,
    o_ref,
    m_ref,
    l_ref,
    col_ref,
    *,
    score: str,
    n_heads: int,
    n_slots: int,
    block_k: int,
    scale: float,
):
    """Unweighted scores of key tile program_id(2) for the Gp rows (query heads) of a KV head."""
    first = pl.program_id(2) * block_k
    v_ref = None if score == "attn" else v_ref
    tile = common.dense_tile(
        k_ref, v_ref, spos_ref, first, block_k, n_slots, q_ref.dtype, _heads(layer_ref)
    )
    rows = common.QueryRefs(q_ref, qpos_ref, None, o_ref, m_ref, l_ref)
    col_ref[...] = common.head_scores(score, tile, rows, n_heads=n_heads, scale=scale)


def decode_attention_gpu(
    q,
    k,
    v,
    slot_pos,
    query_pos,
    query_weights=None,
    score: str = "attn",
    *,
    layer=None,
    residual_stats: tuple | None = None,
    zeroth: bool = False,
    correction_stats: tuple | None = None,
    correction_zeroth: bool = False,
    block_k: int | None = None,
    splits: int | None = None,
    interpret=False,
    num_warps: int | None = None,
    num_stages: int = 2,
):
    """(o [B, 1, H, K] float32 — uncorrected —, lse [B, 1, H], col [B, Hk, G, S] or None), as
    ``reference.decode_attention_with_scores`` without moments; with ``layer`` (an int32 scalar),
    k, v are [L, B, Hk, S, K] and layer ``layer`` is read. block_k is rounded up to a power of two
    ≥ 16; splits (default ``gpu_common.decode_splits``, at most the key tiles) is the number of
    cache splits of the softmax pass. MomentKV's statistics (count, k_sum, v_sum, vk_sum: one
    layer's, or with ``layer`` every layer's [L, ...], read in place at it; vk_sum None where
    only the zeroth order reads them):

    - ``residual_stats``: a fourth output, each slot's residual norm [B, Hk, S] under them (first
      order, or ``zeroth``), as ``moment_residual_norms``, from the tiles the softmax pass reads;
      keys and values must then be read in q's dtype and not stored rotated.
    - ``correction_stats``: two more outputs, the correction's (log_mass [B, 1, Hk, G], estimate
      [B, 1, Hk, G, K]) of q under them, as ``reference.correction_terms`` (``correction_zeroth``:
      its zeroth order), for ``reference.mixed_attention``; keys must not be stored rotated.
    """
    check_score(score)
    check_decode(q)
    fused, corrected = residual_stats is not None, correction_stats is not None
    shared = fused and correction_stats is residual_stats  # passed once, read by both
    given = [x for x in (residual_stats, None if shared else correction_stats) if x is not None]
    stats_stacked = [every_layer(x[0]) for x in given]
    stats_given = [stat_inputs(*g) for g in given]
    stats = tuple(x for g in stats_given for x in g)
    k, v, layer, shape = stacked_layer(k, v, layer)
    B, _, H, Hk, S, K = check_shapes(q, shape, shape, slot_pos, query_pos, query_weights)
    G = H // Hk
    common.check_head_dim(K)
    rows, qpos, gp = common.decode_queries(q, query_pos, Hk)
    bk = max(common.MIN_DOT, next_pow2(block_k or common.DEFAULT_BLOCK_K))
    nk = -(-S // bk)
    per_split = -(-nk // min(common.decode_splits(B * Hk, S, splits), nk))
    n_splits = -(-nk // per_split)  # every split starts with a real slot
    scale = math.sqrt(K)
    params = plgpu.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages)
    spos = slot_pos.astype(jnp.int32)
    if fused:
        check_fusable(q, k)
    if corrected:
        check_correctable(k)

    head_spec = pl.BlockSpec((None, None, gp, K), lambda b, h, s: (b, h, 0, 0))

    # whole stacked k, v: each program loads its head's tiles by masked loads
    def stack(x):
        return kv_spec(x, x.shape, lambda b, h, s: (0,) * len(x.shape))

    whole = pl.BlockSpec((1,), lambda b, h, s: (0,))
    head_pos = pl.BlockSpec((None, None, S), lambda b, h, s: (b, h, 0))
    # "attn" scores from the softmax pass's logits: no second read of the keys. Every split runs
    # per_split tiles, so the last one may run past the key tiles: its logits (of no slot) land in
    # columns the buffer has, never beyond it.
    logits_out = query_weights is not None and score == "attn"
    width = n_splits * per_split * bk
    z_spec = [pl.BlockSpec((None, None, gp, width), lambda b, h, s: (b, h, 0, 0))]
    z_shape = [jax.ShapeDtypeStruct((B, Hk, gp, width), jnp.float32)]
    r_spec = [pl.BlockSpec((None, None, width), lambda b, h, s: (b, h, 0))]
    r_shape = [jax.ShapeDtypeStruct((B, Hk, width), jnp.float32)]
    terms_spec = [  # one block per head for every split; split 0 writes it
        pl.BlockSpec((None, None, gp, 1), lambda b, h, s: (b, h, 0, 0)),
        pl.BlockSpec((None, None, gp, K), lambda b, h, s: (b, h, 0, 0)),
    ]
    terms_shape = [
        jax.ShapeDtypeStruct((B, Hk, gp, 1), jnp.float32),
        jax.ShapeDtypeStruct((B, Hk, gp, K), jnp.float32),
    ]
    o_part, m_part, l_part, *extra = pl.pallas_call(
        functools.partial(
            _softmax_kernel,
            n_slots=S,
            block_k=bk,
            n_tiles=per_split,
            scale=scale,
            split_axis=2,
            z_rows=G,
            zeroth=zeroth if fused else None,
            correction_zeroth=correction_zeroth if corrected else None,
            shared=shared,
            stats_layers=tuple(stats_stacked),
            stats_sizes=tuple(len(g) for g in stats_given),
            # the padding rows' partial outputs are read by the scores pass only
            o_rows=G if query_weights is None or logits_out else None,
        ),
        grid=(B, Hk, n_splits),
        in_specs=[
            whole,
            head_spec,
            stack(k),
            stack(v),
            head_pos,
            pl.BlockSpec((None, gp), lambda b, h, s: (b, 0)),
            *(stack(x) for x in stats),  # whole: each program loads its head's
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, K), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0)),
            *(z_spec if logits_out else []),
            *(r_spec if fused else []),
            *(terms_spec if corrected else []),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Hk, n_splits, gp, K), jnp.float32),
            jax.ShapeDtypeStruct((B, Hk, n_splits, gp), jnp.float32),
            jax.ShapeDtypeStruct((B, Hk, n_splits, gp), jnp.float32),
            *(z_shape if logits_out else []),
            *(r_shape if fused else []),
            *(terms_shape if corrected else []),
        ],
        compiler_params=params,
        interpret=interpret,
        name="decode_attention_partial_softmax",
    )(layer, rows, k, v, spos, qpos, *stats)
    z = extra[:1] if logits_out else []
    if corrected:  # the G real rows
        *extra, mass, estimate = extra
        terms = (mass[:, None, :, :G, 0], estimate[:, None, :, :G])
    norms = (extra[-1][:, :, :S],) if fused else ()
    norms += terms if corrected else ()

    m = jnp.max(m_part, axis=2)  # every split has a real slot: all finite
    o, l = common.merge_splits(o_part, m_part, l_part, m)  # [B, Hk, gp, K], [B, Hk, gp]
    out, lse = common.decode_outputs(o, m, l, G)
    if query_weights is None:
        return out, lse, None, *norms
    weights = query_weights.astype(jnp.float32).reshape(B, 1, 1, 1)
    if logits_out:  # A = exp(z − m) / l at the merged statistics, as the scores pass forms it
        a = jnp.exp(z[0][:, :, :G, :S] - m[:, :, :G, None]) / l[:, :, :G, None]
        return out, lse, a * weights, *norms

    head_pos = pl.BlockSpec((None, None, S), lambda b, h, j: (b, h, 0))
    head_spec = pl.BlockSpec((None, None, gp, K), lambda b, h, j: (b, h, 0, 0))
    head_vec = pl.BlockSpec((None, None, gp), lambda b, h, j: (b, h, 0))
    col = pl.pallas_call(
        functools.partial(
            _scores_kernel, score=score, n_heads=G, n_slots=S, block_k=bk, scale=scale
        ),
        grid=(B, Hk, nk),
        in_specs=[
            whole,
            head_spec,
            stack(k),
            stack(v),
            head_pos,
            pl.BlockSpec((None, gp), lambda b, h, j: (b, 0)),
            head_spec,
            head_vec,
            head_vec,
        ],
        out_specs=pl.BlockSpec((None, None, gp, bk), lambda b, h, j: (b, h, 0, j)),
        out_shape=jax.ShapeDtypeStruct((B, Hk, gp, nk * bk), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="decode_attention_scores",
    )(layer, rows, k, v, spos, qpos, o, m, l)
    return out, lse, col[:, :, :G, :S] * weights, *norms
