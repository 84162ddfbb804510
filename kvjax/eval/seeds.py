"""``python -m kvjax eval seeds``: every seed paper's comparison in its own setting, as one
resumable run.

Each part is an ``eval`` command of its own (``PARTS``: the arguments after
``python -m kvjax eval``), run in order with ``--out <out>/<part>``:

- ``obcache``: NIAH, {H2O (prefill variant), TOVA, SnapKV} × {attention, value, key, joint}
  (``seeds-obcache``);
- ``caote``: NIAH under the block-wise protocol, {H2O, TOVA, SnapKV} × {plain, CAOTE, FastCAOTE}
  (``seeds-caote``), and ``caote-ppl``: their perplexity under decoding-time eviction;
- ``momentkv``: NIAH, {SnapKV, AdaKV} × {plain, MI, NC, MI+NC, zeroth} (``seeds-momentkv``), and
  ``momentkv-fidelity-snapkv`` / ``-adakv``: attention-output error and next-token KL;
- ``kvzip``: NIAH with the question after compression, KVzip against SnapKV and TOVA
  (``seeds-kvzip``).

A NIAH part resumes answer by answer; a perplexity or fidelity part (a few minutes each) is skipped
when its JSON exists.
"""

from __future__ import annotations

import os

CAOTE_SCORERS = [
    f"{base}{m}" for base in ("h2o", "tova", "snapkv") for m in ("", "+caote", "+fastcaote")
]
MOMENTKV_VARIANTS = ("", "+momentkv-mi", "+momentkv-nc", "+momentkv", "+momentkv-zeroth")
PARTS = {
    "obcache": ["niah", "--preset", "seeds-obcache"],
    "caote": ["niah", "--preset", "seeds-caote"],
    "caote-ppl": [
        "ppl",
        "--scorers",
        *CAOTE_SCORERS,
        "--budgets",
        "256",
        "--length",
        "2048",
        "--edges",
        "256",
        "512",
        "1024",
        "2048",
    ],
    "momentkv": ["niah", "--preset", "seeds-momentkv"],
    "momentkv-fidelity-snapkv": [
        "fidelity",
        "--scorers",
        *[f"snapkv{v}" for v in MOMENTKV_VARIANTS],
        "--budgets",
        "128",
        "512",
        "--mi-batch",
        "128",
    ],
    "momentkv-fidelity-adakv": [
        "fidelity",
        "--scorers",
        *[f"adakv+snapkv{v}" for v in MOMENTKV_VARIANTS],
        "--budgets",
        "128",
        "512",
        "--mi-batch",
        "128",
        "--n-sink",
        "1",
        "--chunk",
        "4",
    ],
    "kvzip": ["niah", "--preset", "seeds-kvzip"],
}
# the file whose presence marks a part done
OUTPUT = {"ppl": "ppl.json", "fidelity": "fidelity.json"}


def part_argv(name: str, out: str, model: str, dtype: str) -> list[str]:
    """The ``eval`` arguments of part ``name`` writing under ``out``."""
    return PARTS[name] + ["--out", os.path.join(out, name), "--model", model, "--dtype", dtype]
