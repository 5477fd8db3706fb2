"""Replay lab: run conditions on the frozen model from the UI, save each run beside the cache."""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from app import figures, resources
from app.jobs import ReplayJob
from app.views.common import download, guard, require_cache, teach
from fca.jobs.runs import list_runs, run_replay
from fca.tables.conditions import Condition
from fca.tables.report import exactness_sentences

JOB_KEY = "replay_job"
KINDS = {
    "cross_input": "another sequence's coefficients (seeded derangement)",
    "token_shuffle": "positions shuffled within the sequence",
    "static_layer": "the calibration mean of each slot, at every token",
    "global_mean": "one grand mean per coefficient family, everywhere",
    "interpolate": "alpha x live + (1 - alpha) x static profile",
    "position_profile": "the calibration mean at each position",
}

sel = require_cache()
cache = sel.cache
st.title("Replay lab")
teach(
    "Here the controllers are switched off and the model is fed coefficients you choose. **Correct** (each token's "
    "own recorded coefficients) always runs and must reproduce the live model exactly; every other condition is "
    "scored by its **penalty**: the extra NLL in nats per token, with a 95% bootstrap CI over sequences. A penalty "
    "near zero means the model does not need what the controller computes per token. Each run is saved beside the "
    "cache, and the command below reproduces it from the CLI with the same numbers."
)

if sel.model_dir is None:
    st.error("The replay lab needs the model directory the cache names, beside the cache; none was found.")
    st.stop()

opened = None
with guard("Model"):
    opened = resources.experiment(sel.model_dir, sel.device, cache, sel.calibration_cache, sel.dense_dir)
if opened is None:
    st.stop()
if sel.calibration is None:
    st.error(
        "The replay lab needs a calibration cache of the same model (a different split) beside this one; none was found."
    )
    st.stop()
experiment, lock = opened
st.caption(
    f"Model `{sel.model_dir.name}` (fingerprint `{experiment.model_fingerprint[:12]}`) on **{experiment.device}** "
    f"matches the cache; calibration: `{sel.calibration.label}`."
)

job: ReplayJob | None = st.session_state.get(JOB_KEY)
busy = job is not None and job.running
with st.form("replay_settings", border=True):
    c1, c2 = st.columns([3, 2])
    kinds = c1.multiselect(
        "Conditions (correct always runs)",
        list(KINDS),
        default=["static_layer", "global_mean"],
        key="lab_kinds",
        help="; ".join(f"{k}: {v}" for k, v in KINDS.items()),
    )
    freeze = c2.multiselect(
        "Freeze only these sites (empty: all sites)",
        cache.sites,
        key="lab_sites",
        help="the other sites keep their correct coefficients",
    )
    c3, c4, c5, c6, c7 = st.columns(5)
    alpha = c3.slider(
        "alpha (interpolate)", 0.0, 1.0, 0.5, 0.05, key="lab_alpha", help="1 = live coefficients, 0 = static profile"
    )
    independent = c4.checkbox("token_shuffle: one permutation per site", key="lab_independent")
    num_seqs = int(c5.number_input("Sequences", 2, cache.num_seqs, min(16, cache.num_seqs), key="lab_num_seqs"))
    seed = int(c6.number_input("Seed", 0, 2**31 - 1, 0, key="lab_seed"))
    batch = int(c7.number_input("Batch size", 1, 256, 16, key="lab_batch"))
    submitted = st.form_submit_button("Run", type="primary", disabled=busy)

st.caption("  \n".join(f"**{k}**: {KINDS[k]}" for k in kinds))
specs = [
    Condition(
        kind,
        alpha if kind == "interpolate" else None,
        tuple(freeze) or None,
        kind == "token_shuffle" and independent,
        seed,
    ).spec
    for kind in kinds
]
settings = dict(
    model=str(sel.model_dir),
    cache=str(cache.path),
    calibration=str(sel.calibration.path),
    conditions=specs,
    num_seqs=num_seqs,
    seed=seed,
    device=sel.device,
    batch_size=batch,
)


def _rel(p: str) -> str:
    try:
        return str(Path(p).relative_to(Path.cwd()))
    except ValueError:
        return p


