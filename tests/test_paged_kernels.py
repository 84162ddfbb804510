"""Paged kernels of ``kvjax.kernels.paged_attention`` against their reference, and their lowering
for TPU and GPU.

* The reference gathers each KV head's pages into the dense layout and runs the dense references: it
  equals them on a layout gathered in NumPy, and a direct float64 NumPy computation on a tiny case.
* Both kernels of each operation — the Mosaic-TPU one under JAX's TPU interpret mode (``STRICT``: a
  DMA lands only when it is waited for, VMEM starts as NaN, races are detected), the Triton one
  under the Pallas interpreter — equal the reference over head dims (64, 128), GQA groups (1, 3, 4,
  8), page sizes (16, 32), every score kind, with and without query weights, float32 and bfloat16,
  and decode with MomentKV's first- and zeroth-order correction. Every case has ragged page counts
  (a head with no page, one using all M), shuffled physical pages, unused table entries naming other
  heads' or spare pages, positions left at unused pages' slots, empty slots inside used pages
  (middle, and the tail of the last one), fully masked query rows that score, and (TPU) more than
  one key block per head. Each factor value meets each kernel.
* Poison: spare pages — named only by unused table entries — full of NaN: the outputs are finite and
  equal the reference on clean data.
* ``jax.export`` lowers every kernel at SmolLM2 and Llama-3-8B-like geometry for
  ``platforms=["tpu"]`` (``tpu_custom_call``) and ``["cuda"]`` (``__gpu$xla.gpu.triton``); impl=None
  keeps only the platform's kernel, none for CPU; a page size a kernel does not take runs the
  reference on that platform.

Tolerances are those of tests/test_kernels.py (the same kernels' arithmetic):

    dtype     out (a / rtol)  lse (atol / rtol)  col (a / rtol)
    float32   1e-5 / 1e-5     1e-5 / 1e-5        1e-5 / 1e-5
    bfloat16  3e-2 / 3e-2     3e-2 / 1e-2        3e-2 / 5e-2

Interpreted kernels cost their XLA:CPU compilation, not their run, so they are compiled at the
lowest optimisation level (``run``).
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from kvjax.kernels._shared import NEG_INF, SCORE_KINDS
from kvjax.kernels.block_attention import reference as block_ref
from kvjax.kernels.decode_attention import reference as decode_ref
from kvjax.kernels.gpu_common import decode_splits
from kvjax.kernels.paged_attention import (
    gpu,
    paged_block_attention_with_scores,
    paged_decode_attention_with_scores,
    reference,
    tpu,
)

# dtype -> output -> (atol, rtol); atol is a fraction of max |reference| except for lse
TOLERANCE = {
    "float32": {"out": (1e-5, 1e-5), "lse": (1e-5, 1e-5), "col": (1e-5, 1e-5)},
    "bfloat16": {"out": (3e-2, 3e-2), "lse": (3e-2, 1e-2), "col": (3e-2, 5e-2)},
}
STRICT = pltpu.InterpretParams(
    detect_races=True, uninitialized_memory="nan"
)  # a copy lands when awaited
EAGER = pltpu.InterpretParams(
    dma_execution_mode="eager", uninitialized_memory="nan"
)  # ... when started
TRITON_CALL = "__gpu$xla.gpu.triton"
GPU_EXPORT_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]


class Moments(NamedTuple):
    """One layer's MomentKV statistics (the fields ``corrected_attention`` reads)."""

    count: jax.Array
    k_sum: jax.Array
    v_sum: jax.Array
    vk_sum: jax.Array


def compiled(fn, *args):
    """fn jitted for args' shapes and compiled (with the suite's XLA flags, conftest.py)."""
    return jax.jit(fn).lower(*args).compile()


def run(fn, *args):
    return compiled(fn, *args)(*args)


