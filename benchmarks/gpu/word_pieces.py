"""The stand-in tokenizer of KVzip's repeat prompt on random weights, which have no tokenizer, for
both sides of the comparison: kvjax's ``kvjax.prefill`` (the model part; ``kvjax.kvzip_prompt``
calls it) and kvpress's ``KVzipPress`` (``peer_kvpress``; it calls ``encode``), so that both get the
same ids. No dependencies: it runs under the card's JAX and under kvpress's torch."""

from __future__ import annotations

import re
import zlib


class WordPieces:
    """Word pieces as Llama 3's pre-tokenizer splits them (newlines, a word with its leading space,
    punctuation), each a fixed id from its text; no chat template ("\\n\\nRepeat the previous
    context exactly." is 7 pieces, as Llama 3's tokenizer makes it)."""

    chat_template = None
    PIECES = re.compile(r"\s*[\r\n]+| ?\w+| ?[^\s\w]+|\s+")

    def __init__(self, vocab: int):
        self.vocab = vocab

    def ids(self, text: str) -> list[int]:
        return [
            100 + zlib.crc32(p.encode()) % (self.vocab - 200) for p in self.PIECES.findall(text)
        ]

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        """transformers' call, as ``kvjax.kvzip_prompt`` makes it."""
        return {"input_ids": self.ids(text)}

    def encode(self, text: str, return_tensors=None, add_special_tokens: bool = False):
        """transformers' ``encode``, as kvpress's ``KVzipPress`` makes it."""
        if return_tensors != "pt":
            return self.ids(text)
        import torch

        return torch.tensor([self.ids(text)], dtype=torch.long)
