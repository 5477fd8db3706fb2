"""A replay run in a background thread, so the page stays responsive and a Cancel button can stop it.

The thread never touches Streamlit; the page polls `done`, `total`, `record` and `error`. Cancelling
sets an event that `fca.jobs.runs.run_replay(should_stop=...)` checks between batches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from fca.tables.errors import Cancelled


@dataclass
class ReplayJob:
    settings: dict  # the keyword arguments of run_replay (what the CLI would be given)
    done: int = 0
    total: int = 0
    record: dict | None = None
    error: str | None = None
    cancelled: bool = False
    shown: bool = False  # the page has rerun once to show the finished result
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def progress(self, done: int, total: int) -> None:
        self.done, self.total = done, total

    def start(self, run: Callable[..., dict], lock: threading.Lock | None = None) -> "ReplayJob":
        def target() -> None:
            try:
                if lock is None:
                    self.record = run(**self.settings, progress=self.progress, should_stop=self.stop.is_set)
                else:
                    with lock:
                        self.record = run(**self.settings, progress=self.progress, should_stop=self.stop.is_set)
            except Cancelled:
                self.cancelled = True
            except Exception as err:  # shown on the page; the thread must never die silently
                self.error = f"{type(err).__name__}: {err}"

        self.thread = threading.Thread(target=target, name="fca-replay", daemon=True)
        self.thread.start()
        return self

    def wait(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)