def make_case(
    seed, B=2, T=20, Hk=2, G=3, K=64, P=16, M=12, dtype=jnp.float32, weighted=True, poison=False
):
    """A paged cache as a budget allocator leaves it. n_pages ragged: row 0's head 0 has no page,
    the last row's last head all M. Used pages are a shuffled part of the pool; unused table entries
    name any page (another head's, or one of 3 spare pages), or only spare pages — full of NaN —
    when ``poison``. Used pages hold kept positions and the block's own T positions in shuffled
    slots, with empty slots in the middle and at the tail of the last page; unused pages' slots keep
    stale positions. Query 0 of row 1 has position -1 (fully masked) and scores, as do the last 4
    queries of every row."""
    r = np.random.default_rng(seed)
    n_pages = r.integers(1, M, size=(B, Hk)).astype(np.int32)
    n_pages[0, 0], n_pages[-1, -1] = 0, M
    n_used, spare = int(n_pages.sum()), 3
    pool = r.permutation(n_used + spare)
    spare_pages = pool[n_used:]
    table = np.zeros((B, Hk, M), np.int32)
    S = M * P
    context = S + 40  # positions of the block: context .. context + T − 1
    slot_pos = r.integers(0, context, size=(B, Hk, S)).astype(np.int32)  # stale at unused pages
    taken = 0
    for b in range(B):
        for h in range(Hk):
            n = n_pages[b, h]
            table[b, h, :n] = pool[taken : taken + n]
            taken += n
            table[b, h, n:] = r.choice(spare_pages if poison else pool, M - n)
            if n == 0:
                continue
            filled = np.arange(n * P - r.integers(0, P // 2))  # an empty tail in the last page
            filled = np.setdiff1d(
                filled, r.choice(filled[1:], 3, replace=False)
            )  # and 3 empty slots inside
            own = min(T, len(filled))
            live = np.concatenate(
                [context + np.arange(own), r.choice(context, len(filled) - own, replace=False)]
            )
            slot_pos[b, h, : n * P] = -1
            slot_pos[b, h, filled] = r.permutation(live)
    query_pos = np.broadcast_to(context + np.arange(T, dtype=np.int32), (B, T)).copy()
    query_pos[1, 0] = -1
    k_pages = r.normal(size=(B, len(pool), P, K)) * 1.5
    v_pages = r.normal(size=(B, len(pool), P, K))
    if poison:
        k_pages[:, spare_pages] = v_pages[:, spare_pages] = np.nan
    q = r.normal(size=(B, T, Hk * G, K)) * 1.5
    weights = None
    if weighted:
        w = np.zeros((B, T), np.float32)
        w[:, -min(4, T) :] = r.uniform(0.5, 1.5, size=(B, min(4, T)))
        w[1, 0] = 0.3
        weights = jnp.asarray(w)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(k_pages, dtype),
        jnp.asarray(v_pages, dtype),
        jnp.asarray(table),
        jnp.asarray(n_pages),
        jnp.asarray(slot_pos),
        jnp.asarray(query_pos),
        weights,
    )


def make_moments(seed, B, Hk, K):
    """Statistics of some evicted tokens, with nothing evicted for row 0, KV head 0 (count 0)."""
    r = np.random.default_rng(seed + 100)
    count = r.integers(1, 20, size=(B, Hk)).astype(np.float32)
    count[0, 0] = 0.0
    ks = r.normal(size=(B, Hk, 20, K)) * 1.5
    vs = r.normal(size=(B, Hk, 20, K))
    take = (np.arange(20)[None, None] < count[..., None]).astype(np.float64)
    return Moments(
        *(
            jnp.asarray(x, jnp.float32)
            for x in (
                count,
                np.einsum("bhe,bhek->bhk", take, ks),
                np.einsum("bhe,bhek->bhk", take, vs),
                np.einsum("bhe,bhei,bhej->bhij", take, vs, ks),
            )
        )
    )


def assert_close(got, want, dtype, name):
    atol_frac, rtol = TOLERANCE[jnp.dtype(dtype).name][name]
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.isfinite(got).all(), f"{name}: non-finite values"
    # lse: absolute atol (a fully masked row's lse is about -1e30, which must not set the scale)
    atol = atol_frac if name == "lse" else atol_frac * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)


def assert_outputs_close(got, want, dtype):
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype == jnp.float32
    for name, g, w in zip(("out", "lse", "col"), got, want, strict=True):
        if w is None:
            assert g is None, name
        else:
            assert g.dtype == w.dtype, name
            assert_close(g, w, dtype, name)


