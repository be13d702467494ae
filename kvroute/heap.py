"""The garbage collector after start-up, for every long-running kvroute process (gateway, picker, worker)."""

from __future__ import annotations

import gc


def freeze_start_up_heap() -> None:
    """Put what start-up built (modules, the tokenizer and its templates, the pools, an engine's tables) in the
    collector's permanent generation (gc.freeze): its collections then walk only what serving allocated, where
    each full one walked every object start-up had left (docs/gateway.md, "CPU efficiency"; vLLM's engine does
    the same after its start-up). Call once, when start-up is done."""
    gc.collect()
    gc.freeze()
