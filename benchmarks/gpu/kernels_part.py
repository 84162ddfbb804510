"""Part "kernels": every Pallas GPU kernel of ``kvjax.kernels`` checked against a float32 reference
on fresh random inputs, and timed against the XLA reference and (attention output alone)
``jax.nn.dot_product_attention``.

Checks: block attention, decode attention (plain, with MomentKV's first- and zeroth-order
correction), MomentKV's residual norms (``moment_residual_norms``, op "moment_residuals": its
decoding eviction; op "decode_residuals": the same norms from the decode kernel's softmax pass,
which is what the decoding step runs), Expected Attention's expected logits (``expected_logits``, op
"expected_logits": its scoring at every eviction point, statistics of 300 queries, the last 16
kept aside as a decoding keeps them, and of one),
paged block and paged decode attention (plain and corrected), every score kind, and the dense
cache's decoding eviction (``lowest_place``, op "lowest_place": each head's place of the lowest
pooled key, SnapKV's settings; float32 states, compared place for place: its tolerance is 0) and the
paged cache's (``lowest_places``, op "lowest_places": each head's KV-heads-many lowest places and
its counts of valid and protected slots, compared exactly),
at SmolLM2's heads (3 KV heads of 3 query heads, head dim 64) and Llama-3.1-8B's (8 of 4, head dim
128), float32 and bfloat16, cache lengths of 1061 slots (a ragged last tile) and 32768 (then 4096 if
time is left). Inputs: two batch rows, positions shuffled per head, 3% of the slots empty plus the
last five, scoring weights on the last 32 queries of a 128-query block, a head with nothing evicted
in the moments; paged: pages of 16 in a shuffled pool, each head using between half and all of its
table. The reference is kvjax's XLA computation on the same inputs cast to float32 at ``highest``
matmul precision; the error is ‖x − ref‖ / ‖ref‖ per output (out, lse, col), and a NaN fails. The
XLA reference in the inputs' own dtype (default precision) is measured the same way beside it. The
dense decode kernels read the case's keys and values as the middle layer of a stack of three
(``layer=``), as the budget cache hands them over.

The full cache's prompt attention (``kvjax.kernels.causal_attention``, op "prompt": cuDNN's flash
attention on CUDA, no Pallas kernel) is checked the same way, in bfloat16 (cuDNN takes no float32),
over causal sequences of the case's length in two rows; the row says which attention the compiled
program holds.

Timings (Llama-3.1-8B heads, bfloat16, 4 rows, 1K / 4K / 32K slots, every slot visible): the median
of batches of back-to-back calls, inputs rotated among 3 sets when they would fit in L2. The
eviction's ``lowest_place`` is timed as one decoding step of the 8B's 32 layers at batch 1 and 64
(32 and 2,048 rows of 8 heads, 1,025 slots: budget 1024), against the XLA form it replaces;
``lowest_places`` the same at AdaKV 1024's capacity (6,576 slots a head, 8 picks). The
dense decode kernel is also timed at a budget cache's batches 64 and 512 (1,025 slots) with 1, 2 and
4 flash-decoding splits beside the default's (``gpu_common.decode_splits``: 8 there), and at batch 1
(the full cache's 4,352 slots at 4K, and 1,025) with 16 and 32.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
from common import (
    Compiler,
    Deadline,
    Results,
    guarded,
    log,
    median_seconds,
    prompt_attention,
    rel_error,
)
from kvjax.kernels import (
    SCORE_KINDS,
    block_attention_with_scores,
    causal_attention,
    decode_attention_with_scores,
    expected_logits,
    lowest_place,
    lowest_places,
    moment_residual_norms,
)
from kvjax.kernels.decode_attention import gpu as decode_gpu
from kvjax.kernels.paged_attention import (
    paged_block_attention_with_scores,
    paged_decode_attention_with_scores,
)

from kvjax.eviction.expected_attention import QUERY_BUFFER, mean_rotation, rotation_matrix
from kvjax.eviction.moments import Moments

SHAPES = {
    "smollm2": (3, 3, 64),
    "llama8b": (8, 4, 128),
}  # (KV heads, query heads per KV head, head dim)
# METHOD.md: TF32-level float32 dots land near 3e-4, bfloat16 operands between 1e-3 and 1e-2
TOL = {"float32": 1e-3, "bfloat16": 1e-2}
BLOCK_T, WINDOW, PAGE = 128, 32, 16
L2_BYTES = 60 << 20
# op -> (paged, decode, moments: None / "first" / "zeroth")
OPS = {
    "block": (False, False, None),
    "decode": (False, True, None),
    "decode+momentkv": (False, True, "first"),
    "decode+momentkv-zeroth": (False, True, "zeroth"),
    "paged_block": (True, False, None),
    "paged_decode": (True, True, None),
    "paged_decode+momentkv": (True, True, "first"),
    # MomentKV's residual norms (a decoding step's moment-informed eviction) on the decode inputs;
    # the row's "out" is the norms: in their own kernel, and from the decode kernel's softmax pass
    # (``decode_attention_with_scores(residuals=...)``, what the decoding step runs)
    "moment_residuals": (False, True, "first"),
    "decode_residuals": (False, True, "first"),
    # Expected Attention's logits (its scoring at an eviction point) of the decode inputs' keys; the
    # row's "out" is the logits
    "expected_logits": (False, True, "queries"),
}
MOMENT_RESIDUALS = "moment_residuals"
DECODE_RESIDUALS = "decode_residuals"
EXPECTED_LOGITS = "expected_logits"
# the dense cache's decoding eviction, SnapKV's settings; its inputs: a layer's state, positions,
# order and seen, float32 states whatever the case's dtype says
LOWEST_PLACE = "lowest_place"
PLACE_OPTIONS = dict(n_sink=4, window=32, aggregate="mean", pool="max", kernel=7)
PLACE_LAYERS = 32  # a timed call: every layer of the 8B's decoding step, as rows
# the paged cache's decoding eviction (AdaKV): each head's KV-heads-many lowest, SnapKV's settings;
# timed at the 8B's AdaKV 1024 capacity (8 heads sharing 8 × 1,024 slots, less 7 floors)
LOWEST_PLACES = "lowest_places"
PLACES_CAPACITY = 6576
PLACE_OPS = (LOWEST_PLACE, LOWEST_PLACES)
# causal_attention: the full cache's prompt (cuDNN on CUDA), checked beside the kernels
PROMPT = "prompt"
# The decoding evictions' kernels are also timed with 128-slot key tiles (and 8 warps): each tile
# loads its head's [K, K] float32 matrices, so larger tiles halve those loads (gpu/NOTES.md)
WIDE = "pallas_gpu_128"
WIDE_OPS = (MOMENT_RESIDUALS, EXPECTED_LOGITS)
# The dense decode kernel at a budget cache's large batches (budget 1024 + the new token) with fewer
# flash-decoding splits than the default's 8: B · Hk programs alone fill the card there, and every
# split writes partial outputs that a merge reads back (gpu/NOTES.md, eighth session). At batch 1
# with more: the default gives the full cache at 4K (4,352 slots) 8 splits, 64 programs on 132
# SMs, and SnapKV 1024 (1,025 slots) 6 (gpu/NOTES.md, nineteenth session).
SPLITS = {f"pallas_gpu_splits{n}": n for n in (1, 2, 4, 16, 32)}
SPLIT_BATCHES = (64, 512)
FEWER_SPLITS, MORE_SPLITS = (1, 2, 4), (16, 32)
# the full cache's slots at a 4K context (``round_capacity``), as the model part runs it
FULL_4K = 4352


def split_impls(case: Case) -> list[str]:
    """The ``SPLITS`` variants timed for a dense decode case: fewer splits at the large batches,
    more at batch 1, every one in the smoke's case of 129 slots (none for other cases)."""
    if case.op != "decode" or case.slots not in (129, 1025, FULL_4K):
        return []
    if case.slots == 129:
        return list(SPLITS)
    return [
        impl
        for impl, n in SPLITS.items()
        if n in (MORE_SPLITS if case.batch == 1 else FEWER_SPLITS)
    ]


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    score: str  # a SCORE_KINDS entry, or "none": no scoring queries (the attention output alone)
    shape: str
    dtype: str
    slots: int
    batch: int

    @property
    def label(self) -> dict:
        return dataclasses.asdict(self)


