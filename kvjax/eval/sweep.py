"""Needle-retrieval sweeps: scorers × budgets × protocols × settings over a set of samples, resumable.

Every answer is one JSON line (``Row``); a rerun skips the lines already written. Under the ``prefill``
protocol every (scorer, budget) of a sample is compressed from one shared full prefill
(``kvjax.prefill_full``), so a sweep over many scorers costs little more than one; ``blockwise`` runs
the block-wise engine per (scorer, budget). Answers are decoded greedily without eviction: NIAH measures
what the compression of the prompt keeps (decoding-time eviction is ``kvjax.eval.perplexity``'s subject).

Settings: ``query-aware`` compresses the prompt with the question in it (SnapKV's setting);
``query-agnostic`` compresses the context alone and appends the question afterwards (KVzip's setting and
kvpress's default).
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
from kvjax.options import with_tokenizer
from kvjax.params import Params
from kvjax.scorers import MODIFIERS, split_name

SETTINGS = ("query-aware", "query-agnostic")
FULL = "full"  # the uncompressed baseline's scorer name


@dataclasses.dataclass(frozen=True)
class Method:
    """One way of compressing: a scorer at a budget under a protocol (``FULL`` = no compression), with eviction
    keywords of its own (``options``: (name, value) pairs, over the run's shared ones) and a ``name`` that
    labels it in tables (default: the scorer, and the protocol unless "prefill")."""

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


def methods(scorers: Iterable[str], budgets: Iterable[int], protocols: Iterable[str]) -> list[Method]:
    """The full-cache baseline plus every scorer × budget × protocol."""
    found = [Method(FULL, None, "-")]
    for protocol in protocols:
        for scorer in scorers:
            found += [Method(scorer, budget, protocol) for budget in budgets]
    return found


@dataclasses.dataclass(frozen=True)
class Row:
    """One answer. ``seconds``: this method's own compression and decoding; the shared full prefill of the
    sample is ``prefill_seconds`` (the same for every prefill-protocol row of the sample and setting)."""

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


def run(params: Params, tokenizer, samples: list[Sample], methods_: list[Method], settings=SETTINGS, *,
        out: str, options: dict | None = None, block_size: int = 128, progress: bool = True) -> list[Row]:
    """Answer every sample with every method in every setting, appending to the JSONL file ``out``. Budgets
    that hold a sample's whole prompt are skipped for it (they equal the full cache, which is tested).

    options: eviction keywords (``kvjax.EvictionOptions``) shared by every method (a method's own override
    them); ``mi_batch`` goes to the scorers with moment-informed eviction only; kvzip's repeat prompt is made
    from ``tokenizer``. Returns every row of ``out`` for these samples, methods and options.
    """
    from tqdm import tqdm

    shared_options = dict(options or {})
    mine = lambda m: shared_options | dict(m.options)  # noqa: E731
    tag = lambda m: json.dumps(mine(m), sort_keys=True)  # noqa: E731
    for setting in settings:
        if setting not in SETTINGS:
            raise ValueError(f"setting={setting!r} must be one of {SETTINGS}")
    done = {row.key() for row in read_rows(out)}
    jobs = [(s, setting, m) for s in samples for setting in settings for m in methods_
            if (m.scorer != FULL or setting == settings[0]) and (m.budget or 0) < s.length]
    todo = [job for job in jobs
            if (job[0].id, job[1], job[2].scorer, job[2].budget, job[2].protocol, tag(job[2])) not in done]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    bar = tqdm(total=len(todo), desc="niah", unit="answer", disable=not progress)
    with open(out, "a") as f:
        for sample in samples:
            here = [(setting, m) for s, setting, m in todo if s is sample]
            if not here:
                continue
            shared, shared_s = None, 0.0
            if any(m.protocol in ("prefill", "-") for _, m in here):
                start = time.perf_counter()
                shared = kvjax.prefill_full(params, list(sample.prompt))
                jax.block_until_ready(shared.cache)
                shared_s = time.perf_counter() - start
            for setting, m in here:
                start = time.perf_counter()
                eviction = {} if m.scorer == FULL else with_tokenizer(
                    tokenizer, scorer=m.scorer, budget=m.budget, **scorer_options(m.scorer, mine(m)))
                answer = _answer(params, sample, setting, m, shared, eviction, block_size)
                prediction = tokenizer.decode(answer, skip_special_tokens=True)
                row = Row(sample=sample.id, task=sample.task, haystack=sample.haystack, length=sample.length,
                          depth=sample.depth, setting=setting, scorer=m.scorer, budget=m.budget,
                          protocol=m.protocol, options=tag(m), prediction=prediction,
                          score=score(prediction, sample.answers), seconds=time.perf_counter() - start,
                          prefill_seconds=shared_s if shared is not None and m.protocol != "blockwise" else 0.0,
                          label=m.label)
                f.write(json.dumps(dataclasses.asdict(row)) + "\n")
                f.flush()
                bar.update()
    bar.close()
    wanted = {(s.id, setting, m.scorer, m.budget, m.protocol, tag(m)) for s, setting, m in jobs}
    return [row for row in read_rows(out) if row.key() in wanted]


def scorer_options(scorer: str, options: dict) -> dict:
    """The shared options that apply to ``scorer`` (``mi_batch`` only to MomentKV's eviction)."""
    modifier = split_name(scorer)[2]
    if modifier and MODIFIERS[modifier].mi:
        return options
    return {k: v for k, v in options.items() if k != "mi_batch"}


def _answer(params: Params, sample: Sample, setting: str, m: Method, shared, eviction: dict, block_size: int):
    """The generated token ids of one (sample, setting, method); ``eviction``: its eviction keywords."""
    if m.scorer == FULL:
        return shared.generate(sample.max_new_tokens)
    aware = setting == "query-aware"
    question = None if aware else list(sample.question)
    if m.protocol == "prefill":
        context = shared.compress(upto=None if aware else len(sample.context), **eviction)
    else:
        tokens = list(sample.prompt if aware else sample.context)
        context = kvjax.prefill(params, tokens, protocol=m.protocol, **({"block_size": block_size} | eviction))
    return kvjax.decode(params, context, question, sample.max_new_tokens, evict=False)
