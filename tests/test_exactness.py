"""Exactness that travels: the replay mechanism check, the cache fidelity check, environments.

The shipped demo is replayed here as a user on this machine would: whatever machine wrote it, the audit
must reproduce its report. Foreign environments are simulated by rewriting a cache's coefficients and
its environment record.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import fca
from fca.cli import main
from fca.engine.environment import current_environment
from fca.engine.replay import check_exactness, run_conditions
from fca.engine.sites import find_sites
from fca.jobs.experiment import Experiment
from fca.tables.audit_report import Exactness
from fca.tables.environment import describe, same_environment
from fca.tables.errors import CacheError
from fca.tables.fidelity import FidelityError, FidelityMeasure, calibration_origin, check_dtype, tolerances
from fca.tables.profiles import cache_moments, calibration_profiles
from fca.tables.report import exactness_sentences
from fca.tables.schema import MANIFEST, file_sha256
from fca.tables.stats import variance_decomposition
from fca.tables.store import open_cache

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "cache" / "demo"
FOREIGN = {
    "device_type": "cuda",
    "device_name": "NVIDIA H200",
    "capability": "sm_90",
    "model_dtype": "float32",
    "torch": "2.11.0+cu130",
    "cuda": "13.0",
    "threads": None,
    "numerics": "default",
    "batch_size": 4,
}


def rewrite_cache(
    src: Path,
    dst: Path,
    relative_noise: float,
    environment: dict | None,
    seed: int = 0,
    nll_offset: float = 0.0,
    token_offset: int = 0,
) -> Path:
    """A copy of the cache at `src` whose coefficients are scaled by (1 + relative_noise * u), u uniform in
    [-1, 1], whose stored live NLL is moved by `nll_offset` and token ids by `token_offset`, and whose
    manifest names `environment`; part hashes are updated so the copy opens cleanly."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / MANIFEST).read_text())
    rng = np.random.default_rng(seed)
    for part in manifest["parts"]:
        path = dst / part["file"]
        table = pq.read_table(path)
        for name in manifest["sites"]:
            column = table.column(name).combine_chunks()
            values = column.flatten().to_numpy().astype(np.float32)
            noisy = (values * (1 + relative_noise * rng.uniform(-1, 1, values.shape))).astype(np.float32)
            noisy_column = pa.FixedSizeListArray.from_arrays(pa.array(noisy), type=column.type)
            table = table.set_column(table.schema.get_field_index(name), table.schema.field(name), noisy_column)
        nll = pa.array(table.column("live_nll").to_numpy() + np.float32(nll_offset))
        table = table.set_column(table.schema.get_field_index("live_nll"), table.schema.field("live_nll"), nll)
        tokens = pa.array(table.column("token").to_numpy() + np.int32(token_offset))
        table = table.set_column(table.schema.get_field_index("token"), table.schema.field("token"), tokens)
        pq.write_table(table, path, compression="zstd")
        part["sha256"], part["bytes"] = file_sha256(path), path.stat().st_size
    manifest["environment"] = environment
    (dst / MANIFEST).write_text(json.dumps(manifest))
    return dst


def replay_cli(model: Path, cache: Path, calibration: Path, *extra: str) -> int:
    return main(
        [
            "replay",
            "--model",
            str(model),
            "--cache",
            str(cache),
            "--calibration",
            str(calibration),
            "--conditions",
            "static_layer",
            "--num-seqs",
            "8",
            "--batch",
            "4",
            "--no-save",
            "--device",
            "cpu",
            *extra,
        ]
    )


# ------------------------------------------------------------------ the shipped demo, replayed here


