"""MomentKV's statistics of the evicted tokens (``Moments``) and its moment-informed eviction (MI)
on one layer's slice. Its normalization-corrected attention (NC) is part of the attention kernels'
semantics: ``kvjax.kernels.decode_attention.reference.corrected_attention``.

Statistics per (row, KV head) of the evicted set E: n = |E|, s_k = Σ k, s_v = Σ v, S = Σ v kᵀ.
Means k̄ = s_k/n, v̄ = s_v/n; centred S̃ = S − s_v s_kᵀ/n (MomentKV Eq. 9).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.kernels import moment_residual_norms
from kvjax.kernels.moment_residuals.reference import residual_norms
from kvjax.model.layer_fields import at_layer
from kvjax.sharding import per_shard
from kvjax.slots import max_slots


@struct.dataclass
class Moments:
    """Statistics of the evicted tokens per (layer, row, KV head), float32. Only MomentKV reads the
    sums; under every other scorer they have K = 0 (no memory, no updates) and only the count is
    kept, and its zeroth order reads no Σ v kᵀ (K = 0 there alone).

    Fields:
        count: [L, B, Hk].
        k_sum, v_sum: [L, B, Hk, K].
        vk_sum: [L, B, Hk, K, K] with [i, j] = Σ v_i k_j.
    """

    count: jax.Array
    k_sum: jax.Array
    v_sum: jax.Array
    vk_sum: jax.Array

    AXES = dict(
        count=("layers", "batch", "kv_heads"),
        k_sum=("layers", "batch", "kv_heads", "head_dim"),
        v_sum=("layers", "batch", "kv_heads", "head_dim"),
        vk_sum=("layers", "batch", "kv_heads", "head_dim", "head_dim"),
    )

    @classmethod
    def zeros(cls, lead: tuple[int, ...], dims: tuple[int, int]) -> Moments:
        """Empty statistics for the leading axes ``lead`` (e.g. (L, B, Hk)); dims: the K of the
        sums and the K of Σ v kᵀ (``Modifier.moments_dims``), (0, 0) for the count alone."""
        f32 = jnp.float32
        K, K_outer = dims
        return cls(
            count=jnp.zeros(lead, f32),
            k_sum=jnp.zeros(lead + (K,), f32),
            v_sum=jnp.zeros(lead + (K,), f32),
            vk_sum=jnp.zeros(lead + (K_outer, K_outer), f32),
        )

    @property
    def dims(self) -> tuple[int, int]:
        """The K of the sums and the K of Σ v kᵀ, as ``zeros`` takes them."""
        return self.k_sum.shape[-1], self.vk_sum.shape[-1]

    @property
    def every_layer(self) -> bool:
        """Whether these are every layer's statistics (count [L, B, Hk]), not one layer's."""
        return self.count.ndim == 3

    def at(self, layer) -> Moments:
        """Layer ``layer``'s statistics of every layer's (an unsigned dynamic slice:
        ``kvjax.model.layer_fields.at_layer``), or these, if one layer's."""
        return at_layer(self, layer) if self.every_layer else self

    @property
    def summed(self) -> bool:
        """Whether the sums are kept (K > 0), not only the count."""
        return self.k_sum.shape[-1] > 0

    def add(self, weight: jax.Array, k: jax.Array, v: jax.Array, layer=None) -> Moments:
        """Add tokens k, v [B, Hk, E, K] with 0/1 weight [B, Hk, E] to one layer's statistics, or,
        these being every layer's, to layer ``layer``'s (a scatter-add, in place: written back
        whole, a layer's [B, Hk, K, K] sums were copied out of the stack first on CUDA); without
        sums, only their count (XLA then drops whatever computed k and v); Σ v kᵀ where kept."""

        if self.every_layer and layer is None:
            raise ValueError("layer: adding to every layer's moments needs the layer's index")

        def plus(a, d):
            return a.at[layer].add(d) if self.every_layer else a + d

        count = plus(self.count, weight.sum(-1))
        if not self.summed:
            return self.replace(count=count)
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        outer = self.vk_sum.shape[-1] > 0
        return Moments(
            count=count,
            k_sum=plus(self.k_sum, jnp.einsum("bhe,bhek->bhk", weight, k)),
            v_sum=plus(self.v_sum, jnp.einsum("bhe,bhek->bhk", weight, v)),
            vk_sum=(
                plus(self.vk_sum, jnp.einsum("bhe,bhei,bhej->bhij", weight, v, k))
                if outer
                else self.vk_sum
            ),
        )


