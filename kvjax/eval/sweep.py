"""Needle-retrieval sweeps: scorers × budgets × protocols × settings over a set of samples,
resumable.

Every answer is one JSON line (``Row``); a rerun skips the lines already written. Samples of one
length and task run together as one batch (up to ``batch`` rows, padded as ``kvjax.prefill`` pads
any batch): under the ``prefill`` protocol every (scorer, budget) of the batch is compressed from
one shared full prefill (``kvjax.prefill_full``), so a sweep over many scorers costs little more
than one; ``blockwise`` runs the block-wise engine per (scorer, budget). Answers are decoded
greedily without eviction: NIAH measures what the compression of the prompt keeps (decoding-time
eviction is ``kvjax.eval.perplexity``'s subject).

Settings: ``query-aware`` compresses the prompt with the question in it (SnapKV's setting);
``query-agnostic`` compresses the context alone and appends the question afterwards (KVzip's setting
and kvpress's default).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable

import jax

import kvjax
from kvjax.eval.niah import Sample, score
from kvjax.eviction import MODIFIERS, split_name
from kvjax.model.params import Params
from kvjax.runtime.options import with_tokenizer

SETTINGS = ("query-aware", "query-agnostic")
FULL = "full"  # the uncompressed baseline's scorer name
BLOCK_SIZE = 128  # the block-wise protocol's default block (CAOTE's)


@dataclasses.dataclass(frozen=True)
class Method:
    """One way of compressing: a scorer at a budget under a protocol (``FULL`` = no compression).

    Fields:
        options: eviction keywords of its own, (name, value) pairs, over the run's shared ones.
        name: labels it in tables (default: the scorer, and the protocol unless "prefill").
    """

    scorer: str
    budget: int | None = None
    protocol: str = "prefill"  # "-" for FULL
    options: tuple[tuple[str, object], ...] = ()
    name: str | None = None

    @property
    def label(self) -> str:
        if self.scorer == FULL:
            return FULL
        if self.name:
            return self.name
        return self.scorer if self.protocol == "prefill" else f"{self.scorer} ({self.protocol})"


def methods(
    scorers: Iterable[str], budgets: Iterable[int], protocols: Iterable[str]
) -> list[Method]:
    """The full-cache baseline plus every scorer × budget × protocol."""
    found = [Method(FULL, None, "-")]
    for protocol in protocols:
        for scorer in scorers:
            found += [Method(scorer, budget, protocol) for budget in budgets]
    return found


@dataclasses.dataclass(frozen=True)
class Row:
    """One answer.

    Fields:
        seconds: this method's own compression and decoding.
        prefill_seconds: the shared full prefill of the sample (the same for every prefill-protocol
            row of the sample and setting).

    Both are the batch's time divided by its rows.
    """

    sample: str
    task: str
    haystack: str
    length: int
    depth: float
    setting: str
    scorer: str
    budget: int | None
    protocol: str
    options: str
    prediction: str
    score: float
    seconds: float
    prefill_seconds: float
    label: str = ""  # the method's label (empty in rows written before methods had names)

    def key(self) -> tuple:
        return self.sample, self.setting, self.scorer, self.budget, self.protocol, self.options

    @property
    def method_label(self) -> str:
        return self.label or Method(self.scorer, self.budget, self.protocol).label


def read_rows(path: str) -> list[Row]:
    """The rows of a JSONL results file (none if it does not exist); a torn last line is ignored."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(Row(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                continue  # a run killed mid-write leaves a partial line
    return rows


