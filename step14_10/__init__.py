"""Lazy, not plain, imports: so that Ctrl-C while torch loads ends ``run`` in one line.

One step of the paged prefix-cache tutorial, a complete engine (see this folder's README).
``from <step> import PagedPrefixCacheEngine`` reads as usual: the module ``__getattr__`` below
(PEP 562; vLLM's own ``__init__`` does the same with its ``MODULE_ATTRS``) imports a name's
module when the name is first used. Python imports this package before ``run.py`` can catch
anything, so with plain imports Ctrl-C during torch's seconds of importing would end
``python -m <step>.run`` in a traceback; here importing the package alone costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each name, and the module that defines it: this step's own files, or the core.
MODULE_ATTRS = {
    "BlockManager": ".block_manager",
    "EngineStats": "common.stats",
    "KVCacheManager": ".kv_cache_manager",
    "NoFreeBlocksError": ".block_manager",
    "PagedPrefixCacheEngine": ".engine",
    "PagedScheduler": ".scheduler",
    "PrefixCache": ".prefix_cache",
    "RequestOutput": "common.sampling_params",
    "SamplingParams": "common.sampling_params",
    "Sequence": ".sequence",
    "SequenceStatus": ".sequence",
    "TinyTransformerPaged": ".model",
}
__all__ = list(MODULE_ATTRS)


def __getattr__(name: str) -> Any:
    if name not in MODULE_ATTRS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(MODULE_ATTRS[name], __name__), name)
    globals()[name] = value  # found at once from now on
    return value
