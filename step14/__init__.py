"""One step of the paged prefix-cache tutorial: a complete engine (see this folder's README)."""

from common.sampling import RequestOutput, SamplingParams
from common.stats import EngineStats

from .block_manager import BlockManager, NoFreeBlocksError
from .engine import PagedPrefixCacheEngine
from .kv_cache_manager import KVCacheManager
from .model import TinyTransformerPaged
from .prefix_cache import PrefixCache
from .scheduler import PagedScheduler
from .sequence import Sequence, SequenceStatus

__all__ = [
    "BlockManager",
    "EngineStats",
    "KVCacheManager",
    "NoFreeBlocksError",
    "PagedPrefixCacheEngine",
    "PagedScheduler",
    "PrefixCache",
    "RequestOutput",
    "SamplingParams",
    "Sequence",
    "SequenceStatus",
    "TinyTransformerPaged",
]
