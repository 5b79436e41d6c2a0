"""Time in the garbage collector, full collections and what it freed, via ``gc.callbacks``."""

from __future__ import annotations

import gc
import time
from typing import Any


class GcTimer:
    """Wall time spent in garbage collection, the full (generation 2) collections, and the objects the
    cyclic collector freed (garbage that reference counting left behind). One per process: read the
    counters before and after a measurement."""

    def __init__(self) -> None:
        self.total = 0.0
        self.full = 0
        self.collected = 0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.total += time.perf_counter() - self._start
        self.collected += info.get("collected", 0)
        if info.get("generation") == 2:
            self.full += 1


GC = GcTimer()
