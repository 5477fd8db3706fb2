"""Replay runs: conditions scored on the frozen model and saved beside the cache they replayed
(`fca.tables.runs` names, saves and tabulates the records). The CLI (`python -m fca replay`) and the
dashboard's Replay lab both call `run_replay`, so the same settings give the same numbers from either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timezone

import torch

from fca.jobs.experiment import CacheSource, Experiment, ModelSource, check_condition_sites
from fca.tables.conditions import Condition, as_conditions
from fca.tables.runs import check_runs_writable, save_run


def run_replay(
    model: ModelSource | None,
    cache: CacheSource | None,
    calibration: CacheSource | None,
    conditions: Sequence[str | Condition],
    num_seqs: int = 32,
    seed: int = 0,
    device: str = "auto",
    batch_size: int | None = None,
    save: bool = True,
    dtype: torch.dtype | None = None,
    experiment: Experiment | None = None,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    show_progress: bool = False,
) -> dict:
    """Replay `conditions` (specs or Conditions; `correct` added if missing) on the first `num_seqs`
    sequences of the evaluated cache, and save the run beside it. Give an opened `experiment` (the
    dashboard keeps one per model and caches) or the model and both caches, as paths or objects. `dtype`:
    the model's (None: the precision the cache was recorded in). `batch_size` None: the batches the cache
    was built in (`Experiment.batch_size_for`)."""
    parsed = as_conditions(conditions, seed)
    parsed = list(dict.fromkeys([Condition("correct", seed=seed), *parsed]))
    if experiment is None:
        check_condition_sites(parsed, cache)
        experiment = Experiment.open(model, cache, calibration, device=device, dtype=dtype)
    # checked before the progress bar (a refusal is one line); the batch size is recorded in the run's spec
    parsed, n, batch_size = experiment.planned_run(parsed, num_seqs, batch_size, seed)
    if save:
        check_runs_writable(experiment.evaluated.path)  # before the replay, not after it
    from tqdm.auto import tqdm

    with tqdm(total=n, desc="replay", unit="seq", disable=not show_progress or progress is not None) as bar:
        if not bar.disable:  # (a caller's own `progress` is reported to instead)
            progress = lambda done, total: bar.update(done - bar.n)  # noqa: E731
        results = experiment.run(parsed, n, batch_size, seed, progress=progress, should_stop=should_stop)
    evaluated, calibrated = experiment.evaluated, experiment.calibration
    spec = {
        "model": experiment.name,
        "model_fingerprint": experiment.model_fingerprint,
        "cache": evaluated.path.name,
        "cache_fingerprint": evaluated.fingerprint,
        "calibration": calibrated.path.name if calibrated else None,
        "calibration_fingerprint": calibrated.fingerprint if calibrated else None,  # (a name may be reused)
        "conditions": [c.name for c in parsed],
        "num_seqs": n,
        "seed": seed,
        "batch_size": batch_size,
    }
    record = {
        "spec": spec,
        "results": {
            "exactness": results.exactness,
            **experiment.score(results, seed),  # (the audit's figures, computed as it computes them)
            "per_sequence_nll": {k: v.tolist() for k, v in results.per_seq_nll.items()},
        },
        # Milliseconds, because runs are listed newest first by this stamp and a run can take under a second.
        "created": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "device": str(experiment.device),
    }
    if save:
        record["path"] = str(save_run(evaluated.path, record))
    return record
