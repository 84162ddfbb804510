"""kvjax: Llama / Qwen inference in JAX with fixed-budget KV-cache eviction."""

from kvjax.cache.dense import BudgetCache
from kvjax.cache.full import cache_bytes
from kvjax.cache.paged import PagedCache
from kvjax.checkpoint.errors import CheckpointError
from kvjax.eviction import ALLOCATIONS, SCORERS, kvzip_prompt
from kvjax.kernels.quantized import KV_DTYPES
from kvjax.loading import chat_tokens, load, load_tokenizer
from kvjax.model.config import ModelConfig
from kvjax.model.params import Params, init_params, stack_layers, unstack_layers
from kvjax.runtime.context import Context, decode, extend
from kvjax.runtime.generate import forward, generate, generate_stream
from kvjax.runtime.options import EvictionOptions, budget_for_bytes
from kvjax.runtime.prefilled import Prefilled, prefill, prefill_full
from kvjax.runtime.sampling import Sampling
from kvjax.sharding import make_mesh, shard

__all__ = [
    "ALLOCATIONS",
    "KV_DTYPES",
    "SCORERS",
    "BudgetCache",
    "CheckpointError",
    "Context",
    "EvictionOptions",
    "ModelConfig",
    "PagedCache",
    "Params",
    "Prefilled",
    "Sampling",
    "budget_for_bytes",
    "cache_bytes",
    "chat_tokens",
    "decode",
    "extend",
    "forward",
    "generate",
    "generate_stream",
    "init_params",
    "kvzip_prompt",
    "load",
    "load_tokenizer",
    "make_mesh",
    "prefill",
    "prefill_full",
    "shard",
    "stack_layers",
    "unstack_layers",
]
