"""kvjax: Llama / Qwen inference in JAX with fixed-budget KV-cache eviction."""

from kvjax.checkpoint.errors import CheckpointError
from kvjax.budget_cache import BudgetCache, cache_bytes
from kvjax.config import ModelConfig
from kvjax.context import Context, decode, prefill
from kvjax.generate import forward, generate, generate_stream
from kvjax.loading import chat_tokens, load, load_tokenizer
from kvjax.options import EvictionOptions
from kvjax.params import Params, init_params
from kvjax.prefilled import Prefilled, prefill_full
from kvjax.sampling import Sampling
from kvjax.scorers import SCORERS

__all__ = ["SCORERS", "BudgetCache", "CheckpointError", "Context", "EvictionOptions", "ModelConfig", "Params",
           "Prefilled", "Sampling", "cache_bytes", "chat_tokens", "decode", "forward", "generate", "generate_stream", "init_params", "load",
           "load_tokenizer", "prefill", "prefill_full"]