def gathered_in_numpy(k_pages, v_pages, page_table, n_pages, slot_pos):
    """The dense layout of the paged cache, slot by slot: unused pages' slots empty and zero."""
    k_pages, v_pages = np.asarray(k_pages, np.float64), np.asarray(v_pages, np.float64)
    B, Hk, M = page_table.shape
    P, K = k_pages.shape[2:]
    k, v = np.zeros((B, Hk, M * P, K)), np.zeros((B, Hk, M * P, K))
    spos = np.full((B, Hk, M * P), -1, np.int32)
    for b in range(B):
        for h in range(Hk):
            for s in range(int(n_pages[b, h]) * P):
                page = int(page_table[b, h, s // P])
                k[b, h, s], v[b, h, s] = k_pages[b, page, s % P], v_pages[b, page, s % P]
                spos[b, h, s] = slot_pos[b, h, s]
    return k, v, spos


# --- the reference
# -------------------------------------------------------------------------------------------


def test_reference_is_the_dense_reference_on_the_gathered_layout():
    q, k_pages, v_pages, table, n, slot_pos, query_pos, w = make_case(1, K=16)
    k, v, spos = gathered_in_numpy(k_pages, v_pages, table, n, slot_pos)
    k, v, spos = jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), jnp.asarray(spos)
    for score in ("attn", "obcache-joint"):
        got = run(
            lambda *a, s=score: reference.paged_block_attention_with_scores(*a, s),
            q,
            k_pages,
            v_pages,
            table,
            n,
            slot_pos,
            query_pos,
            w,
        )
        want = run(
            lambda *a, s=score: block_ref.block_attention_with_scores(*a, s),
            q,
            k,
            v,
            spos,
            query_pos,
            w,
        )
        for g, x in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(x, np.float32))
    moments = make_moments(1, 2, 2, 16)
    got = run(
        lambda *a: reference.paged_decode_attention_with_scores(*a, "obcache-key", moments),
        q[:, :1],
        k_pages,
        v_pages,
        table,
        n,
        slot_pos,
        query_pos[:, :1],
        w[:, :1],
    )
    want = run(
        lambda *a: decode_ref.decode_attention_with_scores(*a, "obcache-key", moments),
        q[:, :1],
        k,
        v,
        spos,
        query_pos[:, :1],
        w[:, :1],
    )
    for g, x in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(x, np.float32))