def run(
    params: Params,
    tokenizer,
    samples: list[Sample],
    methods_: list[Method],
    settings=SETTINGS,
    *,
    out: str,
    options: dict | None = None,
    block_size: int = BLOCK_SIZE,
    batch: int = 8,
    progress: bool = True,
) -> list[Row]:
    """Answer every sample with every method in every setting, appending to the JSONL file ``out``.
    Budgets that hold a sample's whole prompt are skipped for it (they equal the full cache, which
    is tested).

    Args:
        options: eviction keywords (``kvjax.EvictionOptions``) shared by every method (a method's
            own override them); ``mi_batch`` goes to the scorers with moment-informed eviction
            only; kvzip's repeat prompt is made from ``tokenizer``.
        batch: samples (of one length and task) answered together.

    Returns every row of ``out`` for these samples, methods and options.
    """
    from tqdm import tqdm

    if not (isinstance(batch, int) and batch >= 1):
        raise ValueError(f"batch={batch!r} must be an integer >= 1")
    shared_options = dict(options or {})
    mine = lambda m: shared_options | dict(m.options)  # noqa: E731

    def block(m: Method) -> dict:
        """A block-wise method's block size, in its tag (and the label of an unnamed method) when
        not CAOTE's 128 (rows made before the block size was tagged were all made at 128: their
        keys stay valid)."""
        blockwise = m.protocol == "blockwise" and block_size != BLOCK_SIZE
        return {"block_size": block_size} if blockwise else {}

    def tag(m: Method) -> str:
        return json.dumps(mine(m) | block(m), sort_keys=True)

    def label(m: Method) -> str:  # a preset's named methods keep their names (its claims use them)
        return m.label + ("" if m.name else "".join(f", block {b}" for b in block(m).values()))

    key = lambda s, setting, m: (  # noqa: E731
        s.id,
        setting,
        m.scorer,
        m.budget,
        m.protocol,
        tag(m),
    )
    for setting in settings:
        if setting not in SETTINGS:
            raise ValueError(f"setting={setting!r} must be one of {SETTINGS}")
    done = {row.key() for row in read_rows(out)}
    jobs = [
        (s, setting, m)
        for s in samples
        for setting in settings
        for m in methods_
        if (m.scorer != FULL or setting == settings[0]) and (m.budget or 0) < s.length
    ]
    todo = {key(*job) for job in jobs} - done
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    bar = tqdm(total=len(todo), desc="niah", unit="answer", disable=not progress)
    with open(out, "a") as f:
        for group in _batches(samples, batch):
            here = [
                (setting, m)
                for setting in settings
                for m in methods_
                if any(key(s, setting, m) in todo for s in group)
            ]
            if not here:
                continue
            shared, shared_s = {}, {}  # one full prefill per kv_dtype, made when first needed

            def prefilled(kv_dtype):
                if kv_dtype not in shared:
                    start = time.perf_counter()
                    prompts = [list(s.prompt) for s in group]
                    shared[kv_dtype] = kvjax.prefill_full(params, prompts, kv_dtype=kv_dtype)
                    jax.block_until_ready(shared[kv_dtype].cache)
                    shared_s[kv_dtype] = (time.perf_counter() - start) / len(group)
                return shared[kv_dtype]

            for setting, m in here:
                kv_dtype = mine(m).get("kv_dtype")
                one = prefilled(kv_dtype) if m.protocol in ("prefill", "-") else None
                start = time.perf_counter()
                eviction = (
                    {}
                    if m.scorer == FULL
                    else with_tokenizer(
                        tokenizer,
                        scorer=m.scorer,
                        budget=m.budget,
                        **scorer_options(m.scorer, mine(m)),
                    )
                )
                answers = _answers(params, group, setting, m, one, eviction, block_size)
                seconds = (time.perf_counter() - start) / len(group)
                for sample, answer in zip(group, answers, strict=True):
                    if key(sample, setting, m) not in todo:
                        continue
                    prediction = tokenizer.decode(answer, skip_special_tokens=True)
                    row = Row(
                        sample=sample.id,
                        task=sample.task,
                        haystack=sample.haystack,
                        length=sample.length,
                        depth=sample.depth,
                        setting=setting,
                        scorer=m.scorer,
                        budget=m.budget,
                        protocol=m.protocol,
                        options=tag(m),
                        prediction=prediction,
                        score=score(prediction, sample.answers),
                        seconds=seconds,
                        prefill_seconds=0.0 if one is None else shared_s[kv_dtype],
                        label=label(m),
                    )
                    f.write(json.dumps(dataclasses.asdict(row)) + "\n")
                    f.flush()
                    bar.update()
    bar.close()
    wanted = {key(*job) for job in jobs}
    return [row for row in read_rows(out) if row.key() in wanted]


def _batches(samples: list[Sample], batch: int) -> list[list[Sample]]:
    """The samples in groups of one length and task (one answer length), at most ``batch`` each, in
    order."""
    by_kind: dict[tuple, list[Sample]] = {}
    for s in samples:
        by_kind.setdefault((s.length, s.task), []).append(s)
    return [group[i : i + batch] for group in by_kind.values() for i in range(0, len(group), batch)]


def scorer_options(scorer: str, options: dict) -> dict:
    """The shared options that apply to ``scorer`` (``mi_batch`` only to MomentKV's eviction)."""
    modifier = split_name(scorer)[2]
    if modifier and MODIFIERS[modifier].sequential_choice:
        return options
    return {k: v for k, v in options.items() if k != "mi_batch"}


def _answers(
    params: Params,
    group: list[Sample],
    setting: str,
    m: Method,
    shared,
    eviction: dict,
    block_size: int,
) -> list:
    """The generated token ids of each sample of ``group`` (one task: one answer length) under
    (setting, method), as one batch; ``eviction``: the method's eviction keywords."""
    max_new = group[0].max_new_tokens
    if m.scorer == FULL:
        return shared.generate(max_new)
    aware = setting == "query-aware"
    questions = None if aware else [list(s.question) for s in group]
    if m.protocol == "prefill":
        context = shared.compress(
            upto=None if aware else [len(s.context) for s in group], **eviction
        )
    else:
        rows = [list(s.prompt if aware else s.context) for s in group]
        context = kvjax.prefill(
            params, rows, protocol=m.protocol, **({"block_size": block_size} | eviction)
        )
    return kvjax.decode(params, context, questions, max_new, evict=False)
