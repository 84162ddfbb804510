"""A GGUF file's tokenizer without torch.

transformers builds a tokenizer from a GGUF's metadata with pure-``tokenizers`` code
(``convert_gguf_tokenizer``), but reads that metadata with a reader that imports torch. Here the
``gguf`` package (already kvjax's GGUF reader) reads it, in the names transformers' builder expects,
and the result is a fast tokenizer equal to ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``
(``tests/test_packaging.py`` compares them).
"""

from __future__ import annotations

from kvjax.checkpoint.gguf_file import field, open_gguf

# the special tokens a GGUF names by id, as transformers' tokenizer keywords
SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def gguf_tokenizer(path: str):
    """The ``transformers`` fast tokenizer a GGUF file describes (vocabulary, merges, special
    tokens, chat template), built without torch."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    reader = open_gguf(path)
    grouped = {
        group: {
            name: field(reader, f"tokenizer.{key}")
            for key, name in renames.items()
            if f"tokenizer.{key}" in reader.fields
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # llama.cpp's rule for sentencepiece files that do not say
        config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for name, key in SPECIAL_TOKENS.items():
        token_id = field(reader, f"tokenizer.ggml.{key}")
        config[name] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(field(reader, "general.architecture"), tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