def test_reference_equals_a_direct_numpy_computation():
    """One row, head 0 with 1 of 3 pages (an empty slot in it), head 1 with all 3; query 0 is fully
    masked and scores: its weight spreads over all 6 slots of each head, the unused ones included.
    """
    B, T, Hk, G, K, P, M = 1, 3, 2, 2, 4, 2, 3
    r = np.random.default_rng(3)
    q, k_pages, v_pages = (
        r.normal(size=(B, T, Hk * G, K)),
        r.normal(size=(B, 6, P, K)),
        r.normal(size=(B, 6, P, K)),
    )
    table = np.array(
        [[[4, 2, 1], [2, 0, 5]]], np.int32
    )  # head 0's unused entries: head 1's page 2, spare page 1
    n = np.array([[1, 3]], np.int32)
    slot_pos = np.array([[[2, -1, 3, 0, 2, 1], [5, 0, 6, -1, 1, 2]]], np.int32)
    query_pos = np.array([[-1, 4, 6]], np.int32)
    w = np.array([[0.5, 0.0, 2.0]], np.float32)
    k, v, spos = gathered_in_numpy(k_pages, v_pages, table, n, slot_pos)
    z = np.einsum("thgk,hsk->hgts", q[0].reshape(T, Hk, G, K), k[0]) / np.sqrt(K)
    visible = ((spos[0] >= 0)[:, None, :] & (spos[0][:, None, :] <= query_pos[0][None, :, None]))[
        :, None
    ]
    logits = np.where(visible, z, NEG_INF)
    a = np.exp(logits - logits.max(-1, keepdims=True))
    lse = np.log(a.sum(-1)) + logits.max(-1)
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("hgts,hsk->hgtk", a, v[0])
    z0 = np.where(visible, z, 0.0)
    diff = v[0][:, None, None] - o[:, :, :, None]  # [Hk, G, T, S, K]
    c = w[0][None, None, :, None] * a * a
    value = np.sum(c, 2) * np.sum(v[0] ** 2, -1)[:, None]
    key = np.sum(c * z0 * z0 * np.sum(diff**2, -1), 2)
    want_col = {
        "attn": np.sum(w[0][None, None, :, None] * a, 2),
        "obcache-value": value,
        "obcache-key": key,
        "obcache-joint": value
        + key
        + 2 * np.sum(c * z0 * np.einsum("hsk,hgtsk->hgts", v[0], diff), 2),
    }
    inputs = [jnp.asarray(x, jnp.float32) for x in (q, k_pages, v_pages)]
    inputs += [jnp.asarray(x) for x in (table, n, slot_pos, query_pos, w)]
    for score in SCORE_KINDS:
        out, got_lse, col = reference.paged_block_attention_with_scores(*inputs, score)
        np.testing.assert_allclose(
            np.asarray(out)[0], o.transpose(2, 0, 1, 3).reshape(T, Hk * G, K), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            np.asarray(got_lse)[0], lse.transpose(2, 0, 1).reshape(T, Hk * G), rtol=1e-6
        )
        np.testing.assert_allclose(
            np.asarray(col)[0], want_col[score], rtol=1e-5, atol=1e-6, err_msg=score
        )
    assert np.all(
        want_col["attn"][0] >= 0.5 / (M * P) - 1e-9
    )  # the masked query's share on every slot of head 0


# --- kernels against the reference (interpreted)
# -------------------------------------------------------------

# (head dim, G, page size, score, weighted, dtype): every value of every factor, with both kernels.
BLOCK_GRID = [
    (64, 1, 16, "attn", True, jnp.float32),
    (64, 3, 32, "obcache-value", True, jnp.bfloat16),
    (64, 4, 16, "obcache-key", True, jnp.float32),
    (64, 8, 32, "obcache-joint", True, jnp.bfloat16),
    (128, 1, 32, "obcache-joint", True, jnp.float32),
    (128, 3, 16, "obcache-key", True, jnp.bfloat16),
    (128, 4, 32, "attn", False, jnp.bfloat16),
    (128, 8, 16, "obcache-value", True, jnp.float32),
]
N_TABLE = {
    16: 12,
    32: 7,
}  # M: 192 / 224 logical slots, 2 TPU key blocks of 128, the second partly unused
KERNELS = {
    # TPU: T = 20 is padded to 32 rows per head; row tiles of 48 rows (all heads together) straddle
    # heads. The key terms' per-row loop is slow under STRICT and streams the same pages as
    # obcache-value: plain interpreter there. GPU: query tiles of 16: T = 20 needs 2 per head, the
    # last one mostly padding.
    "tpu": lambda *a, score: tpu.paged_block_attention_tpu(
        *a, score, block_q=48, interpret=STRICT if score in ("attn", "obcache-value") else True
    ),
    "gpu": lambda *a, score: gpu.paged_block_attention_gpu(*a, score, block_q=16, interpret=True),
}


def _case_id(case):
    K, G, P, score, weighted, dtype = case[:6]
    return f"K{K}-G{G}-P{P}-{score}-{'w' if weighted else 'now'}-{jnp.dtype(dtype).name}"


@functools.cache
def block_case(case):
    """(inputs, reference outputs) of a BLOCK_GRID case, shared by both kernels."""
    K, G, P, score, weighted, dtype = case
    args = make_case(G * K + P, G=G, K=K, P=P, M=N_TABLE[P], dtype=dtype, weighted=weighted)
    return args, run(lambda *a: reference.paged_block_attention_with_scores(*a, score), *args)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("case", BLOCK_GRID, ids=_case_id)
def test_paged_block_kernel_equals_reference(case, kernel):
    args, want = block_case(case)
    got = run(lambda *a: KERNELS[kernel](*a, score=case[3]), *args)
    assert_outputs_close(got, want, case[5])