LAYER_CHUNK = 5  # layers whose moment-informed eviction loops run together in a long loop
# more evictions than this per (layer, row, KV head): a prefill's, not a decoding step's
LONG_LOOP = 64
SCREEN = 4  # candidates of lowest screening score that are scored exactly
# bounds the screening sums' rounding relative to their terms
FLOOR = 2.0**-16
TIE = 1e-6  # relative: exact scores this close are a tie (a few float32 ulps)


def over_layers(fn, xs, max_evict: int):
    """``fn`` over the leading (layer) axis of the pytree ``xs``: every layer at once (vmap), or,
    when more than ``LONG_LOOP`` evictions run, ``LAYER_CHUNK`` layers at a time, so that a chunk's
    keys and values stay in the CPU's cache through the loop's steps. ``lax.map``'s chunks reshape
    every leaf, which leaves of size 0 (a zeroth-order cache's Σ v kᵀ) cannot be: those go around
    it, in and out."""
    if max_evict <= LONG_LOOP:
        return jax.vmap(fn)(xs)
    layer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), xs)
    out = jax.eval_shape(fn, layer)
    ys = jax.lax.map(
        lambda full: _nonempty(fn(_filled(full, layer, ()))), _nonempty(xs), batch_size=LAYER_CHUNK
    )
    return _filled(ys, out, jax.tree.leaves(xs)[0].shape[:1])


def _nonempty(tree) -> list:
    """The leaves of ``tree`` that hold elements."""
    return [x for x in jax.tree.leaves(tree) if x.size]


def _filled(full: list, like, lead: tuple):
    """The pytree of ``like``'s structure whose leaves are ``full``'s, in order, with zeros of
    shape ``lead`` + shape where ``like``'s leaves are of size 0."""
    rest = iter(full)
    leaves, tree = jax.tree.flatten(like)
    return tree.unflatten(
        [next(rest) if x.size else jnp.zeros(lead + x.shape, x.dtype) for x in leaves]
    )


def lowest_slots(score: jax.Array, pos: jax.Array, n: int) -> jax.Array:
    """The ``n`` slots [..., n] of lowest finite ``score`` [..., S] in ``pos`` order (of those tied
    at the n-th lowest value, the earliest; the first repeated when fewer are finite).
    Min-reductions only: XLA's CPU argmin is slower than a min, and ``lax.top_k`` makes a mesh
    gather the scores."""
    slot, last, size = jnp.arange(score.shape[-1]), jnp.iinfo(jnp.int32).max, score.shape[-1]
    bound = score.min(-1, keepdims=True)
    for _ in range(n - 1):  # the n-th lowest value
        above = jnp.where(score > bound, score, jnp.inf).min(-1, keepdims=True)
        bound = jnp.where(jnp.isfinite(above), above, bound)
    below = score <= bound
    chosen = []
    for _ in range(n):
        first = jnp.where(below, pos, last).min(-1, keepdims=True)
        found = below & (pos == first)
        chosen.append(jnp.where(found, slot, size).min(-1))
        below = below & ~found
    chosen = jnp.stack(chosen, -1)
    return jnp.where(chosen == size, chosen[..., :1], chosen)


def scores_at_once(max_evict: int, batch: int) -> bool:
    """Whether ``moment_informed_eviction`` of at most ``max_evict`` (``batch`` as there) scores
    every candidate by its residual norm at once, with no loop (a decoding step's): the norms a
    decode kernel can give from the tiles it reads."""
    return max_evict == 1 and batch == 1


