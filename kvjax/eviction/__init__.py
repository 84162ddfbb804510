"""Which tokens a budget cache keeps: base scorers (one module each), modifiers, allocations, the
scorer grammar and the static ``Policy`` they resolve to.

Adding a base: one module with a ``Base`` subclass, listed in ``names.BASES``, plus its NumPy
reference in ``tests/reference_eviction.py`` (docs/architecture.md).
"""

from kvjax.eviction.allocations import ALLOCATIONS, FLOOR_MODES, Allocation, allocation_table
from kvjax.eviction.base import Base
from kvjax.eviction.kvzip import DEFAULT_FORM, FORMS, RepeatPrompt, kvzip_prompt
from kvjax.eviction.modifiers import MODIFIERS, Modifier
from kvjax.eviction.names import ALIASES, BASES, SCORERS, scorer_table, split_name
from kvjax.eviction.policy import Policy, make_policy
from kvjax.eviction.priority import AGGREGATES, POOLS, eviction_keys
from kvjax.eviction.scoring_data import ScoringData

__all__ = [
    "AGGREGATES",
    "ALIASES",
    "ALLOCATIONS",
    "BASES",
    "DEFAULT_FORM",
    "FLOOR_MODES",
    "FORMS",
    "MODIFIERS",
    "POOLS",
    "SCORERS",
    "Allocation",
    "Base",
    "Modifier",
    "Policy",
    "RepeatPrompt",
    "ScoringData",
    "allocation_table",
    "eviction_keys",
    "kvzip_prompt",
    "make_policy",
    "scorer_table",
    "split_name",
]
