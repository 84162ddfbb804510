"""RULER-style needle-in-a-haystack samples and their exact-match scoring.

Tasks (RULER's NIAH family): ``single-number`` / ``single-word`` / ``single-uuid`` (one needle whose
value is a 7-digit number, a word or a UUID), ``multikey`` (four needles with different keys, one
asked) and ``multivalue`` (four values under one key, all asked). A needle reads "One of the special
magic numbers for {key} is: {value}." and sits between haystack sentences at a depth in [0, 1]; the
question comes after the context, inside the model's chat template, and the assistant turn starts
with RULER's answer prefix.

A second form, ``sentence-number``, reads as ordinary prose: the needle is a sentence such as "The
access code for the Amber Lantern gate is 8322358.", two distractors of the same form give other
places other numbers, there is no instruction, and the question ("What is the access code for the
Amber Lantern gate?") ends the user turn with no answer prefix, so the model answers in its own
words.

Every sample is fixed by (seed, task, haystack, length, index): the same seed gives the same tokens.
"""

from __future__ import annotations

import dataclasses
import random
import re
import uuid

from kvjax.eval.haystack import HAYSTACKS, sentences
from kvjax.loading import chat_parts

TASKS = ("single-number", "single-word", "single-uuid", "multikey", "multivalue", "sentence-number")
NEEDLES_PER_SAMPLE = 4  # multikey: needles (one asked); multivalue: values of the asked key
SENTENCE_NEEDLES = 2  # sentence-number: the asked sentence and one distractor
ADJECTIVES = (
    "amber",
    "ancient",
    "bitter",
    "brave",
    "bright",
    "calm",
    "clever",
    "cold",
    "crimson",
    "curious",
    "dark",
    "distant",
    "eager",
    "faint",
    "fierce",
    "gentle",
    "golden",
    "hidden",
    "hollow",
    "humble",
    "icy",
    "jolly",
    "lively",
    "lonely",
    "loud",
    "lucky",
    "mellow",
    "misty",
    "noble",
    "odd",
    "pale",
    "patient",
    "proud",
    "quiet",
    "rapid",
    "rusty",
    "sacred",
    "silent",
    "silver",
    "sleepy",
    "smooth",
    "solemn",
    "spicy",
    "steady",
    "stormy",
    "sunny",
    "swift",
    "tender",
    "tiny",
    "wild",
)
NOUNS = (
    "anchor",
    "badger",
    "banjo",
    "beacon",
    "blossom",
    "canyon",
    "castle",
    "cedar",
    "comet",
    "copper",
    "cottage",
    "crater",
    "dolphin",
    "ember",
    "falcon",
    "fern",
    "fjord",
    "galaxy",
    "glacier",
    "harbor",
    "hazel",
    "heron",
    "island",
    "jasmine",
    "kettle",
    "lantern",
    "meadow",
    "meteor",
    "monsoon",
    "nectar",
    "orchard",
    "otter",
    "parrot",
    "pebble",
    "pillar",
    "quartz",
    "raven",
    "reef",
    "saddle",
    "sparrow",
    "spruce",
    "summit",
    "thistle",
    "thunder",
    "tulip",
    "valley",
    "violin",
    "walnut",
    "willow",
    "zephyr",
)
SENTENCES = (  # sentence-number's forms: (needle, question), one per sample
    (
        "The access code for the {key} gate is {value}.",
        "What is the access code for the {key} gate?",
    ),
    (
        "The {key} hotel can be reached by phone at {value}.",
        "At what number can the {key} hotel be reached by phone?",
    ),
    (
        "The serial number engraved on the {key} telescope is {value}.",
        "What is the serial number engraved on the {key} telescope?",
    ),
    (
        "The {key} library card of the visiting scholar has the number {value}.",
        "What number does the visiting scholar's {key} library card have?",
    ),
)
WORD_VALUES = (
    "apricot",
    "bonfire",
    "cobalt",
    "driftwood",
    "eclipse",
    "flamingo",
    "gondola",
    "hammock",
    "igloo",
    "juniper",
    "kaleidoscope",
    "lighthouse",
    "marmalade",
    "nightingale",
    "origami",
    "paprika",
    "quiver",
    "riddle",
    "saffron",
    "tapestry",
    "umbrella",
    "velvet",
    "whistle",
    "yodel",
)


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt, split where the question starts (query-agnostic runs compress ``context`` alone).

    Fields:
        context: token ids of the chat template's head, the instruction and the haystack with its
            needles.
        question: token ids of the question, the end of the user turn, the assistant header and
            the answer prefix.
        answers: the values that must all appear in the generated text.
    """

    id: str
    task: str
    haystack: str
    length: int
    index: int
    depth: float
    context: tuple[int, ...]
    question: tuple[int, ...]
    answers: tuple[str, ...]
    max_new_tokens: int

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.context + self.question


def score(prediction: str, answers: tuple[str, ...] | list[str]) -> float:
    """RULER's ``string_match_all``: the fraction of the answers found (case-insensitive) in the
    prediction; a number counts only as a whole number, not inside a longer run of digits
    ("2049969999" does not answer 2049969)."""
    text = prediction.lower()
    return sum(_found(a.lower(), text) for a in answers) / len(answers)


def _found(answer: str, text: str) -> bool:
    if answer.isdigit():
        return re.search(rf"(?<!\d){answer}(?!\d)", text) is not None
    return answer in text


def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _value(task: str, rng: random.Random) -> str:
    if task == "single-word":
        return rng.choice(WORD_VALUES)
    if task == "single-uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return str(rng.randint(1_000_000, 9_999_999))


def make_sample(
    tokenizer, task: str, haystack: str, length: int, index: int, n: int, seed: int = 0
) -> Sample:
    """Sample ``index`` of ``n`` for (task, haystack, length): the asked needle sits at depth
    index/(n-1) and the prompt (context + question) holds at most ``length`` tokens, filled with
    whole haystack sentences (short of it by less than the next sentence)."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} must be one of {TASKS}")
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack={haystack!r} must be one of {HAYSTACKS}")
    rng = random.Random(f"{seed}/{task}/{haystack}/{length}/{index}")
    depth = index / (n - 1) if n > 1 else 0.5
    if task == "sentence-number":
        needle, asks = rng.choice(SENTENCES)
        names = [
            f"{a.capitalize()} {b.capitalize()}"
            for a, b in zip(  # no word shared between two names
                rng.sample(ADJECTIVES, SENTENCE_NEEDLES),
                rng.sample(NOUNS, SENTENCE_NEEDLES),
                strict=True,
            )
        ]
        values = [_value(task, rng) for _ in names]
        needles = [
            (depth if i == 0 else rng.random(), needle.format(key=name, value=v))
            for i, (name, v) in enumerate(zip(names, values))
        ]
        instruction, question, prefix = "", "\n\n" + asks.format(key=names[0]), ""
        answers, max_new = (values[0],), 32
    else:
        needles, instruction, question, prefix, answers, max_new = _ruler(task, rng, depth)
    context, asked_ids = _fill(
        tokenizer, haystack, length, rng, needles, instruction, question, prefix
    )
    return Sample(
        id=f"{task}/{haystack}/{length}/{index}of{n}/seed{seed}",
        task=task,
        haystack=haystack,
        length=length,
        index=index,
        depth=depth,
        context=tuple(context),
        question=tuple(asked_ids),
        answers=answers,
        max_new_tokens=max_new,
    )