def moment_informed_eviction(
    priority: jax.Array,
    candidates: jax.Array,
    n_evict: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    moments,
    zeroth: bool,
    max_evict: int,
    batch: int = 1,
    stack: tuple | None = None,
    norms: jax.Array | None = None,
    impl: str | None = None,
) -> jax.Array:
    """Algorithm 1's eviction loop: evict the candidate of lowest ``priority · ‖r_j‖`` with
    r_j = v_j − v̄ − S̃ k_j/(n√d) (r_j = v_j − v̄ if zeroth; r_j = v_j while nothing is evicted),
    add it to the statistics, then choose the next. Ties evict the earlier position. MI uses S̃
    without the App. C.2 clamp, which guards S̃ q in the correction.

    Args:
        priority, candidates, pos: [B, Hk, S].
        n_evict: [B, Hk] tokens to evict.
        k, v: [B, Hk, S, K].
        moments: one layer's Moments.
        max_evict: static bound on n_evict.
        stack: (k, v, layer): the stored keys and values [L, B, Hk, S, K] of every layer (arrays or
            ``Quantized``) of which k, v are layer ``layer``'s values; a decoding step's residual
            norms then read them in place (``kvjax.kernels.moment_residual_norms``).
        impl: the kernels' implementation (``kvjax.kernels.IMPLS``).

    Returns the evicted mask [B, Hk, S].

    ‖r_j‖² is kept as per-candidate scalars: with A = S̃/(n√d) = (S − v̄ s_kᵀ)/(n√d) and
    m_j = s_k·k_j, ‖r_j‖² = ‖v_j‖² − 2 v̄·v_j + ‖v̄‖² + ‖A k_j‖² − 2 v_j·A k_j + 2 v̄·A k_j, whose
    terms need only m_j, v_jᵀS k_j, ‖S k_j‖², s_v·v_j and v̄·S k_j; an eviction updates them with
    one pass over the keys (by k_e, Sᵀv_e and the next Sᵀv̄) and one over the values (by v_e), so a
    step reads K and V once and writes nothing of size S·K. Those terms cancel, so the scalars only
    screen: the ``SCREEN`` candidates of lowest lower bound (the sum less its rounding, ``FLOOR``)
    are scored from their vectors, and exact scores within ``TIE`` are a tie, so that equal tokens
    evict alike on any mesh. The rule is exact unless more than ``SCREEN`` candidates are within
    rounding of the lowest (then the earliest of those are scored). The loop stops when every (row,
    KV head) has evicted its ``n_evict``. With ``max_evict`` = 1 (a decoding step) every candidate
    is scored from its vectors at once: no screening and no loop.

    batch > 1 (``mi_batch``), a faster approximation when a prefill evicts thousands of tokens:
    ``_batched_eviction``.
    """
    if norms is not None and not scores_at_once(max_evict, batch):
        raise ValueError(
            f"norms are read by a decoding step's eviction (max_evict=1, batch=1) only; got "
            f"max_evict={max_evict}, batch={batch}"
        )
    if batch > 1:
        return _batched_eviction(
            priority, candidates, n_evict, k, v, pos, moments, zeroth, max_evict, batch
        )
    f32 = jnp.float32
    # a decoding step: every candidate scored from its vectors, nothing to screen or update
    if max_evict == 1:
        if norms is None:
            k_all, v_all, layer = stack or (k, v, None)
            lead = ("batch", "kv_heads") if layer is None else (None, "batch", "kv_heads")
            (norms,) = per_shard(
                lambda k, v, m, i: (moment_residual_norms(k, v, m, zeroth, layer=i, impl=impl),),
                (k_all, v_all, moments, layer),
                (lead, lead, ("batch", "kv_heads"), ()),
                (("batch", "kv_heads"),),
                *priority.shape[:2],
            )
        score = jnp.where(candidates, priority * norms, jnp.inf)
        tied = _tied_with_lowest(score)  # the earliest position among them, as the loop chooses
        first = jnp.where(tied, pos, jnp.iinfo(jnp.int32).max).min(-1, keepdims=True)
        return (
            tied
            & (pos == first)
            & (n_evict > 0)[..., None]
            & jnp.isfinite(score.min(-1, keepdims=True))
        )
    kf, vf = k.astype(f32), v.astype(f32)
    root_d = jnp.sqrt(f32(k.shape[-1]))

    def mean(count, v_sum):
        return v_sum / jnp.maximum(count, 1.0)[..., None]

    vv = jnp.einsum("bhsk,bhsk->bhs", vf, vf)  # ‖v_j‖²
    init = dict(
        evicted=jnp.zeros(priority.shape, bool),
        done=jnp.zeros_like(n_evict),
        count=moments.count,
        k_sum=moments.k_sum,
        v_sum=moments.v_sum,
        step=jnp.int32(0),
        sv=jnp.einsum("bhk,bhsk->bhs", moments.v_sum, vf),  # s_v·v_j
    )
    if not zeroth:  # the terms of S̃ k_j
        sk = jnp.einsum("bhij,bhsj->bhsi", moments.vk_sum, kf)  # S k_j, once
        init.update(
            S=moments.vk_sum,
            m=jnp.einsum("bhk,bhsk->bhs", moments.k_sum, kf),  # s_k·k_j
            vSk=jnp.einsum("bhsk,bhsk->bhs", vf, sk),  # v_jᵀ S k_j
            Sk2=jnp.einsum("bhsk,bhsk->bhs", sk, sk),  # ‖S k_j‖²
            g=jnp.einsum("bhi,bhsi->bhs", mean(moments.count, moments.v_sum), sk),  # v̄·S k_j
        )

    def screening_score(c):
        """A lower bound of priority · ‖r_j‖ from the scalars: ‖r_j‖² less ``FLOOR`` × the sum of
        its terms' magnitudes, which bounds the rounding of their cancelling sum."""
        n = jnp.maximum(c["count"], 1.0)[..., None]
        v_bar = mean(c["count"], c["v_sum"])
        vb2 = jnp.einsum("bhk,bhk->bh", v_bar, v_bar)[..., None]
        vbv = c["sv"] / n  # v̄·v_j
        r2, size = vv - 2.0 * vbv + vb2, vv + 2.0 * jnp.abs(vbv) + vb2
        if not zeroth:
            a = 1.0 / (n * root_d)
            m, g = c["m"], c["g"]
            r2 = (
                r2
                + a * a * (c["Sk2"] - 2.0 * m * g + m * m * vb2)
                - 2.0 * a * (c["vSk"] - m * vbv)
                + 2.0 * a * (g - m * vb2)
            )
            size = (
                size
                + a * a * (c["Sk2"] + 2.0 * jnp.abs(m * g) + m * m * vb2)
                + 2.0 * a * (jnp.abs(c["vSk"]) + jnp.abs(m * vbv) + jnp.abs(g) + jnp.abs(m) * vb2)
            )
        r2 = jnp.where((c["count"] > 0)[..., None], r2 - FLOOR * size, vv)
        return priority * jnp.sqrt(jnp.maximum(r2, 0.0))

    def exact_score(c, screened):
        """priority · ‖r_j‖ of the screened slots [B, Hk, M] from the vectors themselves (no
        cancellation)."""
        k_s, v_s = (jnp.take_along_axis(x, screened[..., None], axis=2) for x in (kf, vf))
        return _exact_scores(
            jnp.take_along_axis(priority, screened, -1),
            k_s,
            v_s,
            c["count"],
            c["k_sum"],
            c["v_sum"],
            c.get("S"),
            zeroth,
        )

    def step(c):
        score = jnp.where(candidates & ~c["evicted"], screening_score(c), jnp.inf)
        # the scalars screen (their terms cancel: a bound, not a score); the lowest few are scored
        # exactly
        screened = lowest_slots(score, pos, SCREEN)
        finite = jnp.isfinite(jnp.take_along_axis(score, screened, -1))
        exact = jnp.where(finite, exact_score(c, screened), jnp.inf)
        # argmin, the earliest position among equal scores (screened is in position order)
        chosen = jnp.argmax(_tied_with_lowest(exact), -1)[..., None]
        chosen = jnp.take_along_axis(screened, chosen, -1)
        take = c["done"] < n_evict  # [B, Hk]: rows and heads done evict nothing more
        w = take.astype(f32)[..., None]
        k_e = jnp.take_along_axis(kf, chosen[..., None], axis=2)[:, :, 0] * w
        v_e = jnp.take_along_axis(vf, chosen[..., None], axis=2)[:, :, 0] * w
        count, v_sum = c["count"] + w[..., 0], c["v_sum"] + v_e
        vd = jnp.einsum("bhsk,bhk->bhs", vf, v_e)  # v_e·v_j, the one pass over the values
        out = dict(
            evicted=max_slots(c["evicted"], chosen, take[..., None]),
            done=c["done"] + take,
            count=count,
            k_sum=c["k_sum"] + k_e,
            v_sum=v_sum,
            step=c["step"] + 1,
            sv=c["sv"] + vd,
        )
        if zeroth:
            return out
        S = c["S"] + v_e[..., :, None] * k_e[..., None, :]
        # one pass over the keys: k_e·k_j, (Sᵀ v_e)·k_j = v_e·S k_j (S before),
        # (Sᵀ v̄)·k_j = v̄·S k_j (after)
        by = jnp.stack(
            [
                k_e,
                jnp.einsum("bhij,bhi->bhj", c["S"], v_e),
                jnp.einsum("bhij,bhi->bhj", S, mean(count, v_sum)),
            ],
            2,
        )
        kk, vSk_e, g = jnp.moveaxis(jnp.einsum("bhsk,bhxk->bhsx", kf, by), -1, 0)
        ve2 = jnp.einsum("bhk,bhk->bh", v_e, v_e)[..., None]
        return out | dict(
            S=S,
            m=c["m"] + kk,
            vSk=c["vSk"] + vd * kk,
            Sk2=c["Sk2"] + 2.0 * kk * vSk_e + kk * kk * ve2,
            g=g,
        )

    def pending(c):
        return (c["step"] < max_evict) & jnp.any(c["done"] < n_evict)

    return jax.lax.while_loop(pending, step, init)["evicted"]