# (head dim, G, page size, score, weighted, dtype, moments: None / "first" / "zeroth")
DECODE_GRID = [
    (64, 1, 16, "obcache-key", True, jnp.float32, "first"),
    (64, 3, 32, "obcache-joint", True, jnp.bfloat16, "zeroth"),
    (64, 4, 16, "attn", False, jnp.float32, "first"),
    (128, 4, 32, "obcache-value", True, jnp.bfloat16, None),
    (128, 8, 16, "attn", True, jnp.float32, "zeroth"),
    (128, 3, 32, "obcache-joint", True, jnp.float32, None),
]
DECODE_KERNELS = {
    "tpu": {"impl": "pallas_tpu", "interpret": STRICT},
    "gpu": {"impl": "pallas_gpu", "interpret": True},
}


@functools.cache
def decode_case(case):
    """(inputs, moments, reference outputs) of a DECODE_GRID case. Three rows: row 0's head 0 has no
    page, row 1's query is fully masked (position -1) and scores, row 2's last head uses all M
    pages."""
    K, G, P, score, weighted, dtype, correction = case
    args = make_case(
        G * K + P + 1, B=3, T=1, G=G, K=K, P=P, M=N_TABLE[P], dtype=dtype, weighted=weighted
    )
    moments = None if correction is None else make_moments(G, 3, 2, K)
    want = run(
        lambda *a: reference.paged_decode_attention_with_scores(
            *a, score, moments, correction == "zeroth"
        ),
        *args,
    )
    return args, moments, want


@pytest.mark.parametrize("kernel", sorted(DECODE_KERNELS))
@pytest.mark.parametrize("case", DECODE_GRID, ids=lambda c: _case_id(c) + f"-{c[6]}")
def test_paged_decode_kernel_equals_reference(case, kernel):
    args, moments, want = decode_case(case)
    score, zeroth = case[3], case[6] == "zeroth"
    got = run(
        lambda *a: paged_decode_attention_with_scores(
            *a, score, moments, zeroth, **DECODE_KERNELS[kernel]
        ),
        *args,
    )
    assert_outputs_close(got, want, case[5])


def test_gpu_paged_decode_kernel_over_many_splits_equals_reference():
    """Tables of 165 pages of 32 slots (5,280 per head): the default makes 10 runs of used pages per
    head, over heads that use from no page to all 165."""
    args = make_case(21, B=2, T=1, G=4, P=32, M=165)
    assert decode_splits(2 * 2, 165 * 32) == 10
    want = run(lambda *a: reference.paged_decode_attention_with_scores(*a, "obcache-joint"), *args)
    got = run(
        lambda *a: paged_decode_attention_with_scores(
            *a, "obcache-joint", impl="pallas_gpu", interpret=True
        ),
        *args,
    )
    assert_outputs_close(got, want, jnp.float32)


