"""How far a cache written in one environment is from what the model computes in this one.

    python -m bench.fidelity_drift --model cache/demo/featuregate --cache cache/demo/eval \
        --device cuda [--dtype bfloat16] [--num-seqs 64] [--batch 16] [--json PATH]

Runs both exactness checks on the first sequences of the cache and prints the measured drift (cached vs
recorded coefficients, Correct-from-cache vs live NLL) and the verdict, or the refusal with its reason.
Unlike the audit it does not stop at a refusal: its purpose is to measure the drift that the fidelity
tolerances (fca.tables.fidelity.FOREIGN_TOLERANCES) are derived from.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.output import emit
from fca.engine.replay import check_exactness
from fca.jobs.experiment import Experiment
from fca.tables.conditions import Condition
from fca.tables.fidelity import FidelityError

DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def measure(model_dir: str, cache_dir: str, device: str, dtype: str, num_seqs: int, batch: int) -> dict:
    experiment = Experiment.open(model_dir, cache_dir, None, device=device, dtype=DTYPES[dtype])
    results = experiment.run([Condition("correct")], num_seqs, batch, judge=False)  # judged below, refusals kept
    row = {"cache": Path(cache_dir).name, "num_seqs": len(results.seqs), "batch": batch}
    f = results.fidelity
    row.update(
        max_abs_logit_diff=results.max_abs_logit_diff,
        max_abs_coefficient_diff=f.max_abs_coefficient_diff,
        max_rel_coefficient_diff=f.max_rel_coefficient_diff,
        stored_live_nll_max_diff=f.stored_live_nll_max_diff,
        nll_diff=abs(float(results.cache_correct_per_seq.mean() - results.live_per_seq.mean())),
        max_seq_nll_diff=float(abs(results.cache_correct_per_seq - results.live_per_seq).max()),
    )
    try:
        judged = check_exactness(results)["fidelity"]
        row.update(
            verdict=judged["verdict"], computed_on=judged["computed_on_text"], replayed_on=judged["replayed_on_text"]
        )
    except FidelityError as err:
        row.update(verdict="refused", reason=str(err))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json")
    args = parser.parse_args()
    row = measure(args.model, args.cache, args.device, args.dtype, args.num_seqs, args.batch)
    emit(row, args.json)


if __name__ == "__main__":
    main()
