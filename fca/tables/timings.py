"""Where a cache build's time goes: seconds summed per stage, from every thread that works on it.

A build (`fca.engine.capture.write_cache(..., timings=Timings())`) adds its stages here; benches print
them beside the build-to-forward ratio, so a slow build says which stage made it slow. Stages run on
several threads at once (the forward's, a collector, writer threads), so their sum can exceed the wall
time: compare each stage with the wall time, and a waiting stage (`*_wait`) with the stage it waits on.
Timing costs two clock reads per stage, next to milliseconds of work.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Timings:
    """Seconds per stage name, summed over calls and threads (thread-safe)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        """`with timings("encode"): ...` adds the block's wall time to the stage, also when it raises."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start)

    def rounded(self, digits: int = 4) -> dict[str, float]:
        """The stages in the order first seen, rounded for reports."""
        with self._lock:
            return {stage: round(s, digits) for stage, s in self.seconds.items()}