def _ruler(task: str, rng: random.Random, depth: float) -> tuple:
    """RULER's needles ((depth, sentence) pairs), instruction, question, answer prefix, answers and
    answer length for ``task``."""
    kind = {"single-word": "words", "single-uuid": "uuids"}.get(task, "numbers")
    keys = rng.sample([f"{a}-{b}" for a in ADJECTIVES for b in NOUNS], NEEDLES_PER_SAMPLE)
    asked = keys[0]
    if task == "multivalue":
        values = list(dict.fromkeys(_value(task, rng) for _ in range(NEEDLES_PER_SAMPLE)))
        needles = [
            (depth if i == 0 else rng.random(), _needle(kind, asked, v))
            for i, v in enumerate(values)
        ]
        answers = tuple(values)
        question = (
            f"What are all the special magic {kind} for {asked} mentioned in the provided text?"
        )
        prefix = f"The special magic {kind} for {asked} mentioned in the provided text are"
        max_new = 16 * NEEDLES_PER_SAMPLE
    else:
        count = NEEDLES_PER_SAMPLE if task == "multikey" else 1
        values = [_value(task, rng) for _ in range(count)]
        needles = [
            (depth if i == 0 else rng.random(), _needle(kind, keys[i], v))
            for i, v in enumerate(values)
        ]
        answers = (values[0],)
        singular = kind[:-1]
        question = (
            f"What is the special magic {singular} for {asked} mentioned in the provided text?"
        )
        prefix = f"The special magic {singular} for {asked} mentioned in the provided text is"
        max_new = 40 if task == "single-uuid" else 16
    instruction = (
        f"Some special magic {kind} are hidden within the following text. Make sure to memorize "
        f"it. I will quiz you about the {kind} afterwards.\n"
    )
    return needles, instruction, "\n" + question, prefix, answers, max_new


def _fill(
    tokenizer,
    haystack: str,
    length: int,
    rng: random.Random,
    needles: list[tuple[float, str]],
    instruction: str,
    question: str,
    prefix: str,
) -> tuple[list[int], list[int]]:
    """The token ids (context, question) of the chat prompt whose context is ``instruction`` +
    haystack sentences from a random start with ``needles`` ((depth, sentence) pairs) placed among
    them, as many sentences as keep the prompt within ``length``."""
    pool = sentences(haystack)
    start = rng.randrange(len(pool))
    hay = [pool[(start + i) % len(pool)] for i in range(len(pool))]

    def build(n_sentences: int) -> tuple[list[int], list[int]]:
        body = hay[:n_sentences]
        places = sorted(((round(d * n_sentences), needle) for d, needle in needles), reverse=True)
        # deepest first, so the shallower places stay where they were computed
        for at, needle in places:
            body = body[:at] + [needle] + body[at:]
        return chat_parts(tokenizer, instruction + " ".join(body), question, prefix)

    low, high = 0, len(hay)  # the most sentences that fit
    while low < high:
        mid = (low + high + 1) // 2
        context, asked_ids = build(mid)
        if len(context) + len(asked_ids) <= length:
            low = mid
        else:
            high = mid - 1
    context, asked_ids = build(low)
    if low == len(hay):
        raise ValueError(
            f"length={length}: the {haystack!r} haystack cannot fill it (got "
            f"{len(context) + len(asked_ids)} tokens)"
        )
    return context, asked_ids


def make_samples(
    tokenizer,
    tasks=TASKS,
    haystacks=HAYSTACKS,
    lengths=(1024, 2048, 4096),
    n: int = 4,
    seed: int = 0,
) -> list[Sample]:
    """``n`` samples (depths spread over [0, 1]) for every task × haystack × length."""
    return [
        make_sample(tokenizer, task, haystack, length, i, n, seed)
        for length in lengths
        for haystack in haystacks
        for task in tasks
        for i in range(n)
    ]