st.caption("The same run from the command line:")
st.code(
    "python -m fca replay "
    + " ".join(
        [
            f"--model {shlex.quote(_rel(settings['model']))}",
            f"--cache {shlex.quote(_rel(settings['cache']))}",
            f"--calibration {shlex.quote(_rel(settings['calibration']))}",
            "--conditions " + " ".join(shlex.quote(s) for s in ["correct", *specs]),
            f"--num-seqs {num_seqs}",
            f"--seed {seed}",
            f"--batch {batch}",
            f"--device {sel.device}",
        ]
    ),
    language="bash",
    wrap_lines=True,
)

if submitted and not busy:
    with guard("Replay"):
        job = ReplayJob(settings, total=num_seqs).start(lambda **kw: run_replay(**kw, experiment=experiment), lock)
        st.session_state[JOB_KEY] = job


@st.fragment(run_every=0.5 if (job is not None and job.running) else None)
def progress_panel() -> None:
    """Polls the background run; reruns the whole page once when it ends, to draw the results."""
    current: ReplayJob | None = st.session_state.get(JOB_KEY)
    if current is None:
        return
    if current.running:
        total = max(current.total, 1)
        text = (
            f"Replaying: {current.done} / {current.total} sequences"
            if current.done
            else "Starting: loading the model and profiles, then the first batch…"
        )
        st.progress(current.done / total, text=text)
        if st.button("Cancel", key="lab_cancel"):
            current.stop.set()
            st.toast("Cancelling after the current batch…")
    elif not current.shown:
        current.shown = True
        st.rerun()


progress_panel()

if job is not None and not job.running:
    if job.cancelled:
        st.warning("The run was cancelled; nothing was saved.")
    elif job.error:
        st.error(f"The run failed: {job.error}")
    elif job.record is not None:
        record = job.record
        mechanism, fidelity = exactness_sentences(record["results"]["exactness"])
        st.success(f"{mechanism}  \n{fidelity}  \nSaved `{_rel(record.get('path', ''))}`.")
        per_seq = record["results"]["per_sequence_nll"]
        rows = []
        for name, row in record["results"]["conditions"].items():
            values = np.asarray(per_seq[name])
            half = 1.96 * values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else 0.0
            rows.append(
                {
                    "condition": name,
                    "nll": row["nll"],
                    "ci_lo": row["nll"] - half,
                    "ci_hi": row["nll"] + half,
                    "penalty": row["penalty"],
                    "lo": row["penalty_ci95"][0],
                    "hi": row["penalty_ci95"][1],
                }
            )
        result = pd.DataFrame(rows)
        st.dataframe(result, hide_index=True, key="lab_result")
        left, right = st.columns(2)
        left.plotly_chart(
            figures.nll_bars(result, "NLL per condition (95% CI of the mean over sequences)"), key="lab_nll"
        )
        right.plotly_chart(figures.penalty_bars(result[result["condition"] != "correct"]), key="lab_penalty")
        download(result, "replay_result.csv")

st.subheader("Saved runs of this cache")
runs = list_runs(cache.path)
if not runs:
    st.caption(f"None yet. Runs are saved in `{_rel(str(cache.path))}.runs/`.")
else:
    table = pd.DataFrame(
        [
            {
                "run": Path(r["path"]).stem,
                "created": r.get("created"),
                "conditions": ", ".join(r["spec"]["conditions"]),
                "sequences": r["spec"]["num_seqs"],
                "seed": r["spec"]["seed"],
                "device": r.get("device"),
                "model ok": r["spec"].get("model_fingerprint") == cache.manifest.model.fingerprint,
            }
            for r in runs
        ]
    )
    st.dataframe(table, hide_index=True, key="lab_runs")
    chosen = st.multiselect("Compare runs", table["run"].tolist(), default=table["run"].tolist()[:2], key="lab_compare")
    long = pd.DataFrame(
        [
            {
                "run": Path(r["path"]).stem,
                "condition": name,
                "nll": row["nll"],
                "penalty": row["penalty"],
                "lo": row["penalty_ci95"][0],
                "hi": row["penalty_ci95"][1],
            }
            for r in runs
            if Path(r["path"]).stem in chosen
            for name, row in r["results"]["conditions"].items()
        ]
    )
    if len(long):
        st.plotly_chart(
            figures.penalty_bars(long[long["condition"] != "correct"], "Penalty vs correct, saved runs side by side"),
            key="lab_compare_chart",
        )
        download(long, "saved_runs.csv")
