"""Part "model": an 8B-shaped Llama (Llama-3.1-8B's shapes, random bfloat16 weights from
``kvjax.init_params``) end to end, in the default ``impl`` (the Pallas kernels on a GPU) and, for
SnapKV, in ``impl="xla"``.

Prefill: tokens/s of one 4K- and one 32K-token prompt (random ids) into the full cache and
block-wise (blocks of 128, evicting after each) into budgets of 1024 and 256 (SnapKV; AdaKV on the
paged cache). The first call of each compiled program is its warm-up; the figure is the median of
the timed calls after it. The full cache's prompt attention is ``kvjax.kernels.causal_attention``:
cuDNN's flash attention by default on a GPU, XLA's chunked form with impl "xla" (both rows run; each
row says which its compiled program holds, and the "xla" row's output is compared with the
default's: the relative error of the last layer's keys and of the first sampled logits). Should the
default full prefill fail, the "xla" one makes the full cache's decode rows' state.

Decode: ms per step of ``kvjax.runtime.decoding.decode_steps`` (the loop ``kvjax.generate`` runs:
greedy sampling, every step evicting one token per row and KV head) at batch 1, 8, 32 and 64, from
the prefilled state of one prompt repeated over the batch (every row holds the same cache; the
prefill above made it). MomentKV decodes from SnapKV's prefilled cache (the same layout; its moment
sums start empty): its step is what is timed. Expected Attention 1024 prefills at 4K and decodes at
batch 1 and 64; at batch 64 SnapKV, MomentKV, AdaKV and Expected Attention 1024 also evict every
``EVERY`` steps (``evict_every``: labelled "… every 16", the state given budget + 16 slots). (Call
3's rows of the default compiled with Triton GEMM fusions and of ``kvjax.unstack_layers`` answered
their questions and are gone: layers_part and aot.py still compile both.) JAX's profiler traces 4
more steps of a few rows (``ModelRun.profiled``): their device time by kind of op. Beside each
figure its floor: the bytes a step must read (every weight but the embedding table, plus the kept
keys and values of every row) over the copy bandwidth measured in the same run (``floor_ms``: reads
and writes counted, the conservative one) and over the read bandwidth measured beside it
(``read_floor_ms``). Every row's attention is the kernels' unless ``common.decode_attention`` finds
the decode kernel failing on the device (then XLA's, said in the report's head). The largest batch
that fits at 32K is found from two compiled programs' memory figures (batch 1 and 8: the state and
temporaries one more row adds, and the temporaries that do not grow) against the allocator's free
bytes (or its largest free block), then run (10% smaller, once, if it does not). Those searches run
last, with the prefilled states moved to the host (``ModelRun.decode``).

Every program is compiled in the background first; timed runs wait for the compilations (XLA
autotunes on the device while it compiles) for at most a third of the part's time.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import (
    KINDS,
    Ceilings,
    Compiler,
    Deadline,
    Results,
    copied_bytes,
    decode_attention,
    device_profile,
    error_text,
    floors,
    guarded,
    log,
    loop_copies,
    memory_stats,
    prompt_attention,
    rel_error,
)
from kvjax.kernels.quantized import bytes_per_token, kind_of
from word_pieces import WordPieces

import kvjax
from kvjax.cache.full import cache_bytes
from kvjax.eviction.moments import Moments
from kvjax.model.config import ModelConfig
from kvjax.runtime.decoding import (
    DecodeState,
    decode_steps,
    feed_budget,
    feed_full,
)
from kvjax.runtime.inputs import round_capacity
from kvjax.runtime.options import eviction_from
from kvjax.runtime.sampling import Sampling
from kvjax.serving.engine import map_rows

LLAMA_8B = ModelConfig(
    arch="llama",
    vocab_size=128256,
    d_model=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    d_ff=14336,
    max_seq_len=131072,
    rope_theta=500000.0,
    rope_type="llama3",
    rope_scaling=(
        ("factor", 8.0),
        ("high_freq_factor", 4.0),
        ("low_freq_factor", 1.0),
        ("original_max_position_embeddings", 8192),
    ),
    norm_eps=1e-5,
    bos_token_id=128000,
    eos_token_ids=(128001, 128008, 128009),
    pad_token_id=128001,
)
TINY = dataclasses.replace(
    LLAMA_8B,
    vocab_size=512,
    d_model=128,
    n_layers=2,
    n_heads=8,
    n_kv_heads=2,
    head_dim=16,
    d_ff=256,
    max_seq_len=4096,
)
OUT_WIDTH = 256  # decode steps a state has room for
PROFILE_STEPS = 4  # decode steps traced by the profiler
PROFILE_TOP = 24  # op names kept per profiled row, with their ms per step (to match aot.py --hlo)
# seconds kept for the two largest-batch searches at 32K (each compiles and runs one program)
SEARCH_S = 60
NEW = 64  # max_new_tokens of the prefills (room in the full cache after the prompt)


@dataclasses.dataclass(frozen=True)
class Sizes:
    cfg: ModelConfig
    contexts: tuple[int, int]  # "4K", "32K"
    budgets: tuple[int, int]  # "1024", "256"
    batches: tuple[int, ...]
    steps: int
    margin: int  # bytes left free when sizing the largest batch

    @property
    def probe(self) -> int:
        """The batch whose compiled program sizes the largest batch (the largest run at 32K with the
        full cache)."""
        return max(b for b in self.batches if b <= 8)


def sizes(smoke: bool) -> Sizes:
    if smoke:
        return Sizes(TINY, (256, 512), (64, 48), (1, 2), 2, 0)
    return Sizes(LLAMA_8B, (4096, 32768), (1024, 256), (1, 8, 32, 64), 16, 3 << 30)


# (scorer or "full", index into Sizes.budgets or None, kv_dtype or None[, options]): options, a
# tuple of (eviction keyword, value) pairs, OPTION_LABELS' keywords
Cache = tuple
OPTION_LABELS = {"block_size": "block", "evict_every": "every"}
FULL: Cache = ("full", None, None)
# quantized keys and values (issue 58): the full cache and SnapKV 1024 in 8 bits
QUANTIZED = ("int8", "float8_e4m3fn")
FULL_Q = tuple(("full", None, kv) for kv in QUANTIZED)
# compressed by kvjax.prefill at the first budget, beside kvpress's presses (issue 59)
COMPRESSORS = ("kvzip", "expected-attention")
# block-wise prefill in blocks larger than CAOTE's 128 (issue 59: the weights are read once a block,
# so 128-token blocks bound the prefill near 28K tokens/s on the 8B); the kept sets change with the
# block size (docs/eviction.md)
BLOCKS = (512, 2048)
# periodic eviction (``evict_every``, issue 59): each row evicts once every EVERY decode steps, down
# to the budget, from budget + EVERY slots: the eviction's cost spread over EVERY steps
EVERY = 16
SNAP_Q = tuple(("snapkv", 0, kv) for kv in QUANTIZED)
# Expected Attention at the first budget and the shorter context (issue 59: decoding at batch 64)
EXPECTED: Cache = ("expected-attention", 0, None)


def eviction(cache: Cache, sz: Sizes, context: int, attention: str | None):
    """The Eviction of a cache (None for the full cache) whose attention is ``attention``
    (``ModelRun.attention``)."""
    scorer, which, kv_dtype, *options = cache
    if scorer == "full":
        return None
    return eviction_from(
        context=context,
        budget=sz.budgets[which],
        scorer=scorer,
        impl=attention,
        kv_dtype=kv_dtype,
        **dict(options[0] if options else ()),
    )


def with_options(cache: Cache, **options) -> Cache:
    return (*cache[:3], tuple(options.items()))


def cache_label(cache: Cache, sz: Sizes) -> str:
    name = "full" if cache[0] == "full" else f"{cache[0]} {sz.budgets[cache[1]]}"
    name = name if cache[2] is None else f"{name} {cache[2]}"
    options = cache[3] if len(cache) > 3 else ()
    return " ".join([name, *(f"{OPTION_LABELS[k]} {v}" for k, v in options)])


def prompt(context: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(context).integers(10, vocab - 10, (1, context), dtype=np.int32)


@functools.partial(jax.jit, static_argnames=("batch", "moment_dims"))
def tile_state(
    state: DecodeState, batch: int, moment_dims: tuple[int, int] | None = None
) -> DecodeState:
    """One prefilled row repeated ``batch`` times along every leaf's batch axis; ``moment_dims``:
    the widths of the moments' sums the decoding needs (``Moments.dims``; MomentKV decodes from
    SnapKV's prefill, which keeps none: its sums start at zero, which costs what any others
    would)."""
    cache = map_rows(lambda x, ax: jnp.repeat(x, batch, axis=ax), state.cache)
    if moment_dims is not None and moment_dims != cache.moments.dims:
        count = cache.moments.count
        cache = cache.replace(moments=Moments.zeros(count.shape, moment_dims).replace(count=count))
    rep = lambda x: jnp.repeat(x, batch, axis=0)  # noqa: E731
    return DecodeState(
        cache=cache,
        out=rep(state.out),
        lengths=rep(state.lengths),
        n_new=rep(state.n_new),
        done=rep(state.done),
        logits=rep(state.logits),
        key=state.key,
        step=state.step,
    )


@functools.partial(jax.jit, static_argnames=("ev", "cfg"))
def refit(state: DecodeState, ev, cfg: ModelConfig) -> DecodeState:
    """The state with room for ``ev``'s decoding (a periodic eviction's spare slots)."""
    return state.replace(cache=ev.fit(state.cache, cfg, ev.decode_spare(OUT_WIDTH)))


def step_weight_bytes(params) -> int:
    """The weights one decode step reads (arrays or ShapeDtypeStructs): every weight but the
    embedding table, of which it gathers a row per sequence."""
    embed = params.embed
    leaves = jax.tree.leaves(params)
    return sum(x.size * x.dtype.itemsize for x in leaves) - embed.size * embed.dtype.itemsize


def kept_kv_bytes(state: DecodeState, cfg: ModelConfig) -> int:
    """Keys and values a decode step must read, their scales included: every row's context (full
    cache) or kept tokens (budget caches)."""
    k = state.cache.kv[0]
    # one (layer, row, KV head) token's key and value (a quantized cache's codes and scales)
    per_token = bytes_per_token(cfg.head_dim, 2, kind_of(k))
    if hasattr(state.cache, "pos"):  # BudgetCache and PagedCache: the valid slots
        return int(jnp.sum(state.cache.pos >= 0)) * per_token
    return int(jnp.sum(state.lengths)) * cfg.n_layers * cfg.n_kv_heads * per_token


class ModelRun:
    """The 8B-shaped model's weights and the measurements made with them."""

    def __init__(
        self,
        results: Results,
        deadline: Deadline,
        compiler: Compiler,
        ceilings: Ceilings,
        smoke: bool,
    ):
        self.results, self.deadline, self.compiler, self.ceilings, self.smoke = (
            results,
            deadline,
            compiler,
            ceilings,
            smoke,
        )
        self.sz = sizes(smoke)
        log(
            f"model: random bfloat16 weights of {self.sz.cfg.n_layers} layers, d_model "
            f"{self.sz.cfg.d_model}"
        )
        self.params = jax.block_until_ready(
            jax.jit(kvjax.init_params, static_argnums=(0, 2))(
                self.sz.cfg, jax.random.key(0), jnp.bfloat16
            )
        )
        self.weight_bytes = step_weight_bytes(self.params)
        self.states: dict[tuple[Cache, int], DecodeState] = {}
        self.kernels, results.meta["decode_attention"] = decode_attention()
        log(f"model: {results.meta['decode_attention']}")
        results.meta["model"] = {
            "config": dataclasses.asdict(self.sz.cfg),
            "weight_bytes_read_per_step": self.weight_bytes,
            "memory_after_weights": memory_stats(),
        }

    def attention(self, impl: str | None) -> str | None:
        """The attention impl of a row: "xla" for impl "xla", else the kernels (or "xla" if
        ``decode_attention`` found them failing)."""
        return "xla" if impl == "xla" else self.kernels

    # --- prefill -------------------------------------------------------------------------------

    def prefill_program(self, cache: Cache, context: int, impl: str | None) -> tuple:
        """(jitted prefill, abstract arguments, static keywords) of one prompt of ``context``
        tokens."""
        tokens = jax.ShapeDtypeStruct((1, context), jnp.int32)
        lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
        key = jax.eval_shape(lambda: jax.random.key(0))
        ev = eviction(cache, self.sz, context, self.attention(impl))
        if ev is None:
            static = dict(
                capacity=round_capacity(context + NEW),
                out_width=OUT_WIDTH,
                impl=self.attention(impl),
                kv_dtype=cache[2],
            )
            return feed_full, (self.params, tokens, lengths, key), static
        return (
            feed_budget,
            (self.params, None, tokens, lengths, lengths, key),
            dict(ev=ev, out_width=OUT_WIDTH, decode_spare=ev.decode_spare(OUT_WIDTH)),
        )

    def call_prefill(self, compiled, cache: Cache, context: int, params) -> DecodeState:
        ids = jnp.asarray(prompt(context, self.sz.cfg.vocab_size))
        lengths = jnp.full((1,), context, jnp.int32)
        if cache[0] == "full":
            return compiled(params, ids, lengths, jax.random.key(0))
        return compiled(params, None, ids, jnp.zeros((1,), jnp.int32), lengths, jax.random.key(0))

    def prefill_plan(self) -> list[tuple[Cache, int, str | None]]:
        """(cache, context, impl) in priority order; the decode states come from the default-impl
        prefills."""
        c4, c32 = self.sz.contexts
        snap, snap_lo, ada, ada_lo = (
            ("snapkv", 0, None),
            ("snapkv", 1, None),
            ("adakv", 0, None),
            ("adakv", 1, None),
        )
        plan = [
            (FULL, c4, None),
            (FULL, c4, "xla"),
            (snap, c4, None),
            (snap, c4, "xla"),
            (FULL, c32, None),
            (FULL, c32, "xla"),
            (snap, c32, None),
            (snap, c32, "xla"),
            (ada, c4, None),
            (snap_lo, c4, None),
            (ada, c32, None),
            (snap_lo, c32, None),
            (ada_lo, c4, None),
            (ada_lo, c32, None),
            (EXPECTED, c4, None),
            *((q, c, None) for q in FULL_Q + SNAP_Q for c in (c4, c32)),
            *((with_options(snap, block_size=b), c, None) for b in BLOCKS for c in (c32, c4)),
        ]
        # one budget, one impl="xla" (on CPU the default is XLA), AdaKV at the shorter context:
        if self.smoke:
            # the same paths
            keep = lambda p: p[2] != "xla" or p == (FULL, c4, "xla")  # noqa: E731
            plan = [p for p in plan if p[0][1] != 1 and keep(p) and p != (ada, c32, None)]
            # feed_budget takes whole blocks (the public API pads a prompt to them): 512 of 512
            block = with_options(snap, block_size=512)
            plan = [p for p in plan if len(p[0]) < 4 or p[:2] == (block, c32)]
        return plan

    def prefill(self, futures: dict) -> None:
        for cache, context, impl in self.prefill_plan():
            label = {
                "cache": cache_label(cache, self.sz),
                "context": context,
                "impl": impl or "default",
            }
            if self.deadline.passed():
                self.results.add(
                    "prefill", {**label, "error": "not run: the part's deadline passed"}
                )
                continue
            guarded(
                self.results,
                "prefill",
                label,
                functools.partial(
                    self.prefill_row, futures[cache, context, impl], cache, context, impl
                ),
            )

    def prefill_row(self, future, cache: Cache, context: int, impl: str | None) -> dict:
        compiled, compile_s = future.result(timeout=max(1.0, self.deadline.left()))
        times = []
        for _ in range(2 if context >= 16384 else 3):
            t0 = time.perf_counter()
            state = jax.block_until_ready(self.call_prefill(compiled, cache, context, self.params))
            times.append(time.perf_counter() - t0)
        extra = {}
        if cache[0] == "full":
            extra["prompt_attention"] = prompt_attention(compiled)
        if impl is None and len(cache) < 4:  # no decode starts from a larger block's state
            self.states[cache, context] = state
        elif cache == FULL and impl == "xla":
            default = self.states.get((cache, context))
            # the default failed: decode from this one, as the default's program expects
            if default is None:
                self.states[cache, context] = state.replace(
                    cache=state.cache.replace(impl=self.attention(None))
                )
            else:
                extra["vs_default"] = {
                    "last_layer_k": rel_error(state.cache.k[-1], default.cache.k[-1]),
                    "logits": rel_error(state.logits, default.logits),
                }
        seconds = float(np.median(times[1:]))
        return {
            **extra,
            "tokens_per_s": context / seconds,
            "seconds": seconds,
            "first_call_s": times[0],
            "compile_s": compile_s,
            "kv_bytes_allocated": cache_bytes(state.cache, kv_only=True),
        }

    # --- compression by the prefill protocol (beside kvpress's presses) -----------------------

    def compress(self) -> None:
        """``kvjax.prefill`` (the prefill protocol: the whole prompt, its scoring, the cut to the
        budget) with each of ``COMPRESSORS`` at the first budget, at both contexts: the rows the
        report puts beside kvpress's ``KVzipPress()`` and ``ExpectedAttentionPress`` (part
        "kvpress")."""
        budget = self.sz.budgets[0]
        for context in self.sz.contexts:
            for scorer in COMPRESSORS:
                label = {"scorer": scorer, "budget": budget, "context": context}
                if self.deadline.passed():
                    self.results.add(
                        "compress", {**label, "error": "not run: the part's deadline passed"}
                    )
                    continue
                guarded(
                    self.results,
                    "compress",
                    label,
                    functools.partial(self.compress_row, scorer, budget, context),
                )

    def compress_row(self, scorer: str, budget: int, context: int) -> dict:
        """The first call (its compilations included), then the median of the next one or two.
        KVzip's repeat prompt: kvpress's wording in ``word_pieces.WordPieces`` (no tokenizer with
        random weights), the stand-in the kvpress part gives ``KVzipPress``."""
        ids = prompt(context, self.sz.cfg.vocab_size)[0]
        options = {"budget": budget, "scorer": scorer}
        if scorer == "kvzip":
            options["repeat_prompt"] = kvjax.kvzip_prompt(WordPieces(self.sz.cfg.vocab_size))
        times = []
        for _ in range(2 if context >= 16384 else 3):
            t0 = time.perf_counter()
            compressed = kvjax.prefill(self.params, ids, **options)
            jax.block_until_ready(compressed.logits)
            times.append(time.perf_counter() - t0)
        cfg = self.sz.cfg
        kept = int(jnp.sum(compressed.cache.pos >= 0)) / (cfg.n_layers * cfg.n_kv_heads)
        seconds = float(np.median(times[1:]))
        return {
            "seconds": seconds,
            "tokens_per_s": context / seconds,
            "first_call_s": times[0],
            "kept_per_head": kept,
        }

    # --- decode --------------------------------------------------------------------------------

    def submit_decode(self, state_shape, ev):
        n = jax.ShapeDtypeStruct((), jnp.int32)
        return self.compiler.submit(
            decode_steps,
            self.params,
            state_shape,
            n,
            n,
            Sampling(),
            (),
            None if ev is None else ev.decoding(),
        )

    def time_decode(self, compiled, state: DecodeState, params) -> tuple[float, DecodeState]:
        """(seconds per step over ``steps`` steps after a 2-step warm-up, the state after them)."""
        first = int(state.step)
        state = jax.block_until_ready(
            compiled(params, state, jnp.int32(1 << 20), jnp.int32(first + 2))
        )
        t0 = time.perf_counter()
        state = compiled(params, state, jnp.int32(1 << 20), jnp.int32(first + 2 + self.sz.steps))
        jax.block_until_ready(state.logits)
        seconds = (time.perf_counter() - t0) / self.sz.steps
        if int(state.step) != first + 2 + self.sz.steps or bool(jnp.any(state.done)):
            raise RuntimeError(
                f"the decode loop stopped early: step {int(state.step)}, "
                f"{int(jnp.sum(state.done))} rows done"
            )
        return seconds, state

    def decode_row(
        self,
        future,
        source: DecodeState,
        batch: int,
        profile: bool = False,
        moment_dims: tuple[int, int] | None = None,
        periodic=None,
    ) -> dict:
        """The timed row; with ``profile``, also where the device time of PROFILE_STEPS more steps
        goes; ``periodic``: the Eviction of a periodic eviction, whose spare slots the source's
        state is given."""
        compiled, compile_s = future.result(timeout=max(1.0, self.deadline.left()))
        params = self.params
        state = tile_state(source, batch, moment_dims)
        if periodic is not None:
            state = refit(state, periodic, self.sz.cfg)
        seconds, state = self.time_decode(compiled, state, params)
        kept = kept_kv_bytes(state, self.sz.cfg)
        floor = floors(self.ceilings, self.weight_bytes + kept)
        mem = compiled.memory_analysis()
        extra = {}
        if profile:
            box, stop = {"state": state}, int(state.step) + PROFILE_STEPS

            def steps():
                box["state"] = compiled(params, box["state"], jnp.int32(1 << 20), jnp.int32(stop))
                return box["state"].logits

            try:
                extra["profile"] = device_profile(steps, PROFILE_STEPS, top=PROFILE_TOP)
            except Exception as e:  # noqa: BLE001 - the timing stands without its profile
                extra["profile"] = {"error": error_text(e)}
        return {
            **extra,
            "ms_per_step": 1e3 * seconds,
            "tokens_per_s": batch / seconds,
            "floor_ms": 1e3 * floor["floor_s"],
            "step_over_floor": seconds / floor["floor_s"],
            "read_floor_ms": 1e3 * floor["read_floor_s"],
            "step_over_read_floor": seconds / floor["read_floor_s"],
            "kv_bytes_allocated": cache_bytes(state.cache, kv_only=True),
            "kv_bytes_kept": kept,
            "compile_s": compile_s,
            "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
            # what XLA copies in the loops of a step (the layer scan), each loop's copies times its
            # trips
            "layer_scan_copy_bytes": copied_bytes(loop_copies(compiled.as_text())),
        }

    def decode_plan(self) -> list[tuple]:
        """(cache, impl, source prefill, batch, contexts) in priority order: one program each."""
        sz = self.sz
        c4, c32 = sz.contexts
        plan = [
            (FULL, None, FULL),
            (("snapkv", 0, None), None, ("snapkv", 0, None)),
            (("snapkv", 0, None), "xla", ("snapkv", 0, None)),
            (("momentkv", 0, None), None, ("snapkv", 0, None)),
            (("adakv", 0, None), None, ("adakv", 0, None)),
            (("snapkv", 1, None), None, ("snapkv", 1, None)),
            (("momentkv", 1, None), None, ("snapkv", 1, None)),
            (("adakv", 1, None), None, ("adakv", 1, None)),
        ]
        jobs = []
        for cache, impl, source in plan:
            for b in sz.batches:
                if cache[0] == "full":
                    jobs.append((cache, impl, source, b, (c4,)))
                    # larger batches of a 32K full cache do not fit (the largest that does: below)
                    if b <= sz.probe:
                        jobs.append((cache, impl, source, b, (c32,)))
                else:
                    # a budget cache's shape does not depend on the context: one program serves both
                    jobs.append((cache, impl, source, b, (c4, c32)))
        largest = sz.batches[-1]
        jobs += [(EXPECTED, None, EXPECTED, b, (c4,)) for b in (sz.batches[0], largest)]
        # periodic eviction at the largest batch, from the every-step rows' prefills
        snap, ada = ("snapkv", 0, None), ("adakv", 0, None)
        for cache, source in ((snap, snap), (("momentkv", 0, None), snap), (ada, ada)):
            jobs.append((with_options(cache, evict_every=EVERY), None, source, largest, (c4,)))
        jobs.append((with_options(EXPECTED, evict_every=EVERY), None, EXPECTED, largest, (c4,)))
        # quantized caches (issue 58): at the largest batch of the plan, and at batch 1 and the
        # probe at 32K, which size their largest batch there
        sizing = (sz.batches[0], sz.probe)
        for q in FULL_Q:
            jobs.append((q, None, q, largest, (c4,)))
            jobs += [(q, None, q, b, (c32,)) for b in sizing]
        for q in SNAP_Q:
            jobs += [(q, None, q, b, (c4, c32)) for b in sorted({*sizing, largest})]
        if not self.smoke:
            return jobs
        # smoke: as prefill_plan; MomentKV and AdaKV at the profiled batch alone
        jobs = [j for j in jobs if j[0][1] != 1 and j[1] != "xla"]
        return [
            (cache, impl, source, b, (c4,) if cache == ("adakv", 0, None) else contexts)
            for cache, impl, source, b, contexts in jobs
            if cache[0] not in ("momentkv", "adakv") or b == sz.batches[-1]
        ]

    def submit_all(self) -> tuple[dict, dict]:
        """Every prefill and decode program, compiled in the background (decode states' shapes from
        the prefills' abstract outputs)."""
        prefills = {}
        for p in self.prefill_plan():
            fn, args, static = self.prefill_program(*p)
            prefills[p] = self.compiler.submit(fn, *args, **static)
        decodes = {}
        for job in self.decode_plan():
            cache, impl, source, b, contexts = job
            ev = eviction(cache, self.sz, contexts[0], self.attention(impl))
            shape = jax.eval_shape(
                functools.partial(tile_state, batch=b, moment_dims=self.moment_dims(cache)),
                self.prefill_shape(source, contexts[0]),
            )
            if (periodic := self.periodic(cache)) is not None:
                shape = jax.eval_shape(
                    functools.partial(refit, ev=periodic, cfg=self.sz.cfg), shape
                )
            decodes[job] = self.submit_decode(shape, ev)
        return prefills, decodes

    def periodic(self, cache: Cache):
        """The Eviction of a periodic eviction's row (its decoding needs ``evict_every`` spare
        slots; its state comes from the every-step row's prefill), else None."""
        if "evict_every" not in dict(cache[3] if len(cache) > 3 else ()):
            return None
        return eviction(cache, self.sz, self.sz.contexts[0], self.attention(None))

    def moment_dims(self, cache: Cache) -> tuple[int, int] | None:
        """The widths of the moments' sums decoding ``cache`` keeps (None: the full cache)."""
        ev = eviction(cache, self.sz, self.sz.contexts[0], None)
        return None if ev is None else ev.policy.moment_dims(self.sz.cfg.head_dim)

    def prefill_shape(self, cache: Cache, context: int) -> DecodeState:
        fn, args, static = self.prefill_program(cache, context, None)
        return jax.eval_shape(functools.partial(fn, **static), *args)

    def decode(self, futures: dict) -> None:
        sz = self.sz
        c4, c32 = sz.contexts
        jobs = self.decode_plan()
        snap = ("snapkv", 0, None)
        first = [j for j in jobs if j[:3] in ((FULL, None, FULL), (snap, None, snap))]
        sizers = [j for j in jobs if j[0] in FULL_Q + SNAP_Q and j[3] in (sz.batches[0], sz.probe)]
        ones = [j for j in first if j[3] == sz.batches[0]]
        for job in ones:  # batch 1 first: the target nearest its limit
            self.decode_job(futures, job)
        # then every other row, leaving SEARCH_S for the largest batches, which run last: call 3c's
        # failed tries left 93 GiB taken, and every row after them failed
        deadline, self.deadline = self.deadline, Deadline(self.deadline.left() - SEARCH_S)
        for job in jobs:
            if job not in ones:
                self.decode_job(futures, job)
        self.deadline = deadline
        # with every prefilled state moved to the host: each state held on the device splits the
        # allocator's pool (call 3c's searches found 108 GiB free and no block of 52 GiB for the
        # state's keys)
        on_device = memory_stats().get("bytes_in_use")
        # (one state at a time: the keys, tuples with None and str, are no pytree dictionary's)
        held, self.states = {k: jax.device_get(v) for k, v in self.states.items()}, {}
        gc.collect()
        log(
            "model: prefilled states on the host for the largest batches (bytes in use "
            f"{on_device} -> "
            f"{memory_stats().get('bytes_in_use')})"
        )
        for cache in (FULL, snap, *FULL_Q, *SNAP_Q):
            label = {
                "cache": cache_label(cache, sz),
                "impl": "default",
                "context": c32,
                "largest_batch": True,
            }
            if (cache, c32) not in held or self.deadline.passed():
                self.results.add(
                    "decode",
                    {**label, "error": "not run: no prefilled state or the deadline passed"},
                )
                continue
            probes = [
                next(
                    futures[j]
                    for j in first + sizers
                    if j[0] == cache and j[3] == b and c32 in j[4]
                )
                for b in (sz.batches[0], sz.probe)
            ]
            guarded(
                self.results,
                "decode",
                label,
                functools.partial(self.largest_batch_row, cache, held[cache, c32], *probes),
            )

    def decode_job(self, futures: dict, job: tuple) -> None:
        cache, impl, source, b, contexts = job
        for context in contexts:
            label = {
                "cache": cache_label(cache, self.sz),
                "impl": impl or "default",
                "batch": b,
                "context": context,
            }
            if (source, context) not in self.states:
                self.results.add(
                    "decode", {**label, "error": "not run: its prefill did not run (or was freed)"}
                )
            elif self.deadline.passed():
                self.results.add(
                    "decode", {**label, "error": "not run: the part's deadline passed"}
                )
            else:
                guarded(
                    self.results,
                    "decode",
                    label,
                    functools.partial(
                        self.decode_row,
                        futures[job],
                        self.states[source, context],
                        b,
                        self.profiled(cache, impl, b, context),
                        self.moment_dims(cache),
                        self.periodic(cache),
                    ),
                )

    def profiled(self, cache: Cache, impl: str | None, batch: int, context: int) -> bool:
        """The decode rows traced by the profiler, at the shorter context and the default impl: the
        full cache at batch 1, and the full cache, SnapKV, MomentKV, AdaKV and Expected Attention
        (the larger budget) at the largest batch of the plan."""
        sz = self.sz
        if context != sz.contexts[0] or impl is not None:
            return False
        return (cache == FULL and batch == sz.batches[0]) or (
            batch == sz.batches[-1]
            and cache
            in (FULL, ("snapkv", 0, None), ("momentkv", 0, None), ("adakv", 0, None), EXPECTED)
        )

    def largest_batch_row(
        self, cache: Cache, source: DecodeState, first_future, probe_future
    ) -> dict:
        """Size the batch from two compiled programs of the plan (batch 1 and the probe, ≤ 8): the
        state and the temporaries one more row adds (their differences), and the temporaries that do
        not grow with the batch, against the allocator's free bytes (its largest free block, if it
        says); then run it (if it fails, 10% smaller once: call 3c's failed tries left 93 GiB taken,
        so that every later row failed). ``source``: the prefilled state (on the host, see
        ``decode``). (Call 2 divided the probe's temporaries by its batch, counting a fixed ≈ 420
        MiB eight times over: its budget cache's largest batch was sized at 207 MiB per row where
        one more row took ≈ 150.)"""
        c32 = self.sz.contexts[1]
        ev = eviction(cache, self.sz, c32, self.attention(None))
        b1, probe_batch = self.sz.batches[0], self.sz.probe

        def state_bytes(batch: int) -> int:
            return cache_bytes(jax.eval_shape(functools.partial(tile_state, batch=batch), source))

        def temp(future) -> int:
            compiled, _ = future.result(timeout=max(1.0, self.deadline.left()))
            return compiled.memory_analysis().temp_size_in_bytes

        t1, t_probe = temp(first_future), temp(probe_future)
        per_row_temp = max(0.0, (t_probe - t1) / (probe_batch - b1))
        per_row = (state_bytes(probe_batch) - state_bytes(b1)) / (probe_batch - b1) + per_row_temp
        fixed_temp = max(0.0, t1 - b1 * per_row_temp)

        def sized() -> tuple[float, int, dict]:  # (bytes for the state, batch, allocator figures)
            stats = memory_stats()
            if not stats:  # CPU (smoke): no allocator figures
                return float("nan"), 2 * max(self.sz.batches), stats
            free = stats["bytes_limit"] - stats["bytes_in_use"]
            # the state's keys and values are two arrays: both fit in the largest free block, if it
            # is given
            free = (
                min(free, stats.get("largest_free_block_bytes", free)) - self.sz.margin - fixed_temp
            )
            return free, max(1, int(free // per_row)), stats

        errors = []
        for attempt in range(2):
            free, batch, stats = sized()
            batch = batch if attempt == 0 else max(1, int(batch * 0.9))
            log(
                f"largest batch, {cache_label(cache, self.sz)} at {c32}, try {attempt + 1}: "
                f"{batch} (free "
                f"{free / 2**30:.1f} GiB after {fixed_temp / 2**20:.0f} MiB of fixed temporaries "
                "and the margin, "
                f"{per_row / 2**20:.1f} MiB per row; allocator {stats})"
            )
            if self.deadline.passed():
                break
            try:
                shape = jax.eval_shape(functools.partial(tile_state, batch=batch), source)
                row = self.decode_row(self.submit_decode(shape, ev), source, batch)
                return {
                    **row,
                    "batch": batch,
                    "per_row_bytes": per_row,
                    "fixed_temp_bytes": fixed_temp,
                    "free_bytes": free,
                    "allocator": stats,
                    "attempts": attempt + 1,
                }
            except Exception as e:  # noqa: BLE001 - out of memory: a smaller batch
                errors.append(f"batch {batch}: {error_text(e, 200)}")
                log(errors[-1])
                gc.collect()  # a failed try's buffers, if a reference cycle holds them
        raise RuntimeError("no batch ran: " + "; ".join(errors))


def run(
    results: Results, deadline: Deadline, compiler: Compiler, ceilings: Ceilings, smoke: bool
) -> None:
    """Compile everything, then the prefills (within 40% of the time left), the compressions by
    ``kvjax.prefill`` (15% of what is left), then the decodes."""
    model = ModelRun(results, deadline, compiler, ceilings, smoke)
    prefills, decodes = model.submit_all()
    concurrent.futures.wait(
        list(prefills.values()) + list(decodes.values()), timeout=deadline.left() / 3
    )
    log(
        "model: "
        f"{sum(f.done() for f in decodes.values()) + sum(f.done() for f in prefills.values())} of "
        f"{len(prefills) + len(decodes)} programs compiled"
    )
    model.deadline = Deadline(deadline.left() * 0.4)
    model.prefill(prefills)
    model.deadline = Deadline(deadline.left() * 0.15)
    model.compress()
    model.deadline = deadline
    model.decode(decodes)


def tables(results: Results) -> list[str]:
    lines = []
    rows = results.rows("prefill")
    if rows:
        lines += [
            "### Prefill, one prompt",
            "",
            "| cache | context | impl | prompt attention | tokens/s | s | first call s | compile s "
            "| "
            "vs default (keys, logits) |",
            "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in rows:
            head = (
                f"| {r['cache']} | {r['context']} | {r['impl']} | {r.get('prompt_attention', '')} |"
            )
            if "error" in r:
                lines.append(f"{head} {r['error'][:200]} | | | | |")
            else:
                vs = r.get("vs_default")
                vs = f"{vs['last_layer_k']:.1e}, {vs['logits']:.1e}" if vs else ""
                lines.append(
                    f"{head} {r['tokens_per_s']:.0f} | {r['seconds']:.3f} | "
                    f"{r['first_call_s']:.2f} | "
                    f"{r['compile_s']:.1f} | {vs} |"
                )
        lines.append("")
    rows = results.rows("compress")
    if rows:
        lines += [
            "### Compression by `kvjax.prefill` (the whole prompt, its scoring, the cut)",
            "",
            "| scorer | budget | context | kept per head | s | tokens/s | first call s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            head = f"| {r['scorer']} | {r['budget']} | {r['context']} |"
            if "error" in r:
                lines.append(f"{head} {r['error'][:200]} | | | |")
            else:
                lines.append(
                    f"{head} {r['kept_per_head']:.1f} | {r['seconds']:.3f} | "
                    f"{r['tokens_per_s']:.0f} | {r['first_call_s']:.2f} |"
                )
        lines.append("")
    rows = results.rows("decode")
    if rows:
        lines += [
            "### Decode (floor: weights + kept keys and values over the measured copy bandwidth; "
            "read floor: over the measured read bandwidth)",
            "",
            "| cache | impl | context | batch | ms/step | tokens/s | floor ms | step / floor | "
            "read floor ms | step / read floor | K/V kept GB | "
            "temporaries GB | copied in the layer scan GB | compile s |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
            "| ---: | ---: |",
        ]

        def gb(r, key):  # absent before call 3
            return "" if r.get(key) is None else f"{r[key] / 1e9:.2f}"

        def num(r, key):  # the read floor: absent before call 5
            return "" if r.get(key) is None else f"{r[key]:.2f}"

        for r in rows:
            batch = f"{r.get('batch', '')}{' (largest)' if r.get('largest_batch') else ''}"
            if "error" in r:
                lines.append(
                    f"| {r['cache']} | {r['impl']} | {r['context']} | {batch} | {r['error'][:200]} "
                    "| | | | | | | | | |"
                )
            else:
                lines.append(
                    f"| {r['cache']} | {r['impl']} | {r['context']} | {batch} | "
                    f"{r['ms_per_step']:.2f} | "
                    f"{r['tokens_per_s']:.0f} | {r['floor_ms']:.2f} | {r['step_over_floor']:.2f} | "
                    f"{num(r, 'read_floor_ms')} | {num(r, 'step_over_read_floor')} | "
                    f"{r['kv_bytes_kept'] / 1e9:.2f} | {gb(r, 'temp_bytes')} | "
                    f"{gb(r, 'layer_scan_copy_bytes')} | "
                    f"{r['compile_s']:.1f} |"
                )
        lines.append("")
    profiled = [r for r in rows if "profile" in r]
    if profiled:
        kinds = [k for k, _ in KINDS] + ["other"]
        lines += [
            "### Where a decode step's device time goes (JAX's profiler, ms per step)",
            "",
            "| cache | impl | context | batch | step ms | device ms | ops | ops < 5 µs: n, ms | "
            + " | ".join(kinds)
            + " | largest |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | "
            + " | ".join("---:" for _ in kinds)
            + " | --- |",
        ]
        for r in profiled:
            p = r["profile"]
            head = (
                f"| {r['cache']} | {r['impl']} | {r['context']} | {r['batch']} "
                f"| {r['ms_per_step']:.2f} |"
            )
            if "error" in p:
                lines.append(f"{head} {p['error'][:200]} |" + " |" * (len(kinds) + 3))
                continue
            cells = " | ".join(f"{p['kinds'].get(k, 0):.2f}" for k in kinds)
            largest = "; ".join(f"{name[:48]} {ms:.2f}" for name, ms in p["top"][:3])
            # calls 3c and 4a counted fewer of these (3c no ops, 4a no short ones)
            ops = f"{p['ops_per_step']:.0f}" if "ops_per_step" in p else ""
            short = (
                f"{p['short_ops_per_step']:.0f}, {p['short_ops_ms']:.2f}"
                if "short_ops_ms" in p
                else ""
            )
            lines.append(f"{head} {p['ms_per_step']:.2f} | {ops} | {short} | {cells} | {largest} |")
        lines.append("")
    return lines