def make_inputs(case: Case, seed: int, visible_all: bool = False) -> tuple:
    """Random inputs of one case (on the default device). visible_all: every slot valid and visible
    (timing)."""
    Hk, G, K = SHAPES[case.shape]
    dtype = jnp.dtype(case.dtype)
    keys = iter(jax.random.split(jax.random.key(seed), 16))

    def normal(shape):
        return jax.random.normal(next(keys), shape, jnp.float32).astype(dtype)

    if case.op == PROMPT:  # q [B, T, H, K], k and v [B, Hk, T, K]: T = slots
        B, T = case.batch, case.slots
        return (normal((B, T, Hk * G, K)), normal((B, Hk, T, K)), normal((B, Hk, T, K)))
    if case.op == EXPECTED_LOGITS:
        return expected_inputs(case, normal, keys)
    if case.op in PLACE_OPS:
        return place_inputs(case, keys)
    paged, decode, moments = OPS[case.op]
    B, S, T = case.batch, case.slots, 1 if decode else BLOCK_T
    q = normal((B, T, Hk * G, K))
    if visible_all:
        slot_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, Hk, S))
        query_pos = jnp.full((B, T), S + T, jnp.int32)
    else:
        order = jnp.argsort(jax.random.uniform(next(keys), (B, Hk, S)), axis=-1).astype(jnp.int32)
        empty = (jax.random.uniform(next(keys), (B, Hk, S)) < 0.03) | (jnp.arange(S) >= S - 5)
        slot_pos = jnp.where(empty, -1, order)
        # row 0 sees every slot by its last query; row 1's queries sit 10% lower, so some slots are
        # in its future
        last = (
            jnp.array([S, int(0.9 * S)], jnp.int32)[:B] if B <= 2 else jnp.full((B,), S, jnp.int32)
        )
        query_pos = last[:, None] - (T - 1) + jnp.arange(T, dtype=jnp.int32)[None]
    weights = None
    if case.score != "none":
        w = jnp.zeros((B, T), jnp.float32).at[:, -min(WINDOW, T) :].set(1.0)
        weights = w * jax.random.uniform(next(keys), (B, T), minval=0.5, maxval=1.5)
    mom = None
    if moments:
        count = (
            jnp.round(jax.random.uniform(next(keys), (B, Hk), minval=1, maxval=200))
            .at[0, 0]
            .set(0.0)
        )
        n = count[..., None]
        k_sum = jax.random.normal(next(keys), (B, Hk, K)) * jnp.sqrt(n)
        v_sum = jax.random.normal(next(keys), (B, Hk, K)) * jnp.sqrt(n)
        # Σ v kᵀ: the sums' outer product over n plus noise, so that the centred S̃ is the noise
        noise = jax.random.normal(next(keys), (B, Hk, K, K)) * n[..., None] / 4
        vk_sum = noise + v_sum[..., :, None] * k_sum[..., None, :] / jnp.maximum(n[..., None], 1)
        kept = (count > 0)[..., None]  # the head with nothing evicted has empty sums
        mom = Moments(
            count=count,
            k_sum=jnp.where(kept, k_sum, 0),
            v_sum=jnp.where(kept, v_sum, 0),
            vk_sum=jnp.where(kept[..., None], vk_sum, 0),
        )
    if not paged:
        k, v = normal((B, Hk, S, K)), normal((B, Hk, S, K))
        return (q, k, v, slot_pos, query_pos, weights, mom)
    M = S // PAGE
    n_pool = Hk * M + 3  # a few spare pages
    table = jnp.argsort(jax.random.uniform(next(keys), (B, n_pool)), axis=-1)[:, : Hk * M].reshape(
        B, Hk, M
    )
    if visible_all:
        n_pages = jnp.full((B, Hk), M, jnp.int32)
    else:
        n_pages = jnp.round(jax.random.uniform(next(keys), (B, Hk), minval=M / 2, maxval=M)).astype(
            jnp.int32
        )
        n_pages = n_pages.at[0, 0].set(M)
        used = jnp.arange(S) < (n_pages * PAGE)[..., None]
        slot_pos = jnp.where(used, slot_pos, -1)
    k_pages, v_pages = normal((B, n_pool, PAGE, K)), normal((B, n_pool, PAGE, K))
    return (
        q,
        k_pages,
        v_pages,
        table.astype(jnp.int32),
        n_pages,
        slot_pos,
        query_pos,
        weights,
        mom,
    )