@pytest.mark.slow
def test_shipped_demo_audit_reproduces_its_report(tmp_path):
    """The full re-audit (every condition on all 256 windows): CI runs it; the everyday run replays 32
    windows of the same caches (the test below)."""
    shipped = json.loads((DEMO / "audit.json").read_text())
    assert (
        main(
            [
                "audit",
                "--model",
                str(DEMO / "featuregate"),
                "--cache",
                str(DEMO / "eval"),
                "--calibration",
                str(DEMO / "calibration"),
                "--device",
                "cpu",
                "--json",
                str(tmp_path / "audit.json"),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "audit.json").read_text())
    for name, row in shipped["conditions"].items():
        assert report["conditions"][name]["nll"] == pytest.approx(row["nll"], abs=1e-4), name
        assert report["conditions"][name]["penalty"] == pytest.approx(row["penalty"], abs=1e-4), name
    assert report["gap_retention"]["static_layer"] == pytest.approx(shipped["gap_retention"]["static_layer"], abs=1e-3)
    # The demo's windows are 37 chapters: the CIs that resample them, and gap retention's, as shipped.
    assert report["cache"]["documents"] == shipped["cache"]["documents"] == 37
    for name, row in shipped["conditions"].items():
        assert report["conditions"][name]["penalty_ci95_documents"] == pytest.approx(
            row["penalty_ci95_documents"], abs=1e-4
        )
    assert report["gap_retention_ci95"]["static_layer"] == pytest.approx(
        shipped["gap_retention_ci95"]["static_layer"], abs=1e-3
    )
    for point in report["interpolation_sweep"]:  # the sweep's points carry their condition's interval over documents
        assert point["penalty_ci95_documents"] == report["conditions"][point["condition"]]["penalty_ci95_documents"]
    assert report["variance"]["layer_identity_share"] == pytest.approx(
        shipped["variance"]["layer_identity_share"], abs=1e-6
    )
    ex = report["exactness"]
    assert ex["max_abs_logit_diff"] == 0.0 and ex["nll_live"] == ex["nll_correct"]
    fidelity = ex["fidelity"]
    assert fidelity["verdict"] in ("bit-identical", "within tolerance")
    assert fidelity["max_rel_coefficient_diff"] <= fidelity["tolerances"].get("coefficient_rel", 0.0)
    assert fidelity["computed_on"] == open_cache(DEMO / "eval").environment
    assert fidelity["replayed_on_text"] == describe(fidelity["replayed_on"])
    assert fidelity["replayed_on"]["device_type"] == "cpu"


def shipped_replay(num_seqs: int) -> int:
    args = ["replay", "--model", str(DEMO / "featuregate"), "--cache", str(DEMO / "eval"), "--calibration"]
    args += [str(DEMO / "calibration"), "--conditions", "static_layer", "--num-seqs", str(num_seqs), "--no-save"]
    return main([*args, "--device", "cpu"])


def test_the_shipped_demo_replays_here_and_its_stored_figures_are_its_reports(capsys):
    """The everyday check of the shipped demo: its caches replay here (the mechanism check, and their fidelity
    to what this machine records, or the command fails) on their first 32 windows, and the figures its audit
    read from their stored statistics are those it shipped (the full re-audit above is slow)."""
    shipped = json.loads((DEMO / "audit.json").read_text())
    variance = variance_decomposition(*cache_moments(open_cache(DEMO / "eval")))  # from its stored moments
    assert variance["layer_identity_share"] == pytest.approx(shipped["variance"]["layer_identity_share"], rel=1e-12)
    assert variance["factors"] == pytest.approx(shipped["variance"]["factors"], rel=1e-12)
    assert variance["per_slot_share"] == pytest.approx(shipped["variance"]["per_slot_share"], rel=1e-12)
    family_means = calibration_profiles(open_cache(DEMO / "calibration")).family_means
    assert family_means == pytest.approx(shipped["calibration"]["family_grand_means"], rel=1e-12)
    assert shipped_replay(32) == 0
    out = capsys.readouterr().out
    assert "reproduces the live logits (max |difference| 0, tolerance 1e-06" in out
    assert re.search(r"^static_layer  NLL \d\.\d{4}  penalty \+0\.\d{4} \[\+0\.\d{4}, \+0\.\d{4}\]", out, re.M)


@pytest.mark.slow
def test_replaying_the_shipped_demo_prints_the_interval_over_its_documents(capsys):
    """96 windows of the demo lie in 10 chapters: fca replay prints the penalty's CI over them before the one
    over sequences, and says why (64 windows, 7 chapters: too few for one)."""
    assert shipped_replay(96) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("static_layer"))
    assert re.search(
        r"penalty \+0\.\d{4} \[\+0\.\d{4}, \+0\.\d{4}\] over documents, \[\+0\.\d{4}, \+0\.\d{4}\] over sequences$",
        line,
    )
    assert "The 96 evaluated windows are consecutive stretches of 10 documents" in out


# ------------------------------------------------------------------ simulated foreign environments


