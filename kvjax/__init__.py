"""kvjax: Llama / Qwen inference in JAX with fixed-budget KV-cache eviction."""

from kvjax.checkpoint.errors import CheckpointError
from kvjax.config import ModelConfig
from kvjax.generate import forward, generate, generate_stream
from kvjax.loading import chat_tokens, load, load_tokenizer
from kvjax.params import Params, init_params
from kvjax.sampling import Sampling

__all__ = ["CheckpointError", "ModelConfig", "Params", "Sampling", "chat_tokens", "forward", "generate",
           "generate_stream", "init_params", "load", "load_tokenizer"]