def expected_inputs(case: Case, normal, keys) -> tuple:
    """(k, rotation, mean, qq_sum, count, pending) of ``expected_logits``: the statistics of 300
    queries (mean 0.5) in the first row, the last ``QUERY_BUFFER`` of them kept aside as a decoding
    keeps them, and of one (Σ = 0) in the others, rotated to the 512 positions after the cache."""
    Hk, G, K = SHAPES[case.shape]
    B, S = case.batch, case.slots
    count = jnp.full((B,), 1.0).at[0].set(300.0)
    q = jax.random.normal(next(keys), (B, Hk, G, 300, K)) + 0.5
    q = q * (jnp.arange(300) < count[:, None, None, None])[..., None]
    inv_freq = 500000.0 ** (-jnp.arange(0, K, 2) / K)
    rotation = rotation_matrix(*mean_rotation(inv_freq, jnp.full((B,), S), 512))
    mean = q.sum(3) / count[:, None, None, None]
    held, pending = q[:, :, :, :-QUERY_BUFFER], q[:, :, :, -QUERY_BUFFER:]
    qq_sum = jnp.einsum("bhgti,bhgtj->bhgij", held, held)
    return normal((B, Hk, S, K)), rotation, mean, qq_sum, count, pending


def place_inputs(case: Case, keys) -> tuple:
    """(state, pos, order, seen) of ``lowest_place``: uniform states (every fifth slot's equal to
    its neighbour's: ties), each head's slots shuffled by position, its last 3 empty."""
    Hk, G, _ = SHAPES[case.shape]
    B, S = case.batch, case.slots
    state = jax.random.uniform(next(keys), (B, Hk, G, S))
    state = jnp.where(jnp.arange(S) % 5 == 4, jnp.roll(state, 1, -1), state)
    order = jnp.argsort(jax.random.uniform(next(keys), (B, Hk, S)), axis=-1).astype(jnp.int32)
    rank = jnp.argsort(order, axis=-1).astype(jnp.int32)
    pos = jnp.where(rank < S - 3, rank, -1)
    return state, pos, order, jnp.full((B,), S - 3, jnp.int32)


