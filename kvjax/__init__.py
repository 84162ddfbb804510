"""kvjax: Llama / Qwen inference in JAX with fixed-budget KV-cache eviction."""

from kvjax.budget_cache import BudgetCache
from kvjax.cache import cache_bytes
from kvjax.checkpoint.errors import CheckpointError
from kvjax.config import ModelConfig
from kvjax.context import Context, decode, extend
from kvjax.eviction import ALLOCATIONS, SCORERS, kvzip_prompt
from kvjax.generate import forward, generate, generate_stream
from kvjax.loading import chat_tokens, load, load_tokenizer
from kvjax.options import EvictionOptions
from kvjax.paged_cache import PagedCache
from kvjax.params import Params, init_params
from kvjax.prefilled import Prefilled, prefill, prefill_full
from kvjax.sampling import Sampling
from kvjax.sharding import make_mesh, shard

__all__ = ["ALLOCATIONS", "SCORERS", "BudgetCache", "CheckpointError", "Context", "EvictionOptions", "ModelConfig",
           "PagedCache", "Params", "Prefilled", "Sampling", "cache_bytes", "chat_tokens", "decode", "extend", "forward",
           "generate", "generate_stream", "init_params", "kvzip_prompt", "load", "load_tokenizer", "make_mesh",
           "prefill", "prefill_full", "shard"]
