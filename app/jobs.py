"""A replay run in a background thread, so the page stays responsive and a Cancel button can stop it.

The thread never touches Streamlit; the page polls `phase`, `done`, `total`, `record` and `error`.
A run has two steps the page shows apart: `loading` (torch, the model's code and the model, unless they
are loaded already, and the calibration profiles: `step` names the one in progress) and `replaying`
(progress after every batch). Cancelling
sets an event that is checked after loading and, by `fca.jobs.runs.run_replay(should_stop=...)`,
before every batch; `done` then says how many sequences were replayed when it stopped.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

from fca.tables.errors import CacheError, Cancelled, CorpusError, ExactnessError, ModelLoadError

# Errors whose message is the whole story (what the CLI prints after "fca: error:"); others keep their type.
SAID_AS_IS = (CacheError, CorpusError, ExactnessError, ModelLoadError, ValueError)

# Seconds to wait after each batch: lets a demo or the browser test watch the progress and press
# Cancel on a tiny cache whose batches take milliseconds. Unset (0) in normal use.
BATCH_DELAY_ENV = "FCA_REPLAY_BATCH_DELAY_S"

# The lab's quick mode: the fewest sequences that still give bootstrap CIs (`MIN_BOOTSTRAP_VALUES`), in
# batches of 2, so that the count moves well within the 2 s a reader waits without a sign of progress; the
# whole replay takes no longer than in one batch.
QUICK_SEQUENCES = 10
QUICK_BATCH = 2


@dataclass
class ReplayJob:
    settings: dict  # the keyword arguments of run_replay (what the CLI would be given)
    done: int = 0
    total: int = 0
    phase: str = "queued"  # queued -> loading -> replaying -> finished
    step: str = ""  # while loading: what is being loaded (the page shows it, so that a cold start is seen moving)
    started: float = field(default_factory=time.monotonic)
    record: dict | None = None
    error: str | None = None
    cancelled: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def progress(self, done: int, total: int) -> None:
        self.phase, self.done, self.total = "replaying", done, total
        delay = float(os.environ.get(BATCH_DELAY_ENV) or 0)
        if delay > 0:
            self.stop.wait(delay)  # a Cancel ends the wait: the next batch check sees it at once

    def start(
        self,
        run: Callable[..., dict],
        open_experiment: Callable[[], tuple[object, threading.Lock]] | None = None,
        preparing: Sequence[tuple[str, Callable[[], object]]] = (),
    ) -> ReplayJob:
        """The loading step: each of `preparing` ((what it loads, how), e.g. importing torch: here, in the
        thread, so that Run returns at once), then `open_experiment()` -> (experiment, its lock), the
        model loaded now unless it already was, then the experiment's calibration profiles; then the
        replay: `run(**settings, experiment=..., progress=..., should_stop=...)`. The lock is held from
        the profiles to the end. Without `open_experiment`, `run` gets neither experiment nor lock."""

        def steps() -> None:
            self.phase = "loading"
            for self.step, prepare in preparing:
                prepare()
            self.step = "the model, checked against the cache"
            experiment, lock = open_experiment() if open_experiment is not None else (None, None)
            with lock if lock is not None else nullcontext():
                if experiment is not None:
                    self.step = "the calibration profiles"
                    experiment.profiles()
                if self.stop.is_set():
                    raise Cancelled("replay cancelled before the first batch")
                self.phase = "replaying"
                given = {} if experiment is None else {"experiment": experiment}
                self.record = run(**self.settings, **given, progress=self.progress, should_stop=self.stop.is_set)

        def target() -> None:
            try:
                steps()
            except Cancelled:
                self.cancelled = True
            except SAID_AS_IS as err:  # a one-line message for the user, as the CLI prints it
                self.error = str(err)
            except Exception as err:  # shown on the page; the thread must never die silently
                self.error = f"{type(err).__name__}: {err}"
            finally:
                self.phase = "finished"

        self.started = time.monotonic()
        self.thread = threading.Thread(target=target, name="fca-replay", daemon=True)
        self.thread.start()
        return self

    def wait(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)