def kernel_fn(case: Case, impl: str | None, interpret: bool, in_stack: bool = False):
    """A jitted function of the case's inputs -> (out, lse, col or None). in_stack: a dense decode
    kernel reads the case's keys and values as the middle layer of a stack of three, as the budget
    cache hands them over. The prompt's "pallas_gpu" is ``causal_attention``'s default (cuDNN on
    CUDA): it has no Pallas kernel."""
    if case.op == PROMPT:
        prompt_impl = None if impl == "pallas_gpu" else impl
        return jax.jit(lambda q, k, v: (causal_attention(q, k, v, impl=prompt_impl), None, None))
    opts = dict(impl=impl) if impl in (None, "xla") else dict(impl=impl, interpret=interpret)
    if impl == WIDE:
        opts = dict(impl="pallas_gpu", interpret=interpret, block_k=128)
    if case.op == EXPECTED_LOGITS:
        return jax.jit(lambda *args: (expected_logits(*args, **opts), None, None))
    if case.op == LOWEST_PLACE:
        return jax.jit(lambda *args: (lowest_place(*args, **PLACE_OPTIONS, **opts), None, None))
    if case.op == LOWEST_PLACES:  # out: the places; lse, col: the valid and protected counts
        picks = SHAPES[case.shape][0]

        def few(*args):
            low = lowest_places(*args, picks=picks, **PLACE_OPTIONS, **opts)
            return low.place, low.count, low.protected

        return jax.jit(few)
    paged, decode, moments = OPS[case.op]
    score = "attn" if case.score == "none" else case.score
    if impl in SPLITS:  # the dense decode kernel itself, its splits given
        kernel = functools.partial(
            decode_gpu.decode_attention_gpu, score=score, splits=SPLITS[impl], interpret=interpret
        )
        return jax.jit(lambda q, k, v, sp, qp, w, mom: kernel(q, k, v, sp, qp, w))
    if case.op == MOMENT_RESIDUALS:

        def fn(q, k, v, sp, qp, w, mom):
            stack = (jnp.stack([v, k, v]), jnp.stack([k, v, k]), jnp.int32(1))
            k, v, layer = stack if in_stack else (k, v, None)
            return moment_residual_norms(k, v, mom, layer=layer, **opts), None, None

        return jax.jit(fn)
    if case.op == DECODE_RESIDUALS:

        def fn(q, k, v, sp, qp, w, mom):
            stack = (jnp.stack([v, k, v]), jnp.stack([k, v, k]), jnp.int32(1))
            k, v, layer = stack if in_stack else (k, v, None)
            if in_stack:  # every layer's statistics, as decoding hands them over
                mom = jax.tree.map(lambda x: jnp.stack([x / 2, x, x / 2]), mom)
            *_, norms = decode_attention_with_scores(
                q, k, v, sp, qp, w, score, layer=layer, residuals=(mom, False), **opts
            )
            return norms, None, None

        return jax.jit(fn)
    if not paged:
        if decode and in_stack:

            def fn(q, k, v, sp, qp, w, mom):
                return decode_attention_with_scores(
                    q,
                    jnp.stack([v, k, v]),
                    jnp.stack([k, v, k]),
                    sp,
                    qp,
                    w,
                    score,
                    mom,
                    moments == "zeroth",
                    layer=jnp.int32(1),
                    **opts,
                )
        elif decode:

            def fn(q, k, v, sp, qp, w, mom):
                return decode_attention_with_scores(
                    q, k, v, sp, qp, w, score, mom, moments == "zeroth", **opts
                )
        else:

            def fn(q, k, v, sp, qp, w, mom):
                return block_attention_with_scores(q, k, v, sp, qp, w, score, **opts)
    elif decode:

        def fn(q, kp, vp, table, n, sp, qp, w, mom):
            return paged_decode_attention_with_scores(
                q, kp, vp, table, n, sp, qp, w, score, mom, moments == "zeroth", **opts
            )
    else:

        def fn(q, kp, vp, table, n, sp, qp, w, mom):
            return paged_block_attention_with_scores(q, kp, vp, table, n, sp, qp, w, score, **opts)

    return jax.jit(fn)