def test_foreign_cache_within_drift_is_accepted(demo_pair, tmp_path, capsys):
    model_dir, ev, cal = demo_pair
    foreign = rewrite_cache(ev, tmp_path / "foreign", 2e-7, FOREIGN)
    assert replay_cli(model_dir, foreign, cal) == 0
    out = capsys.readouterr().out
    assert "computed on cuda NVIDIA H200" in out and "replayed on cpu" in out and "accepted" in out
    results = run_conditions(
        fca.load_model(model_dir), open_cache(foreign), [fca.tables.conditions.Condition("correct")], batch_size=4
    )
    fidelity = check_exactness(results)["fidelity"]
    assert fidelity["verdict"] == "within tolerance" and not fidelity["same_environment"]
    assert 0 < fidelity["max_rel_coefficient_diff"] < 1e-6 and fidelity["differing_coefficients"] > 0
    assert fidelity["nll_diff"] < 1e-5 and results.max_abs_logit_diff == 0.0


def test_inspect_says_what_a_replay_here_would_hold_the_cache_to(demo_pair, tmp_path, capsys):
    """Before anything runs, `fca inspect` compares the cache's environment with this machine's, as a
    replay would: its own caches bit for bit, a foreign one by the tolerances, naming what differs."""
    model_dir, ev, cal = demo_pair
    assert main(["inspect", str(ev), "--device", "cpu"]) == 0
    here = describe(current_environment(fca.load_model(model_dir)))
    out = capsys.readouterr().out
    assert f"a replay here ({here}) would find the cache's own environment: in its build's batches" in out
    assert "end-of-document id 0: reports give CIs over the documents the windows lie in" in out
    foreign = rewrite_cache(ev, tmp_path / "foreign", 0.0, FOREIGN)
    assert main(["inspect", str(foreign), "--device", "cpu"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("a replay here"))
    assert (
        "another environment (device, device name, CPU capability or GPU architecture, torch, CUDA, threads differ)"
        in line
    )
    assert "accepted within 0.0001 relative and Correct-from-cache NLL within 0.0001 nats of live" in line
    unknown = rewrite_cache(ev, tmp_path / "unknown", 0.0, None)
    assert main(["inspect", str(unknown), "--device", "cpu"]) == 0
    assert "would find a cache of unknown environment: its coefficients are accepted within" in capsys.readouterr().out
    # The standard follows the model's dtype and the cache's storage (a float16-stored cache: one unit wider).
    from fca.engine.environment import environment_on
    from fca.tables.fidelity import replay_standard

    bf16_here = environment_on(torch.device("cpu"), "bfloat16")
    assert bf16_here["model_dtype"] == "bfloat16" and bf16_here["device_type"] == "cpu"
    assert "accepted within 0.0011 relative" in replay_standard(
        FOREIGN, current_environment(fca.load_model(model_dir)), "float16"
    )
    bf16_cache = {**FOREIGN, "model_dtype": "bfloat16"}  # a bfloat16 model's cache, stored in 16 bits
    assert "accepted within 0.068 relative and Correct-from-cache NLL within 0.098 nats" in replay_standard(
        bf16_cache, bf16_here, "bfloat16"
    )
    if not torch.cuda.is_available():  # refused before anything is printed
        assert main(["inspect", str(ev), "--device", "cuda"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and "no CUDA device is available" in captured.err


@pytest.mark.slow
def test_foreign_cache_beyond_drift_is_refused(demo_pair, tmp_path, capsys):
    model_dir, ev, cal = demo_pair
    wrong = rewrite_cache(ev, tmp_path / "wrong", 1e-3, FOREIGN)
    assert replay_cli(model_dir, wrong, cal) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fca: error")]
    assert len(err) == 1 and str(wrong) in err[0]
    err = err[0]
    assert "computed on cuda NVIDIA H200" in err and "replayed on cpu" in err and "rebuild the cache" in err
    with pytest.raises(FidelityError, match="relative coefficient difference"):
        check_exactness(
            run_conditions(
                fca.load_model(model_dir), open_cache(wrong), [fca.tables.conditions.Condition("correct")], batch_size=4
            )
        )


def test_each_bound_of_a_foreign_cache_refuses_it_by_name():
    """Each tolerance just exceeded on its own, the others met, refuses a foreign cache naming that bound:
    without the NLL bounds (mean and per sequence), every other test still passed."""
    from fca.tables.fidelity import FidelityMeasure, judge_fidelity, tolerances

    here = {**FOREIGN, "device_type": "cpu", "device_name": "cpu", "capability": "avx512", "cuda": None}
    tol = tolerances("float32", "float32")
    live = np.full(64, 3.0)  # (one sequence off by the per-sequence bound moves the mean by 1/64 of it)

    def judge(rel=0.0, mean_shift=0.0, one_shift=0.0, stored=0.0) -> dict:
        measure = FidelityMeasure(stored_live_nll_max_diff=stored, same_batches=True)
        measure.add_site("blocks.0.gate", rel, rel, differing=1, compared=100)
        cached = live + mean_shift
        cached[0] += one_shift  # one sequence off, the mean hardly
        return judge_fidelity("c", measure, live, cached, FOREIGN, here)

    assert judge(rel=0.9 * tol["coefficient_rel"], mean_shift=0.9 * tol["nll_mean"])["verdict"] == "within tolerance"
    for kwargs, said in (
        ({"rel": 1.1 * tol["coefficient_rel"]}, "max relative coefficient difference"),
        ({"mean_shift": 1.1 * tol["nll_mean"]}, "Correct-from-cache NLL difference"),
        ({"one_shift": 1.1 * tol["nll_seq"]}, "per-sequence NLL difference"),
        ({"stored": 1.1 * tol["nll_token"]}, "stored live NLL difference per token"),
    ):
        with pytest.raises(FidelityError, match=re.escape(f"beyond floating-point drift ({said} ")):
            judge(**kwargs)


@pytest.mark.slow
def test_same_environment_must_be_bit_identical(demo_pair, tmp_path, capsys):
    model_dir, ev, cal = demo_pair
    here = open_cache(ev).environment
    assert same_environment(here, current_environment(fca.load_model(model_dir)))
    drifted = rewrite_cache(ev, tmp_path / "drifted", 2e-7, here)  # drift a foreign cache may have, claimed as ours
    assert replay_cli(model_dir, drifted, cal) == 2
    err = capsys.readouterr().err
    assert "records as this very environment" in err and "not this model's output" in err
    assert "or was computed under settings its manifest does not record" in err
    # The very same cache in other batches than the build's is judged by the tolerances instead.
    assert replay_cli(model_dir, drifted, cal, "--batch", "3") == 0
    # ... but only those batches: one partial batch at the end had let every batch through.
    assert replay_cli(model_dir, drifted, cal, "--num-seqs", "6") == 2
    assert "this very environment and in batches of the build" in capsys.readouterr().err
    nudged = rewrite_cache(ev, tmp_path / "nudged", 0.0, here, nll_offset=1e-3)  # a stored NLL counts too
    assert replay_cli(model_dir, nudged, cal, "--num-seqs", "6") == 2
    err = capsys.readouterr().err
    assert "this very environment and in batches of the build" in err and "cached live NLL differs" in err
    # Without --batch, a replay and an audit take the build's batches (4 here; the default of 16 was
    # another batching, and let this cache through on the tolerances).
    assert open_cache(drifted).environment["batch_size"] == 4
    bare = ["--model", str(model_dir), "--cache", str(drifted), "--calibration", str(cal), "--device", "cpu"]
    capsys.readouterr()
    assert main(["replay", *bare, "--no-save"]) == 2
    assert main(["audit", *bare, "--json", str(tmp_path / "audit.json")]) == 2
    assert capsys.readouterr().err.count("records as this very environment") == 2
    assert not (tmp_path / "audit.json").exists()
    # Only the stored live NLL changed: the refusal says so, not that the coefficients differ.
    renamed = rewrite_cache(ev, tmp_path / "renamed_nll", 0.0, here, nll_offset=1e-3)
    assert replay_cli(model_dir, renamed, cal) == 2
    assert "the cached live NLL differs from the one computed now" in capsys.readouterr().err
    # Beyond drift in other batches: not a matter of rebuilding "in this environment", which it already is.
    changed = rewrite_cache(ev, tmp_path / "changed_nll", 0.0, here, nll_offset=3.0)
    assert replay_cli(model_dir, changed, cal, "--batch", "3") == 2
    err = capsys.readouterr().err
    assert "stored live NLL difference per token 3 > 0.01" in err and "this very environment" in err
    assert "not this model's output" in err and "in this environment" not in err


@pytest.mark.slow
def test_settings_that_choose_kernels_are_part_of_the_environment(demo_pair, tmp_path, monkeypatch, capsys):
    """A build under oneDNN's instruction-set limit (or TF32, or a lower float32 matmul precision) runs other
    kernels on the same device: the manifest records it, and a replay without it judges the cache as
    foreign (by the tolerances), naming what differs, instead of refusing it as not this model's output."""
    model_dir, ev, cal = demo_pair
    here = open_cache(ev).environment
    assert here["numerics"] == "default"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert current_environment(fca.load_model(model_dir))["numerics"] == "oneDNN ISA AVX2"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    limited = rewrite_cache(ev, tmp_path / "limited", 2e-7, {**here, "numerics": "oneDNN ISA AVX2"})
    assert replay_cli(model_dir, limited, cal) == 0
    out = capsys.readouterr().out
    assert "oneDNN ISA AVX2" in out and "a foreign cache: the environments differ in numeric settings" in out
    # A record that does not say its numeric settings is not assumed to have used the defaults: foreign,
    # judged by the tolerances, never held to bit-identity on a guess.
    unsaid = rewrite_cache(ev, tmp_path / "unsaid", 2e-7, {k: v for k, v in here.items() if k != "numerics"})
    assert not same_environment(open_cache(unsaid).environment, here)
    assert replay_cli(model_dir, unsaid, cal) == 0
    assert "the environments differ in numeric settings" in capsys.readouterr().out
    one = describe({**here, "threads": 1})
    assert f"({here['capability']}, 1 thread)," in one and "threads" not in one


@pytest.mark.slow
def test_a_foreign_calibration_cache_is_said_to_be_foreign(demo_pair, tmp_path, capsys):
    """Its origin appeared only in the report's JSON: the CLI and the Markdown said nothing of it."""
    model_dir, ev, cal = demo_pair
    foreign_cal = rewrite_cache(cal, tmp_path / "foreign_cal", 0.0, FOREIGN)
    assert replay_cli(model_dir, ev, foreign_cal) == 0
    out = capsys.readouterr().out
    assert "Calibration cache: computed on cuda NVIDIA H200 (sm_90, CUDA 13.0), float32, torch 2.11.0+cu130 (a " in out
    assert "foreign cache: the environments differ in device, device name, CPU capability" in out
    assert replay_cli(model_dir, ev, cal) == 0
    said = capsys.readouterr().out
    assert "Calibration cache: computed on cpu" in said and "fidelity is not measured" in said
    assert "foreign" not in said  # both caches built here


def test_differences_are_counted_where_the_build_batched(demo_pair, tmp_path):
    """What the partial-batch rule rests on: each batch's differences are counted for the build's batches,
    and a sharded run's merge keeps the count."""
    model_dir, ev, cal = demo_pair
    foreign = rewrite_cache(ev, tmp_path / "foreign", 2e-7, FOREIGN)  # built in batches of 4, replayed so
    fid = Experiment.open(model_dir, foreign, cal).run(["correct"], num_seqs=8, batch_size=4).exactness["fidelity"]
    assert fid["differing_in_build_batches"] == fid["differing_coefficients"] > 0
    merged = FidelityMeasure(differing_in_build_batches=2)
    merged.merge(FidelityMeasure(differing_in_build_batches=3))
    assert merged.differing_in_build_batches == 5
    here = {**FOREIGN, "device_type": "cpu"}
    assert calibration_origin(FOREIGN, FOREIGN)["same_environment"]
    assert (
        not calibration_origin(FOREIGN, here)["same_environment"]
        and not calibration_origin(None, here)["same_environment"]
    )


def _fidelity_sentence(**changes) -> str:
    """The fidelity sentence of a foreign float16 cache accepted within tolerance, with `changes`."""
    fid = {
        "verdict": "within tolerance",
        "tolerances": tolerances("float32", "float16"),
        "same_environment": False,
        "same_batches": False,
        "computed_on": FOREIGN,
        "replayed_on": {},
        "computed_on_text": "X",
        "replayed_on_text": "Y",
        "max_abs_coefficient_diff": 1e-7,
        "max_rel_coefficient_diff": 1e-6,
        "differing_coefficients": 1,
        "coefficients_compared": 8,
        "per_site_max_abs_diff": {},
        "nll_live": 3.0,
        "nll_correct_from_cache": 3.0,
        "nll_diff": 1e-6,
        "max_seq_nll_diff": 1e-6,
        "stored_live_nll_max_diff": 0.0,
        "coefficient_dtype": "float16",
        "differing_fields": ["device"],
        **changes,
    }
    ex = {"max_abs_logit_diff": 0.0, "tolerance": 1e-6, "nll_live": 3.0, "nll_correct": 3.0, "mechanism": {}}
    return exactness_sentences(Exactness.read({**ex, "fidelity": fid}, "exactness"))[1]


def test_the_fidelity_sentence_says_why_differences_were_accepted():
    assert "another environment, so floating-point reduction order differs" in _fidelity_sentence()
    assert "an environment the cache does not record" in _fidelity_sentence(computed_on=None, differing_fields=[])
    assert "(any batch of the build is held to bit-identity)" in _fidelity_sentence(same_environment=True)
    assert "tolerance 0.0011)" in _fidelity_sentence()  # 1e-4 + one float16 unit, rounded (it printed 0.00107656)
    drifted = _fidelity_sentence(stored_live_nll_max_diff=2e-3)
    assert "the stored live NLL by up to 0.002 nats per token (tolerance 0.01)" in drifted
    assert "stored live NLL" not in _fidelity_sentence()


def test_a_damaged_live_nll_column_is_refused_in_a_foreign_cache(demo_pair, tmp_path, capsys):
    model_dir, ev, cal = demo_pair
    damaged = rewrite_cache(ev, tmp_path / "damaged", 2e-7, FOREIGN, nll_offset=3.0)
    assert replay_cli(model_dir, damaged, cal) == 2
    assert "stored live NLL difference per token 3 > 0.01" in capsys.readouterr().err
    unreadable = rewrite_cache(ev, tmp_path / "nan", 2e-7, FOREIGN, nll_offset=float("nan"))  # NaN, not skipped
    assert replay_cli(model_dir, unreadable, cal) == 2
    assert "stored live NLL difference per token inf > 0.01" in capsys.readouterr().err
    # Token ids beyond the vocabulary (hashes updated to match) are refused by name, not as a torch IndexError.
    beyond = rewrite_cache(ev, tmp_path / "beyond", 0.0, FOREIGN, token_offset=100_000)
    assert replay_cli(model_dir, beyond, cal) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"fca: error: {beyond}: sequences") and "outside the model's vocabulary [0, 320)" in err
    # The same cache's statistics (the Variance page) and execution probe ("Measure now") failed with an
    # IndexError (an exception box in the dashboard).
    from fca.jobs.experiment import Experiment
    from fca.tables.profiles import scan_moments, slot_layout

    with pytest.raises(CacheError, match=r"token ids from \d+ to \d+, outside its vocabulary \[0, 320\)"):
        scan_moments(open_cache(beyond), slot_layout(open_cache(beyond)))
    with pytest.raises(CacheError, match=r"outside the model's vocabulary \[0, 320\)"):
        Experiment.open(model_dir, beyond, None).measure_execution(runs=1)


@pytest.mark.parametrize(
    "environment, problem",
    [
        ("cuda", "'environment' must be an object"),
        ([1, 2], "'environment' must be an object"),
        ({**FOREIGN, "batch_size": "4"}, "environment 'batch_size' must be a whole number"),
        ({**FOREIGN, "batch_size": -16}, "environment 'batch_size' must be a whole number of at least 1"),
        ({**FOREIGN, "threads": 0}, "environment 'threads' must be a whole number of at least 1"),
        ({**FOREIGN, "model_dtype": "bfloat16"}, "model dtype float32, but its environment says bfloat16"),
    ],
)
def test_a_malformed_or_contradictory_environment_is_one_line(demo_pair, tmp_path, capsys, environment, problem):
    model_dir, ev, cal = demo_pair
    bad = rewrite_cache(ev, tmp_path / "bad", 0.0, environment)
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fca: error: {bad / MANIFEST}") and problem in err and "\n" not in err


def test_dtype_change_is_refused(demo_pair, capsys):
    model_dir, ev, cal = demo_pair
    assert (
        main(
            [
                "audit",
                "--model",
                str(model_dir),
                "--cache",
                str(ev),
                "--calibration",
                str(cal),
                "--dtype",
                "bfloat16",
                "--device",
                "cpu",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "recorded with a float32 model" in err and "bfloat16" in err and str(ev) in err
    with pytest.raises(FidelityError):
        check_dtype("x", "bfloat16", "float32")


def test_tolerances_by_dtype():
    assert tolerances("float32", "float32")["coefficient_rel"] == 1e-4
    assert tolerances("float32", "float16")["coefficient_rel"] > 2.0**-10  # one storage unit more
    assert tolerances("bfloat16", "float32")["coefficient_rel"] > tolerances("float32", "float32")["coefficient_rel"]
    # The allowances as the report's definition states them: u, 10u and 50u, none on the per-token NLL.
    u, base = 2.0**-10, tolerances("float32", "float32")
    added = {k: v - base[k] for k, v in tolerances("float32", "float16").items()}
    assert added == pytest.approx({"coefficient_rel": u, "nll_mean": 10 * u, "nll_seq": 50 * u, "nll_token": 0.0})
    # A replay's batches default to the build's, else 16 (a cache that does not record them).
    from types import SimpleNamespace

    from fca.jobs.experiment import Experiment

    def batch(environment, asked=None):
        return Experiment.batch_size_for(SimpleNamespace(evaluated=SimpleNamespace(environment=environment)), asked)

    assert (batch(None), batch({"batch_size": 8}), batch({"batch_size": 8}, 3), batch({})) == (16, 8, 3, 16)


def test_new_caches_record_their_environment(demo_pair):
    model_dir, ev, _ = demo_pair
    env = open_cache(ev).environment
    assert env["device_type"] == "cpu" and env["model_dtype"] == "float32" and env["batch_size"] == 4
    assert env["torch"] == torch.__version__ and env["threads"] == torch.get_num_threads() and env["capability"]
    assert "cpu" in describe(env) and "threads" in describe(env)
    assert describe(None).startswith("an unknown environment")


# ------------------------------------------------------------------ strided inputs


def test_replay_does_not_depend_on_input_layout(demo_pair):
    model_dir, ev, _ = demo_pair
    model = fca.load_model(model_dir)
    ids = open_cache(ev).read_seqs([0, 1, 2], sites=[])["token"]
    own = fca.capture(model, ids)
    stacked = np.concatenate(list(own.values()), axis=-1)  # [B, T, sum K]: per-site slices are strided views
    bounds = np.cumsum([0] + [v.shape[-1] for v in own.values()])
    strided = {name: stacked[..., lo:hi] for name, lo, hi in zip(own, bounds[:-1], bounds[1:])}
    assert not any(v.flags["C_CONTIGUOUS"] for v in strided.values())
    as_tensors = {name: torch.from_numpy(stacked)[..., lo:hi] for name, lo, hi in zip(own, bounds[:-1], bounds[1:])}
    reference = fca.replay(model, ids, own)
    assert torch.equal(fca.replay(model, ids, strided), reference)
    assert torch.equal(fca.replay(model, ids, as_tensors), reference)
    assert torch.equal(reference, model(torch.from_numpy(ids).long()).logits)


def test_replay_moves_each_site_when_the_forward_reaches_it(demo_pair, monkeypatch):
    """Coefficients go to the device site by site as the forward asks for them (on CUDA, so that the host
    copies overlap the layers before), never all before it: each site is moved after the sites before
    it have run, only the sites replayed are moved, and the logits are those of the live pass."""
    from fca.engine import replay as replay_module

    model_dir, ev, _ = demo_pair
    model = fca.load_model(model_dir)
    ids = open_cache(ev).read_seqs([0, 1], sites=[])["token"]
    own = fca.capture(model, ids)  # site -> [B, T, K], in execution order
    events: list[tuple[str, str]] = []
    real_move = replay_module.DeviceCoefficients.__missing__

    def move(self, name):
        events.append(("move", name))
        return real_move(self, name)

    monkeypatch.setattr(replay_module.DeviceCoefficients, "__missing__", move)
    hooks = [
        site.register_forward_hook(lambda module, args, out, name=name: events.append(("ran", name)))
        for name, site in find_sites(model).items()
    ]
    try:
        first, last = list(own)[0], list(own)[-1]
        logits = fca.replay(model, ids, own)
        assert events == [event for name in own for event in (("move", name), ("ran", name))]
        events.clear()
        fca.replay(model, ids, own, only={last})
        assert ("move", first) not in events and events.index(("move", last)) > events.index(("ran", first))
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(logits, model(torch.from_numpy(ids).long()).logits)


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def demo_pair(tmp_path_factory):
    """A tiny model with eval and calibration caches built here in batches of 4."""
    from fca.jobs.build import build_cache_from_corpus

    from .helpers import make_model_dir, write_corpus

    root = tmp_path_factory.mktemp("exactness")
    corpus = write_corpus(root / "prose.txt")
    make_model_dir(root / "featuregate", corpus)
    for split in ("eval", "calibration"):
        build_cache_from_corpus(
            root / "featuregate",
            corpus,
            split,
            root / split,
            num_seqs=8,
            batch_size=4,
            device="cpu",
            show_progress=False,
        )
    calibration_profiles(open_cache(root / "calibration"))  # the calibration cache opens and profiles cleanly
    return root / "featuregate", root / "eval", root / "calibration"


def test_a_read_only_cache_is_replayed_without_losing_the_run(demo_pair, tmp_path, monkeypatch, capsys):
    """A cache on a read-only mount: a replay that would save beside it is refused before it starts (not
    after minutes of replay), `--no-save` replays it, and an audit refuses a report path there up front.
    (Tests run as root, whom permission bits do not stop: the read-only mount is what `os.access` says.)"""
    import os

    model_dir, ev, cal = demo_pair
    mount = tmp_path / "mount"
    mount.mkdir()
    shutil.copytree(ev, mount / "eval")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: real_access(p, mode) and not str(p).startswith(str(mount)))
    started = []
    monkeypatch.setattr("fca.jobs.experiment.run_conditions", lambda *a, **k: started.append(1))
    saving = ["replay", "--model", str(model_dir), "--cache", str(mount / "eval"), "--calibration", str(cal)]
    assert main([*saving, "--num-seqs", "8", "--batch", "4", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"{mount}: not writable" in err and "--no-save" in err and started == []
    monkeypatch.undo()
    monkeypatch.setattr(os, "access", lambda p, mode: real_access(p, mode) and not str(p).startswith(str(mount)))
    assert replay_cli(model_dir, mount / "eval", cal) == 0  # (with --no-save)
    args = ["audit", "--model", str(model_dir), "--cache", str(mount / "eval"), "--calibration", str(cal)]
    assert main([*args, "--json", str(mount / "audit.json")]) == 2
    assert f"its folder {mount} is not writable" in capsys.readouterr().err


def test_caches_of_two_model_dtypes_are_refused_together_with_the_right_advice(demo_pair, tmp_path):
    model_dir, ev, cal = demo_pair
    other = rewrite_cache(cal, tmp_path / "bf16cal", 0.0, {**open_cache(cal).environment, "model_dtype": "bfloat16"})
    manifest = json.loads((other / MANIFEST).read_text())
    manifest["model"]["dtype"] = "bfloat16"
    (other / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CacheError, match="recorded with a bfloat16 model, the evaluated cache with a float32 one"):
        fca.Experiment.open(model_dir, ev, other)


def test_the_newer_precision_api_is_recorded_not_a_crash():
    """torch refuses the legacy float32-precision read once `torch.backends.fp32_precision` is set."""
    import torch

    from fca.engine.environment import numerics
    from fca.tables.catalog import is_dense_twin

    try:
        torch.backends.fp32_precision = "tf32"
        assert "float32 matmul precision per backend (tf32)" in numerics(torch.device("cpu"))
    finally:
        torch.backends.fp32_precision = "none"
    assert numerics(torch.device("cpu")) == "default"
    gated = {"model_type": "featuregate", "gated": True, "d_model": 32, "mlp_groups": 6}
    assert is_dense_twin(gated, {**gated, "gated": False, "mlp_groups": 4})  # gate granularity is no size
    assert not is_dense_twin(gated, {**gated, "gated": False, "d_model": 48})


# ------------------------------------------------------------------ which replay is Correct-from-cache


@pytest.mark.slow
def test_correct_is_scored_from_the_cache_whenever_the_cache_is_not_the_recorded_pass(demo_pair, tmp_path):
    """Correct's NLL (and the fidelity check's Correct-from-cache) is the replay of the cached coefficients.
    Only when they equal the pass just recorded, value for value in float32, is that pass's replay reused:
    not for a cache rounded to float16 on storage, nor for a foreign cache that drifted."""
    model_dir, ev, _ = demo_pair
    model = fca.load_model(model_dir)
    windows = open_cache(ev).read_seqs(list(range(8)), sites=[])
    windows = np.concatenate([windows["token"], windows["target"][:, -1:]], axis=1)  # [8, T + 1]
    rounded = fca.build_cache(model, windows, tmp_path / "f16", batch_size=4, coefficient_dtype="float16")
    drifted = rewrite_cache(ev, tmp_path / "drifted", 1e-3, FOREIGN)
    # (Correct not first: its row is found by what it is, not by where it stands)
    conditions = [fca.tables.conditions.Condition("static_layer"), fca.tables.conditions.Condition("correct")]
    profiles = calibration_profiles(open_cache(demo_pair[2]))
    for cache in (rounded, drifted):
        results = run_conditions(
            model, open_cache(cache), conditions, seqs=list(range(8)), batch_size=4, profiles=profiles
        )
        assert results.max_abs_logit_diff == 0.0  # the recorded pass replays exactly, as always
        assert not np.array_equal(results.cache_correct_per_seq, results.replayed_per_seq), cache
        np.testing.assert_array_equal(results.per_seq_nll["correct"], results.cache_correct_per_seq)
    # the cache that is the recorded pass: one replay serves both
    same = run_conditions(model, open_cache(ev), conditions, seqs=list(range(8)), batch_size=4, profiles=profiles)
    np.testing.assert_array_equal(same.cache_correct_per_seq, same.replayed_per_seq)
    np.testing.assert_array_equal(same.per_seq_nll["correct"], same.replayed_per_seq)