def _tied_with_lowest(score: jax.Array) -> jax.Array:
    """Where ``score`` [..., M] is within ``TIE`` of its lowest: equal tokens under equal priorities
    tie exactly but round apart when read at other slots."""
    lowest = score.min(-1, keepdims=True)
    return score <= lowest + TIE * jnp.abs(lowest)


def _exact_scores(priority, k, v, count, k_sum, v_sum, S, zeroth: bool) -> jax.Array:
    """priority · ‖r_j‖ [B, Hk, M] of the slots whose keys and values are k, v [B, Hk, M, K]
    (float32) under the statistics count [B, Hk], k_sum, v_sum [B, Hk, K], S [B, Hk, K, K], from the
    vectors (no cancellation: ``residual_norms``)."""
    return priority * residual_norms(k, v, count, k_sum, v_sum, S, zeroth)


def _batched_eviction(
    priority: jax.Array,
    candidates: jax.Array,
    n_evict: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    moments,
    zeroth: bool,
    max_evict: int,
    batch: int,
) -> jax.Array:
    """``mi_batch`` > 1: per step, the ``batch`` candidates of lowest score under the current
    statistics are evicted, then all added. S k_j and s_k·k_j are kept up to date by rank-``batch``
    updates (a step costs O(S·K·batch), fewer flops than the exact loop's scalar updates would need
    at this width)."""
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    scale = jnp.sqrt(jnp.float32(k.shape[-1]))
    # S k_j and s_k·k_j (the zeroth order reads neither)
    sk = None if zeroth else jnp.einsum("bhij,bhsj->bhsi", moments.vk_sum, kf)
    kk_sum = None if zeroth else jnp.einsum("bhk,bhsk->bhs", moments.k_sum, kf)

    def step(t, carry):
        evicted, count, k_sum, v_sum, sk, kk_sum = carry
        n = jnp.maximum(count, 1.0)[..., None, None]
        resid = vf - v_sum[:, :, None, :] / n
        if not zeroth:
            resid = resid - (sk - v_sum[:, :, None, :] * kk_sum[..., None] / n) / (n * scale)
        resid = jnp.where((count > 0)[..., None, None], resid, vf)
        score = jnp.where(
            candidates & ~evicted, priority * jnp.linalg.norm(resid, axis=-1), jnp.inf
        )
        index = jnp.broadcast_to(jnp.arange(k.shape[2]), pos.shape)
        chosen = jax.lax.sort((score, pos, index), dimension=-1, num_keys=2)[2][..., :batch]
        # [B, Hk, batch] chosen slots, of which the first ``take`` are evicted (the rest weigh 0)
        take = jnp.clip(n_evict - evicted.sum(-1), 0, batch)
        w = (jnp.arange(chosen.shape[-1]) < take[..., None]).astype(jnp.float32)
        k_c = jnp.take_along_axis(kf, chosen[..., None], axis=2) * w[..., None]
        v_c = jnp.take_along_axis(vf, chosen[..., None], axis=2)
        evicted = max_slots(evicted, chosen, w > 0)
        if not zeroth:
            dots = jnp.einsum("bhck,bhsk->bhsc", k_c, kf)  # w_c (k_c·k_j)
            sk, kk_sum = sk + jnp.einsum("bhsc,bhck->bhsk", dots, v_c), kk_sum + dots.sum(-1)
        return (
            evicted,
            count + w.sum(-1),
            k_sum + k_c.sum(2),
            v_sum + jnp.einsum("bhc,bhck->bhk", w, v_c),
            sk,
            kk_sum,
        )

    init = (
        jnp.zeros(priority.shape, bool),
        moments.count,
        moments.k_sum,
        moments.v_sum,
        sk,
        kk_sum,
    )
    return jax.lax.fori_loop(0, -(-max_evict // batch), step, init)[0]