def to_f32(args):
    """The inputs (arrays or ShapeDtypeStructs) with every floating leaf in float32."""

    def cast(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, jnp.float32)
        return x.astype(jnp.float32)

    return jax.tree.map(cast, args)


def check_cases(smoke: bool, slots: int, ops: tuple[str, ...] | None = None) -> list[Case]:
    """Every kernel, score kind, head geometry and dtype at ``slots``, then the prompt attention
    (smoke: SmolLM2's heads, two score kinds, bfloat16). ops: only these (of OPS and PROMPT; None:
    all)."""
    shapes = ("smollm2",) if smoke else tuple(SHAPES)
    cases = []
    for op, (paged, _, moments) in OPS.items():
        scores = ("attn",) if moments else ("attn", "obcache-joint") if smoke else SCORE_KINDS
        for score in scores:
            for shape in shapes:
                for dtype in ("bfloat16",) if smoke else ("float32", "bfloat16"):
                    cases.append(
                        Case(
                            op,
                            score,
                            shape,
                            dtype,
                            slots if not paged else -(-slots // PAGE) * PAGE,
                            2,
                        )
                    )
    cases += [Case(PROMPT, "none", shape, "bfloat16", slots, 2) for shape in shapes]
    cases += [Case(op, "attn", shape, "float32", slots, 16) for shape in shapes for op in PLACE_OPS]
    return [c for c in cases if ops is None or c.op in ops]


def timing_cases(smoke: bool) -> list[Case]:
    """Llama-3.1-8B's heads at batch 4 (smoke: SmolLM2's at batch 1, whose interpreted kernels run
    ~10x faster)."""
    lengths = (128,) if smoke else (1024, 4096, 32768)
    scores = ("none", "attn") if smoke else ("none", "attn", "obcache-joint")
    ops = ("block", "decode", "paged_block", "paged_decode")
    shape, batch = ("smollm2", 1) if smoke else ("llama8b", 4)
    return (
        [
            Case(op, score, shape, "bfloat16", slots, batch)
            for slots in lengths
            for op in ops
            for score in scores
        ]
        + [  # the decoding evictions' kernels (their "attn" is nominal: they score no attention)
            Case(op, "attn", shape, "bfloat16", slots, batch)
            for slots in lengths
            for op in (MOMENT_RESIDUALS, DECODE_RESIDUALS, EXPECTED_LOGITS)
        ]
        + [  # the dense decode kernel at large batches (budget 1024 + the new token), by splits
            Case("decode", "attn", shape, "bfloat16", 129 if smoke else 1025, b)
            for b in ((1,) if smoke else SPLIT_BATCHES)
        ]
        + (
            []
            if smoke
            else [  # and at batch 1: the full cache at 4K (no scores), SnapKV 1024
                Case("decode", "none", shape, "bfloat16", FULL_4K, 1),
                Case("decode", "attn", shape, "bfloat16", 1025, 1),
            ]
        )
        + [  # a decoding step's eviction of every layer: budget 1024 + the new token
            Case(LOWEST_PLACE, "attn", shape, "float32", 129 if smoke else 1025, rows)
            for rows in ((1,) if smoke else (PLACE_LAYERS, 64 * PLACE_LAYERS))
        ]
        + [  # the paged cache's (AdaKV 1024) at batch 64
            Case(LOWEST_PLACES, "attn", shape, "float32", 129 if smoke else PLACES_CAPACITY, rows)
            for rows in ((1,) if smoke else (64 * PLACE_LAYERS,))
        ]
    )


def submit_checks(
    compiler: Compiler,
    smoke: bool,
    slots: int,
    f32_precision: str | None = None,
    ops: tuple[str, ...] | None = None,
) -> dict:
    """Compilations of the checks at ``slots``: per case the kernel (and, for bfloat16, the XLA
    reference in bfloat16), and the float32 reference, one per (op, score, shape): shared by both
    dtypes. No autotuning: these programs run once, for their values. f32_precision: the matmul
    precision the float32 kernels are traced under (None: JAX's default, which Pallas' Triton
    lowering runs as TF32 dots)."""
    futures, opts = {}, {"xla_gpu_autotune_level": 0}
    for c in check_cases(smoke, slots, ops):
        ref_case = dataclasses.replace(c, dtype="float32")
        args = jax.eval_shape(lambda c=c: make_inputs(c, 0))
        if ref_case not in futures:
            futures[ref_case] = compiler.submit(
                kernel_fn(ref_case, "xla", False), *to_f32(args), precision="highest", options=opts
            )
        precision = f32_precision if c.dtype == "float32" else None
        futures[c, "kernel"] = compiler.submit(
            kernel_fn(c, "pallas_gpu", smoke, in_stack=True),
            *args,
            options=opts,
            precision=precision,
        )
        if c.dtype == "bfloat16":
            futures[c, "xla"] = compiler.submit(kernel_fn(c, "xla", False), *args, options=opts)
    return futures


def run_checks(
    results: Results,
    deadline: Deadline,
    futures: dict,
    smoke: bool,
    slots: int,
    ops: tuple[str, ...] | None = None,
) -> None:
    done = []
    for i, c in enumerate(check_cases(smoke, slots, ops)):
        if deadline.passed():
            results.add(
                "kernel_checks", {**c.label, "error": "not run: the part's deadline passed"}
            )
            continue

        def check(c=c, i=i):
            args = make_inputs(c, 1000 + i)  # fresh inputs per case
            wait = max(1.0, deadline.left())
            ref_fn, _ = futures[dataclasses.replace(c, dtype="float32")].result(timeout=wait)
            ref = jax.device_get(ref_fn(*to_f32(args)))
            row = {}
            for which in ("kernel", "xla") if c.dtype == "bfloat16" else ("kernel",):
                fn, compile_s = futures[c, which].result(timeout=wait)
                got = jax.device_get(fn(*args))
                for name, x, r in zip(("out", "lse", "col"), got, ref):
                    if x is not None and r is not None:
                        row[f"{which}_{name}_err"] = rel_error(x, r)
                row[f"{which}_compile_s"] = compile_s
            if c.op == PROMPT:
                row["attention"] = prompt_attention(futures[c, "kernel"].result()[0])
            errs = [row[k] for k in row if k.startswith("kernel_") and k.endswith("_err")]
            row["max_err"] = max(errs) if not any(math.isnan(e) for e in errs) else float("nan")
            row["tol"] = 0.0 if c.op in PLACE_OPS else TOL[c.dtype]  # places: exact
            row["ok"] = bool(row["max_err"] <= row["tol"])
            return row

        row = guarded(results, "kernel_checks", c.label, check)
        if row is not None:
            done.append(row["ok"])
            if not row["ok"]:
                log(f"kernel check FAILED {c}: {row}")
    log(f"kernel checks at {slots} slots: {sum(done)} of {len(done)} within tolerance")


def cudnn_fn(smoke: bool):
    """jax.nn.dot_product_attention on the kernels' inputs pre-transposed to its [B, S, N, K]
    layout."""
    impl = None if smoke else "cudnn"
    return jax.jit(functools.partial(jax.nn.dot_product_attention, implementation=impl))


def submit_timings(compiler: Compiler, smoke: bool) -> dict:
    """Compilations of every timed program, keyed by (case, impl)."""
    futures = {}
    for c in timing_cases(smoke):
        args = jax.eval_shape(lambda c=c: make_inputs(c, 0, visible_all=True))
        futures[c, "pallas_gpu"] = compiler.submit(kernel_fn(c, "pallas_gpu", smoke), *args)
        futures[c, "xla"] = compiler.submit(kernel_fn(c, "xla", False), *args)
        if c.op in WIDE_OPS:
            futures[c, WIDE] = compiler.submit(kernel_fn(c, WIDE, smoke), *args)
        for impl in split_impls(c):
            futures[c, impl] = compiler.submit(kernel_fn(c, impl, smoke), *args)
        if c.score == "none" and not OPS[c.op][0]:
            q, k = args[0], args[1]
            kt = jax.ShapeDtypeStruct((k.shape[0], k.shape[2], k.shape[1], k.shape[3]), k.dtype)
            futures[c, "cudnn"] = compiler.submit(cudnn_fn(smoke), q, kt, kt)
    return futures


def run_timings(results: Results, deadline: Deadline, futures: dict, smoke: bool) -> None:
    for c in timing_cases(smoke):
        Hk, G, K = SHAPES[c.shape]
        kv_bytes = (
            (1 if c.op == EXPECTED_LOGITS else 2)  # the expected logits read the keys alone
            * c.batch
            * Hk
            * c.slots
            * K
            * jnp.dtype(c.dtype).itemsize
        )
        if c.op in PLACE_OPS:  # the state, positions and order
            kv_bytes = c.batch * Hk * c.slots * (4 * G + 8)
        n_sets = 1 if kv_bytes > L2_BYTES else 3
        sets = None
        for impl in ("pallas_gpu", WIDE, *SPLITS, "xla", "cudnn"):
            if (c, impl) not in futures:
                continue
            if deadline.passed():
                results.add(
                    "kernel_times",
                    {**c.label, "impl": impl, "error": "not run: the part's deadline passed"},
                )
                continue

            def time_it(c=c, impl=impl):
                nonlocal sets
                if sets is None:
                    sets = [make_inputs(c, 7 + j, visible_all=True) for j in range(n_sets)]
                fn, compile_s = futures[c, impl].result(timeout=max(1.0, deadline.left()))
                if impl == "cudnn":
                    calls = [
                        (s[0], jnp.swapaxes(s[1], 1, 2), jnp.swapaxes(s[2], 1, 2)) for s in sets
                    ]
                else:
                    calls = sets
                rotation = itertools.cycle(calls)
                seconds = median_seconds(lambda: fn(*next(rotation)), 2 if smoke else 5)
                return {
                    "ms": 1e3 * seconds,
                    "kv_gb_s": kv_bytes / seconds / 1e9,
                    "compile_s": compile_s,
                }

            guarded(results, "kernel_times", {**c.label, "impl": impl}, time_it)
        del sets


def run(
    results: Results,
    deadline: Deadline,
    compiler: Compiler,
    smoke: bool,
    timings: bool = True,
    f32_precision: str | None = None,
    ops: tuple[str, ...] | None = None,
) -> None:
    """Checks at the first length, then the timings, then checks at the other lengths while time is
    left.
    ops: check only these (None: every kernel and the prompt attention)."""
    lengths = (100,) if smoke else (1061, 32768, 4096)
    results.meta["f32_precision"] = f32_precision or "default"
    checks = submit_checks(compiler, smoke, lengths[0], f32_precision, ops)
    if timings:
        futures = submit_timings(compiler, smoke)  # compiled while the first checks run
        run_checks(results, Deadline(deadline.left() * 0.4), checks, smoke, lengths[0], ops)
        run_timings(results, Deadline(deadline.left() * 0.6), futures, smoke)
        compiler.cancel_pending()
    else:
        run_checks(results, Deadline(deadline.left() * 0.6), checks, smoke, lengths[0], ops)
    for slots in lengths[1:]:
        run_checks(
            results,
            deadline,
            submit_checks(compiler, smoke, slots, f32_precision, ops),
            smoke,
            slots,
            ops,
        )
        compiler.cancel_pending()


def tables(results: Results) -> list[str]:
    lines = []
    checks = results.rows("kernel_checks")
    if checks:
        lines += [
            "### Kernels against the float32 reference (relative error, largest of out / lse / "
            "col)",
            "",
            "| op | score | heads | dtype | slots | kernel max err | tol | ok | XLA-in-dtype max "
            "err "
            "| compile s |",
            "| --- | --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: |",
        ]
        for r in checks:
            if "error" in r:
                state = "not run" if r["error"].startswith("not run") else "FAILED"
                lines.append(
                    f"| {r['op']} | {r['score']} | {r['shape']} | {r['dtype']} | {r['slots']} | "
                    f"{r['error'][:160]} | | {state} | | |"
                )
                continue
            xla = max(
                (v for k, v in r.items() if k.startswith("xla_") and k.endswith("_err")),
                default=None,
            )
            op = f"{r['op']} ({r['attention']})" if "attention" in r else r["op"]
            lines.append(
                f"| {op} | {r['score']} | {r['shape']} | {r['dtype']} | {r['slots']} | "
                f"{r['max_err']:.2e} | {r['tol']:.0e} | {'yes' if r['ok'] else 'NO'} | "
                f"{'' if xla is None else f'{xla:.2e}'} | "
                f"{r['kernel_compile_s']:.1f} |"
            )
        lines.append("")
    times = results.rows("kernel_times")
    if times:
        heads = {"llama8b": "Llama-3.1-8B", "smollm2": "SmolLM2"}[times[0]["shape"]]
        lines += [
            f"### Kernel times ({heads} heads, bfloat16, every slot visible)",
            "",
            "| op | score | slots | batch | Pallas (Triton) ms | Pallas, 128-slot tiles ms "
            "| XLA ms | cuDNN ms | XLA / Pallas "
            "| K+V GB/s (Pallas; K alone for expected_logits; state, positions and order for "
            "lowest_place(s)) |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        by = {}
        for r in times:
            by.setdefault((r["op"], r["score"], r["slots"], r["batch"]), {})[r["impl"]] = r
        for (op, score, slots, batch), impls in by.items():

            def cell(i, impls=impls):
                if i in impls and "ms" in impls[i]:
                    return f"{impls[i]['ms']:.3f}"
                return "error" if i in impls else ""

            p, x = impls.get("pallas_gpu", {}), impls.get("xla", {})
            ratio = f"{x['ms'] / p['ms']:.2f}" if "ms" in p and "ms" in x else ""
            lines.append(
                f"| {op} | {score} | {slots} | {batch} | {cell('pallas_gpu')} | {cell(WIDE)} | "
                f"{cell('xla')} | {cell('cudnn')} | {ratio} "
                f"| {p.get('kv_gb_s', float('nan')):.0f} |"
            )
        split_rows = [(key, impls) for key, impls in by.items() if set(impls) & set(SPLITS)]
        if split_rows:
            lines += [
                "",
                "The dense decode kernel by flash-decoding splits (ms; default: "
                "`gpu_common.decode_splits`):",
                "",
                "| slots | batch | default | "
                + " | ".join(f"{n} splits" for n in SPLITS.values())
                + " |",
                "| ---: | ---: | ---: | " + " | ".join("---:" for _ in SPLITS) + " |",
            ]
            for (op, score, slots, batch), impls in split_rows:
                cells = " | ".join(
                    f"{impls[i]['ms']:.3f}" if "ms" in impls.get(i, {}) else "" for i in SPLITS
                )
                default = impls.get("pallas_gpu", {})
                first = f"{default['ms']:.3f}" if "ms" in default else ""
                lines.append(f"| {slots} | {batch} | {first} | {cells} |")
        errors = [r for r in times if "error" in r]
        for r in errors:
            lines.append(f"\n- {r['op']} {r['score']} {r['slots']} {r['impl']}: {r['error'][:300]}")
        lines.append("")
    return lines
