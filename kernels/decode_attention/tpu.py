"""Decode attention (one query per sequence) with eviction scores as one Pallas Mosaic-TPU kernel.

With T = 1 the rows of a KV head are its G query heads: q [B, 1, H, K] becomes [B, Hk, Gp, K] (Gp =
G padded to a sublane tile: 8 for float32, 16 for bfloat16). Slots are tiled by ``bk`` (a multiple
of 128, or all of S when S ≤ bk); the cache is never padded — the last key tile may be ragged,
masked by slot index as in ``block_attention.tpu``. One ``pallas_call`` does both passes: the grid
is (B, Hk, phase, key tiles) with the phase and key-tile axes sequential; phase 0 runs the online
softmax into VMEM scratch (m, l and the output accumulator; the output and its statistics are
written when the last key tile is done), phase 1 — present only when scores are requested — streams
the key tiles again and writes the per-slot scores of each tile with the final statistics, A =
exp(z − m) / l. Each phase reads K (and V) once: 2 reads of the cache is the minimum for scores that
need the final softmax, and nothing of size [G, S] but the scores themselves is written. The column
block's index is (b, h, 0, phase · j), so it stays on tile 0 for all of phase 0 and is written back
only after phase 1 has filled it.

For a single query per sequence the score is a per-row quantity, so the kernel writes unweighted
score(g, s) and the wrapper multiplies by the query's weight w_b (no reduction over queries is
needed). The obcache-key/joint terms use the differences v_s − o_g themselves, one head row at a
time, reduced over K on the MXU (``ones[8, K] · Xᵀ``) to land along lanes.

The query position is a scalar per sequence, prefetched into SMEM (``PrefetchScalarGridSpec``), and
so is the layer: K and V are tiled straight out of the stacked [L, B, Hk, S, K] arrays (a slice
handed to the kernel would be a copy of the layer's keys and values every step) — for ``Quantized``
keys and values, the codes and the scales [L, B, Hk, S, 1] alike, dequantized in VMEM after the
load (``tpu_common.load``).

Asked for MomentKV's residual norms (``residual_stats``), phase 0 also forms them from each tile it
holds in VMEM (``moment_residuals.tpu.tile_norms``) into a [1, bk] block whose index follows the
key tile in phase 0 and stays on the last one through phase 1, so each is written back once.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from kvjax.kernels import tpu_common as common
from kvjax.kernels._shared import (
    check_score,
    check_shapes,
    every_layer,
    kv_spec,
    round_up,
    stacked_layer,
)
from kvjax.kernels.decode_attention.correction import head_terms
from kvjax.kernels.decode_attention.reference import (
    check_correctable,
    check_decode,
    check_fusable,
)
from kvjax.kernels.moment_residuals.tiles import head_stats
from kvjax.kernels.moment_residuals.tpu import stat_inputs, stat_specs, tile_norms


def _decode_kernel(
    qpos_ref,
    layer_ref,
    q_ref,
    k_ref,
    v_ref,
    spos_ref,
    *refs,
    score: str | None,
    n_heads: int,
    n_slots: int,
    scale: float,
    precision,
    zeroth: bool | None,
    correction_zeroth: bool | None,
    shared: bool,
    stats_sizes: tuple[int, ...],
):
    """Unless zeroth is None, the refs after the slot positions' start with one head's MomentKV
    statistics, and the outputs after the scores take the residual norms of the tiles phase 0
    reads; unless correction_zeroth is None, the next refs are the correction's statistics (unless
    ``shared``: the same ones), and the last two outputs take its terms (``correction.head_terms``),
    written at the first step. ``stats_sizes``: per set of statistics given, its number of refs
    (3 without Σ v kᵀ)."""
    n_norms = 0 if zeroth is None else stats_sizes[0]
    n_terms = 0 if correction_zeroth is None or shared else stats_sizes[-1]
    norm_stats = refs[:n_norms]
    term_stats = norm_stats if shared else refs[n_norms : n_norms + n_terms]
    o_ref, stats_ref, *outs, m_sc, l_sc, acc_sc = refs[n_norms + n_terms :]
    col_ref = outs[0] if score is not None else None
    b, phase, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    bk = k_ref.shape[0]
    pl.when((phase == 0) & (j == 0))(functools.partial(common.reset_softmax, m_sc, l_sc, acc_sc))
    if correction_zeroth is not None:
        mass_ref, estimate_ref = outs[-2:]

        @pl.when((phase == 0) & (j == 0))
        def _terms():
            mass_ref[...], estimate_ref[...] = head_terms(
                q_ref[...].astype(jnp.float32),
                *head_stats(term_stats, lambda ref: ref[...]),
                correction_zeroth,
                common.full_dot,
            )

    tile = common.key_tile(
        q_ref,
        k_ref,
        v_ref,
        spos_ref,
        qpos_ref[b],
        first_slot=j * bk,
        n_slots=n_slots,
        scale=scale,
        precision=precision,
    )

    @pl.when(phase == 0)
    def _softmax():
        common.online_softmax(tile.logits, tile.values(), m_sc, l_sc, acc_sc)
        if zeroth is not None:
            outs[1 if score is not None else 0][...] = tile_norms(
                k_ref, v_ref, norm_stats, j * bk, n_slots, zeroth, q_ref.dtype
            )

        @pl.when(j == pl.num_programs(3) - 1)
        def _finish():
            o = acc_sc[...] / common.lane_broadcast(l_sc[...], acc_sc.shape[1])
            acc_sc[...] = o  # phase 1 reads the normalised output from here
            o_ref[...] = o
            stats = {common.MAX: m_sc[...], common.SUM: l_sc[...]}
            stats_ref[...] = common.pack(jnp.zeros(stats_ref.shape, jnp.float32), stats)

    if score is None:
        return

    @pl.when(phase == 1)
    def _scores():
        col_ref[...] = common.head_scores(score, tile, m_sc, l_sc, acc_sc, n_heads)


def decode_attention_tpu(
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
    interpret=False,
):
    """Attention of one query per sequence over the cache: (o [B, 1, H, K] float32 — uncorrected —,
    lse [B, 1, H], col [B, Hk, G, S] or None), as ``reference.decode_attention_with_scores`` without
    moments; with ``layer`` (an int32 scalar), k, v are [L, B, Hk, S, K] and layer ``layer`` is
    read. block_k is rounded up to a multiple of 128. MomentKV's statistics (count, k_sum, v_sum,
    vk_sum: one layer's, or with ``layer`` every layer's [L, ...], tiled at it as k and v are;
    vk_sum None where only the zeroth order reads them), as
    ``gpu.decode_attention_gpu`` takes them: ``residual_stats`` adds the residual norms
    [B, Hk, S] from the tiles phase 0 reads, ``correction_stats`` the correction's terms."""
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
    rows, gp = common.decode_rows(q, Hk)
    bk = round_up(block_k or common.DEFAULT_BLOCK_K, common.LANES)
    bk = min(S, bk)  # one tile equal to the whole (short) slot axis is always a legal block
    nk = -(-S // bk)  # the last key tile may be ragged
    scoring = query_weights is not None
    kernel_score = score if scoring else None
    if fused:
        check_fusable(q, k)
    if corrected:
        check_correctable(k)

    spos = slot_pos.astype(jnp.int32)[:, :, None, :]  # [B, Hk, 1, S]
    qpos = query_pos.astype(jnp.int32).reshape(B)

    head_spec = pl.BlockSpec((None, None, gp, K), lambda b, h, p, j, *_: (b, h, 0, 0))
    stats_spec = pl.BlockSpec((None, None, gp, common.LANES), lambda b, h, p, j, *_: (b, h, 0, 0))
    tile = (None, None, None, bk, K)
    k_spec = kv_spec(k, tile, lambda b, h, p, j, qpos, layer: (layer[0], b, h, j, 0))
    if score == "attn":  # phase 1 does not read V: keep its last tile, so it is not fetched again
        v_spec = kv_spec(
            v, tile, lambda b, h, p, j, qpos, layer: (layer[0], b, h, j + p * (nk - 1 - j), 0)
        )
    else:
        v_spec = kv_spec(v, tile, lambda b, h, p, j, qpos, layer: (layer[0], b, h, j, 0))
    out_specs = [head_spec, stats_spec]
    out_shape = [
        jax.ShapeDtypeStruct((B, Hk, gp, K), jnp.float32),
        jax.ShapeDtypeStruct((B, Hk, gp, common.LANES), jnp.float32),
    ]
    if scoring:
        out_specs.append(
            pl.BlockSpec((None, None, gp, bk), lambda b, h, p, j, *_: (b, h, 0, p * j))
        )
        out_shape.append(jax.ShapeDtypeStruct((B, Hk, gp, S), jnp.float32))
    if fused:  # written in phase 0; phase 1 stays on the last tile, so nothing is written again
        out_specs.append(
            pl.BlockSpec(
                (None, None, 1, bk), lambda b, h, p, j, *_: (b, h, 0, j + p * (nk - 1 - j))
            )
        )
        out_shape.append(jax.ShapeDtypeStruct((B, Hk, 1, S), jnp.float32))
    if corrected:  # written at the first step, then kept until the head's last
        out_specs += [
            pl.BlockSpec((None, None, gp, 1), lambda b, h, p, j, *_: (b, h, 0, 0)),
            head_spec,
        ]
        out_shape += [
            jax.ShapeDtypeStruct((B, Hk, gp, 1), jnp.float32),
            jax.ShapeDtypeStruct((B, Hk, gp, K), jnp.float32),
        ]
    results = pl.pallas_call(
        functools.partial(
            _decode_kernel,
            score=kernel_score,
            n_heads=G,
            n_slots=S,
            scale=math.sqrt(K),
            precision=common.mxu_precision(q.dtype),
            zeroth=zeroth if fused else None,
            correction_zeroth=correction_zeroth if corrected else None,
            shared=shared,
            stats_sizes=tuple(len(g) for g in stats_given),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, Hk, 2 if scoring else 1, nk),
            in_specs=[
                head_spec,
                k_spec,
                v_spec,
                pl.BlockSpec((None, None, 1, bk), lambda b, h, p, j, *_: (b, h, 0, j)),
                *(
                    spec
                    for at_layer, g in zip(stats_stacked, stats_given, strict=True)
                    for spec in stat_specs(K, len(g) == 3, at_layer)
                ),
            ],
            out_specs=out_specs,
            scratch_shapes=common.softmax_scratch(gp, K),
        ),
        out_shape=out_shape,
        compiler_params=common.compiler_params(2),
        interpret=interpret,
        name="decode_attention_with_scores",
    )(qpos, layer, rows, k, v, spos, *stats)
    out, lse, _, _ = common.decode_outputs(*results[:2], G)
    if corrected:  # the G real rows
        *results, mass, estimate = results
        terms = (mass[:, None, :, :G, 0], estimate[:, None, :, :G])
    norms = (results[-1][:, :, 0],) if fused else ()
    norms += terms if corrected else ()
    if not scoring:
        return out, lse, None, *norms
    col = results[2][:, :, :G] * query_weights.astype(jnp.float32).reshape(B, 1, 1, 1)
    return out, lse, col, *norms
