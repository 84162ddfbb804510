"""The modifiers of the scorer grammar (``base+modifier``), one module each, registered here. Which
bases take which modifier is each base's ``modifiers``."""

from kvjax.eviction.modifiers import caote, momentkv, obcache
from kvjax.eviction.modifiers.base import Modifier

MODIFIERS: dict[str, Modifier] = obcache.ENTRIES | caote.ENTRIES | momentkv.ENTRIES
NO_MODIFIER = Modifier()

__all__ = ["MODIFIERS", "NO_MODIFIER", "Modifier"]