@pytest.mark.parametrize("kernel", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("kind", ["block", "decode"])
def test_pages_no_used_entry_names_may_hold_nan(kind, kernel):
    """Spare pages full of NaN, named by every unused table entry (and, for the TPU kernel, VMEM
    starting as NaN): finite outputs equal to the reference on the same cache with those pages
    clean."""
    T, score = (20, "obcache-joint") if kind == "block" else (1, "obcache-key")
    poisoned = make_case(5, B=3 - (kind == "block"), T=T, poison=True)
    spare = np.isnan(np.asarray(poisoned[1]))
    clean = list(poisoned)
    clean[1], clean[2] = (jnp.where(jnp.asarray(spare), 0.0, x) for x in poisoned[1:3])
    assert spare.any()
    fn = (
        paged_block_attention_with_scores if kind == "block" else paged_decode_attention_with_scores
    )
    interpret = STRICT if kernel == "pallas_tpu" else True
    ref = compiled(lambda *a: fn(*a, score, impl="xla"), *clean)
    want = ref(*clean)
    # the reference does not use them either
    for got in (
        run(lambda *a: fn(*a, score, impl=kernel, interpret=interpret), *poisoned),
        ref(*poisoned),
    ):
        assert_outputs_close(got, want, jnp.float32)


@pytest.mark.parametrize("kind", ["block", "decode"])
def test_tpu_kernels_copy_the_used_pages_and_no_other(kind, capfd):
    """Unused table entries point past the pool and copies land when started (EAGER). TPU interpret
    mode raises on a DMA from outside the pool (shown with a used entry), and prints a report for a
    semaphore left non-zero at kernel exit — a copy started and never waited for, e.g. a page
    fetched twice. Neither
    happens: no unused page is copied, and every copy is awaited (STRICT, elsewhere, shows none is
    missed)."""
    T, fn, score = (
        (20, tpu.paged_block_attention_tpu, "obcache-value")
        if kind == "block"
        else (1, tpu.paged_decode_attention_tpu, "attn")
    )  # decode attn: phase 1 copies K only
    q, k_pages, v_pages, table, n, *rest = make_case(7, B=3 - (kind == "block"), T=T)
    N, M = k_pages.shape[1], table.shape[-1]
    outside = jnp.where(jnp.arange(M) < n[..., None], table, N)
    kernel = compiled(
        lambda *a: fn(*a, score, interpret=EAGER), q, k_pages, v_pages, outside, n, *rest
    )
    want = run(
        lambda *a: reference.paged_block_attention_with_scores(*a, score),
        q,
        k_pages,
        v_pages,
        table,
        n,
        *rest,
    )
    assert_outputs_close(kernel(q, k_pages, v_pages, outside, n, *rest), want, jnp.float32)
    assert "non-zero count" not in capfd.readouterr().out
    if kind == "block":
        try:
            with pytest.raises(jax.errors.JaxRuntimeError, match="Out-of-bounds read"):
                kernel(q, k_pages, v_pages, outside.at[1, 0, 0].set(N), n, *rest)  # a used entry
        finally:
            pltpu.reset_tpu_interpret_mode_state()


def test_api_default_is_the_reference_on_cpu_and_pallas_is_the_interpreted_tpu_kernel():
    args = make_case(9, T=6, G=3, M=4)
    ref = jax.jit(lambda *a: reference.paged_block_attention_with_scores(*a, "obcache-value"))(
        *args
    )
    default = jax.jit(lambda *a: paged_block_attention_with_scores(*a, "obcache-value"))(*args)
    for got, want in zip(default, ref, strict=True):  # the same program
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    jaxpr = str(
        jax.make_jaxpr(
            lambda *a: paged_block_attention_with_scores(*a, "obcache-value", impl="pallas")
        )(*args)
    )
    assert (
        "platform_index" in jaxpr and jaxpr.count("pallas_call") == 2 * 3
    )  # cpu / tpu / cuda branches
    assert (
        jax.eval_shape(lambda *a: paged_block_attention_with_scores(*a[:7], impl="pallas"), *args)[
            2
        ]
        is None
    )
    with pytest.raises(ValueError, match="score"):
        paged_block_attention_with_scores(*args, "attention")
    with pytest.raises(ValueError, match="impl"):
        paged_block_attention_with_scores(*args, impl="triton")
    with pytest.raises(ValueError, match="n_pages"):
        paged_block_attention_with_scores(*args[:4], args[4][:, :1], *args[5:])


# --- lowering for TPU and GPU from this CPU machine
# ----------------------------------------------------------

GEOMETRIES = {  # name -> (Hk, G, K): budget 512 (SmolLM2) / 1024 (Llama) in pages of 16
    "smollm2": (3, 3, 64),
    "llama3-8b": (8, 4, 128),
}
BUDGET = {"smollm2": 512, "llama3-8b": 1024}


def _structs(kind, geometry, P=16, dtype=jnp.bfloat16, B=1):
    """Block: T = 128 and budget + 128 slots; decode: budget + 1 slots — M pages of P per head, a
    pool of 4·Hk·M pages (other layers' pages live there too)."""
    Hk, G, K = GEOMETRIES[geometry]
    T = 128 if kind == "block" else 1
    M = -(-(BUDGET[geometry] + T) // P)
    f32, i32, S = jnp.float32, jnp.int32, jax.ShapeDtypeStruct
    return [
        S((B, T, Hk * G, K), dtype),
        S((B, 4 * Hk * M, P, K), dtype),
        S((B, 4 * Hk * M, P, K), dtype),
        S((B, Hk, M), i32),
        S((B, Hk), i32),
        S((B, Hk, M * P), i32),
        S((B, T), i32),
        S((B, T), f32),
    ]


def _moment_structs(geometry, B=1):
    Hk, _, K = GEOMETRIES[geometry]
    f32 = jnp.float32
    return (
        jax.ShapeDtypeStruct((B, Hk), f32),
        jax.ShapeDtypeStruct((B, Hk, K), f32),
        jax.ShapeDtypeStruct((B, Hk, K), f32),
        jax.ShapeDtypeStruct((B, Hk, K, K), f32),
    )


def _custom_calls(fn, platform, *structs):
    checks = GPU_EXPORT_CHECKS if platform == "cuda" else []
    exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(
        *structs
    )
    return re.findall(r"custom_call @([\w$.]+)", exported.mlir_module())


LOWERINGS = [("tpu", "pallas_tpu", "tpu_custom_call"), ("cuda", "pallas_gpu", TRITON_CALL)]


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("platform,impl,call", LOWERINGS)
def test_paged_kernels_lower_at_model_shapes(geometry, platform, impl, call):
    block, decode = _structs("block", geometry), _structs("decode", geometry)
    for score in SCORE_KINDS:
        # TPU: one call, both phases; GPU: split softmax + scores, "attn" from the softmax's logits
        decode_passes = 1 if platform == "tpu" or score == "attn" else 2
        calls = _custom_calls(
            lambda *a, s=score: paged_block_attention_with_scores(*a, s, impl=impl),
            platform,
            *block,
        )
        assert calls == [call, call], (score, calls)  # the softmax pass and the scores pass

        def fn(*a, score=score):
            return paged_decode_attention_with_scores(*a[:8], score, Moments(*a[8:]), impl=impl)

        calls = _custom_calls(fn, platform, *decode, *_moment_structs(geometry))
        assert calls == [call] * decode_passes, (score, calls)
    calls = _custom_calls(
        lambda *a: paged_block_attention_with_scores(*a[:7], impl=impl), platform, *block
    )
    assert calls == [call], calls  # no weights: the softmax pass only


@pytest.mark.parametrize(
    "platform,call,other",
    [("tpu", "tpu_custom_call", TRITON_CALL), ("cuda", TRITON_CALL, "tpu_custom_call")],
)
def test_default_impl_lowers_to_the_kernel_of_the_platform(platform, call, other):
    for kind, fn in (
        ("block", lambda *a: paged_block_attention_with_scores(*a, "obcache-value")),
        ("decode", lambda *a: paged_decode_attention_with_scores(*a, "attn")),
    ):
        structs = _structs(kind, "smollm2")
        calls = _custom_calls(fn, platform, *structs)
        assert call in calls and other not in calls, (kind, calls)
        assert not _custom_calls(fn, "cpu", *structs), kind


def test_a_page_size_a_kernel_does_not_take_runs_the_reference_on_that_platform():
    """P = 8: neither kernel takes it (TPU: not a multiple of 16; Triton: below tl.dot's 16).
    impl=None lowers the reference instead of failing; asking for a kernel says why it cannot."""
    assert tpu.supports(64, 8) is gpu.supports(64, 8) is False
    structs = _structs("block", "smollm2", P=8)
    fn = lambda *a: paged_block_attention_with_scores(*a, "attn")  # noqa: E731
    for platform in ("tpu", "cuda"):
        assert not _custom_calls(fn, platform, *structs), platform
    for impl, kernel in (("pallas_tpu", "TPU"), ("pallas_gpu", "Triton")):
        with pytest.raises(ValueError, match=f"page size 8 .* for the {kernel} kernel"):
            jax.eval_shape(
                lambda *a, i=impl: paged_block_attention_with_scores(*a, impl=i), *structs
            )
