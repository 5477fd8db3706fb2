"""Multi-seed studies: the aggregation on hand-made audits (means, sample SDs, t intervals computed by
hand), refusal of audits made with other definitions, the `study` CLI, the Markdown page, the training
path shared by CPU and CUDA (smoke test: loss falls, a seed gives the same weights twice), and
`demo-study` end to end on a tiny configuration (real training, caches and audits)."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from fca.cli import main
from fca.tables import study
from fca.tables.audit_report import AuditReport
from fca.tables.outputs import OutputError
from fca.tables.study import StudyError, spread, t_quantile_975

DEMO = Path(__file__).resolve().parent.parent / "cache" / "demo"
DEMO_AUDIT = json.loads((DEMO / "audit.json").read_text())

# ------------------------------------------------------------------ hand-made audits


def hand_audit(
    fingerprint: str,
    correct: float,
    static: float,
    global_mean: float,
    retention: float | None,
    share: float,
    latency: float,
    seed: int | None = None,
) -> dict:
    """The shipped demo's audit JSON with the figures a study reads set by hand (only four conditions, no
    sweep), its cache entries of the form the shipped studies' audits have."""
    conditions = {
        "correct": correct,
        "cross_input": global_mean - 0.01,
        "static_layer": static,
        "global_mean": global_mean,
    }
    report = copy.deepcopy(DEMO_AUDIT)
    report["model"].update(name="featuregate", fingerprint=fingerprint, parameters=1000, controller_parameters=10)
    shape = {"corpus": "kjv.txt", "sequences": 8, "seq_len": 16, "tokens": 128, "coefficient_dtype": "float32"}
    report["cache"].update(path="eval", split="eval", fingerprint="c" + fingerprint[1:], **shape)
    report["calibration"].update(path="calibration", split="calibration", **shape)
    for entry in ("cache", "calibration"):  # the entries of the shipped study audits: no split seed, corpus fingerprint
        for key in ("split_seed", "corpus_fingerprint", "documents"):
            report[entry].pop(key, None)
    report["dense"] = {"name": "dense", "fingerprint": "d" + fingerprint[1:], "parameters": 990}
    report["conditions"] = {
        k: {
            "nll": v,
            "penalty": v - correct,
            "penalty_ci95": [v - correct - 0.01, v - correct + 0.01],
            "nll_sd_over_sequences": 0.1,
        }
        for k, v in conditions.items()
    }
    report["gap_retention"] = {"cross_input": 0.01, "static_layer": retention}
    for key in ("gap_retention_ci95", "interpolation_sweep", "training"):
        report.pop(key)
    report["variance"]["layer_identity_share"] = share
    execution = report["execution"]
    execution.update(blocks_executed_fraction=1.0, blocks_executed_per_token=2.0, controller_flops_share=0.004)
    execution.update(latency_ratio_vs_dense=latency, device="cpu", batch_shape=[8, 16], runs=7)
    report["definitions"] = {
        "penalty": "paired percentile bootstrap (2000 resamples, seed 0)",
        "splits": {"evaluated": "eval", "calibration": "calibration"},
        "global_mean_families": {"gate": ["blocks.0.gate", "blocks.1.gate"]},
        "conditions": {"static_layer": "per-site mean"},
        "exactness": "free text, not compared",
    }
    if seed is not None:
        report["training"] = {"seed": seed, "split_seed": 0, "steps": 20, "device": "cpu"}
    return report


def build_study(audits, trainings=None) -> dict:
    """`fca.tables.study.build_study` of (name, report JSON) pairs, each read as `AuditReport` first."""
    typed = [(name, AuditReport.from_json(report, name)) for name, report in audits]
    return study.build_study(typed, trainings)


THREE = [
    ("a.json", hand_audit("a" * 64, 3.0, static=3.5, global_mean=4.0, retention=0.5, share=0.2, latency=1.0, seed=0)),
    ("b.json", hand_audit("b" * 64, 3.2, static=3.6, global_mean=4.2, retention=0.6, share=0.3, latency=1.1, seed=1)),
    ("c.json", hand_audit("c" * 64, 3.4, static=4.1, global_mean=4.4, retention=0.3, share=0.4, latency=1.2, seed=2)),
]


def test_study_module_needs_no_torch_and_no_ui():
    import subprocess
    import sys

    code = (
        "import sys, fca.tables.study; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'streamlit', 'plotly')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


def test_t_quantiles_match_tables():
    assert t_quantile_975(1) == pytest.approx(12.7062, abs=1e-4)
    assert t_quantile_975(2) == pytest.approx(4.3027, abs=1e-4)
    assert t_quantile_975(30) == pytest.approx(2.0423, abs=1e-4)
    # Beyond the table: the expansion, against published values (df 40, 60, 120) and the normal limit.
    assert t_quantile_975(40) == pytest.approx(2.021075, abs=1e-5)
    assert t_quantile_975(60) == pytest.approx(2.000298, abs=1e-5)
    assert t_quantile_975(120) == pytest.approx(1.979930, abs=1e-5)
    assert t_quantile_975(10**6) == pytest.approx(1.959966, abs=1e-5)
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_spread_by_hand():
    s = spread([3.0, 3.2, 3.4])
    # mean 3.2; SD sqrt((0.2^2 + 0 + 0.2^2) / 2) = 0.2; half-width t(0.975, 2) * 0.2 / sqrt(3) = 0.496827
    assert s["n"] == 3 and s["mean"] == pytest.approx(3.2) and s["sd"] == pytest.approx(0.2)
    assert s["ci95"] == pytest.approx([3.2 - 0.496827, 3.2 + 0.496827], abs=1e-6)
    assert spread([0.7]) == {"n": 1, "mean": 0.7, "sd": None, "ci95": None}
    assert spread([None, 2.0, 4.0]) == {
        "n": 2,
        "mean": 3.0,
        "sd": pytest.approx(math.sqrt(2)),
        "ci95": pytest.approx([3.0 - 12.706205, 3.0 + 12.706205], abs=1e-5),
    }
    assert spread([None])["mean"] is None


def test_study_aggregates_hand_made_audits():
    result = build_study(THREE)
    summary = result["summary"]
    assert result["num_models"] == 3 and [r["seed"] for r in result["seeds"]] == [0, 1, 2]
    nll = summary["conditions"]["correct"]["nll"]
    assert (nll["mean"], nll["sd"]) == (pytest.approx(3.2), pytest.approx(0.2))
    # static_layer penalties 0.5, 0.4, 0.7: mean 0.533333, SD sqrt((0.033^2 + 0.133^2 + 0.167^2) / 2) = 0.152753
    penalty = summary["conditions"]["static_layer"]["penalty"]
    assert penalty["mean"] == pytest.approx(0.533333, abs=1e-6) and penalty["sd"] == pytest.approx(0.152753, abs=1e-6)
    half = 4.302653 * 0.152753 / math.sqrt(3)  # 0.379460
    assert penalty["ci95"] == pytest.approx([0.533333 - half, 0.533333 + half], abs=1e-5)
    retention = summary["conditions"]["static_layer"]["gap_retention"]  # 0.5, 0.6, 0.3: the same spread shape
    assert retention["mean"] == pytest.approx(0.466667, abs=1e-6)
    assert retention["sd"] == pytest.approx(0.152753, abs=1e-6)
    assert "gap_retention" not in summary["conditions"]["correct"]
    share = summary["layer_identity_share"]
    assert share["mean"] == pytest.approx(0.3) and share["sd"] == pytest.approx(0.1)
    latency = summary["latency_ratio_vs_dense"]
    assert latency["n"] == 3 and latency["mean"] == pytest.approx(1.1)
    assert latency["sd"] == pytest.approx(0.1)
    assert summary["controller_flops_share"]["sd"] == pytest.approx(0.0)
    row = result["seeds"][1]
    assert row["fingerprint"] == "b" * 64 and row["nll"]["static_layer"] == 3.6 and row["penalty_ci95"]["static_layer"]
    assert row["exactness"] == THREE[1][1]["exactness"]  # passed through untouched
    assert "t(0.975, n - 1)" in result["definitions"]["ci95"]
    json.dumps(result)  # JSON-ready


@pytest.mark.parametrize(
    "path, value",
    [
        ("calibration.split", "train"),
        ("cache.seq_len", 32),
        ("definitions.global_mean_families", {"gate": ["blocks.0.gate"], "other": ["blocks.1.gate"]}),
        ("definitions.penalty", "paired percentile bootstrap (1000 resamples, seed 0)"),
        ("cache.corpus", "other.txt"),
        ("execution.device", "cuda:0"),
        ("training.split_seed", 1),
    ],
)
def test_refuses_audits_with_other_definitions(path, value):
    other = copy.deepcopy(THREE[1][1])
    target = other
    *parents, last = path.split(".")
    for key in parents:
        target = target[key]
    target[last] = value
    with pytest.raises(StudyError) as err:
        build_study([THREE[0], ("odd.json", other)])
    message = str(err.value)
    assert path in message and "a.json" in message and "odd.json" in message and "\n" not in message


# What must agree for audits to be averaged (README, "Multi-seed studies"), written out here so that a field
# dropped from the code's list is caught.
MUST_AGREE = (
    "fca_report_version",
    "model.model_type",
    "model.parameters",
    "model.controller_parameters",
    "model.dtype",
    "cache.split",
    "cache.corpus",
    "cache.sequences",
    "cache.seq_len",
    "cache.coefficient_dtype",
    "calibration.split",
    "calibration.corpus",
    "calibration.tokens",
    "calibration.coefficient_dtype",
    "execution.device",
    "execution.batch_shape",
    "execution.runs",
    "definitions.nll",
    "definitions.penalty",
    "definitions.gap_retention",
    "definitions.conditions",
    "definitions.condition_specs",
    "definitions.global_mean_families",
    "definitions.splits",
    "definitions.layer_identity_share",
    "definitions.controller_flops",
    "definitions.latency",
    "definitions.coefficient",
)


@pytest.mark.parametrize("path", MUST_AGREE)
def test_every_compared_field_is_compared(path):
    """Each field a study must see agree, changed in one audit, is refused by name (removing model.dtype from
    the compared fields passed the hand-picked cases above)."""
    other = copy.deepcopy(THREE[1][1])
    target = other
    *parents, last = path.split(".")
    for key in parents:
        target = target.setdefault(key, {})
    target[last] = changed(target.get(last, {}), path)
    if path == "fca_report_version":  # (a report of another version is not read at all: made here)
        typed = replace(AuditReport.from_json(THREE[1][1]), fca_report_version=2)
    else:
        typed = AuditReport.from_json(other, "odd.json")
    with pytest.raises(StudyError, match=re.escape(f"{path} differs between a.json")):
        study.build_study([(THREE[0][0], AuditReport.from_json(THREE[0][1])), ("odd.json", typed)])


def changed(value, path: str):
    """Another value of the same kind (the schema refuses a number where a string belongs)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + " (changed)"
    if isinstance(value, list):
        return [*value, 1]
    return {**value, "changed": path}


def test_audits_with_and_without_a_dense_twin_are_refused():
    without = copy.deepcopy(THREE[1][1])
    without["dense"] = None
    with pytest.raises(StudyError, match="dense twin differs between a.json and b.json: one was audited with"):
        build_study([THREE[0], ("b.json", without)])


def test_audits_of_two_corpus_files_of_one_name_are_refused():
    """Reports named the corpus by its file name only: an all-uppercase copy saved as kjv.txt was averaged
    with the original. A report now carries the corpus's fingerprint; reports made before it are compared by
    name, as they were."""
    a, b = copy.deepcopy(THREE[0][1]), copy.deepcopy(THREE[1][1])
    for report in (a, b):
        report["cache"].update(split_seed=0, corpus_fingerprint="1" * 64, documents=None)
        report["calibration"].update(split_seed=0, corpus_fingerprint="1" * 64)
    assert build_study([("a.json", a), ("b.json", b)])["num_models"] == 2
    b["cache"]["corpus_fingerprint"] = "2" * 64
    with pytest.raises(StudyError, match=r"cache.corpus_fingerprint differs between a.json .* and b.json"):
        build_study([("a.json", a), ("b.json", b)])
    for key in ("split_seed", "corpus_fingerprint", "documents"):  # the form of reports made before fingerprints
        del b["cache"][key]
    del b["calibration"]["split_seed"], b["calibration"]["corpus_fingerprint"]  # (its name agrees)
    assert build_study([("a.json", a), ("b.json", b)])["num_models"] == 2


def test_rows_follow_the_training_seeds_not_the_order_of_a_glob():
    """A shell's `seed*/audit.json` gives seed10 before seed2; the study lists seed 2 first, and a model of
    unknown seed last, the first audit given still being the one the others are compared with."""
    ten = hand_audit("a" * 64, 3.0, static=3.5, global_mean=4.0, retention=0.5, share=0.2, latency=1.0, seed=10)
    two = hand_audit("b" * 64, 3.2, static=3.6, global_mean=4.2, retention=0.6, share=0.3, latency=1.1, seed=2)
    unknown = hand_audit("c" * 64, 3.4, static=4.1, global_mean=4.4, retention=0.3, share=0.4, latency=1.2)
    result = build_study([("unknown.json", unknown), ("seed10.json", ten), ("seed2.json", two)])
    assert [(r["audit"], r["seed"]) for r in result["seeds"]] == [
        ("seed2.json", 2),
        ("seed10.json", 10),
        ("unknown.json", None),
    ]
    assert "Seeds: 2, 10, ?." in study.render_markdown(result)


def test_refuses_other_conditions_and_the_same_model_twice():
    fewer = copy.deepcopy(THREE[1][1])
    del fewer["conditions"]["cross_input"], fewer["gap_retention"]["cross_input"]
    with pytest.raises(StudyError, match="conditions differ between a.json .* and fewer.json"):
        build_study([THREE[0], ("fewer.json", fewer)])
    with pytest.raises(StudyError, match="again.json: the same model .* as a.json"):
        build_study([THREE[0], ("again.json", copy.deepcopy(THREE[0][1]))])
    no_training = copy.deepcopy(THREE[1][1])
    del no_training["training"]  # an optional field missing on one side is not a difference
    assert build_study([THREE[0], ("b.json", no_training)])["seeds"][1]["seed"] is None


def test_refuses_other_architectures_repeated_seeds_and_training_text_as_evaluation():
    """Audits recorded parameter counts only: two architectures of equal counts were averaged as seeds, a
    seed studied twice (other settings) showed as "Seeds: 1, 1, 2", and a cache drawn with another split
    seed than the model's training split (so holding training documents) passed."""
    a, b = copy.deepcopy(THREE[0][1]), copy.deepcopy(THREE[1][1])
    config = {"model_type": "featuregate", "d_model": 32, "n_heads": 4, "mlp_groups": 2}
    a["model"]["config"] = {**config, "init_seed": 0, "transformers_version": "5.0"}
    b["model"]["config"] = {**config, "init_seed": 1, "transformers_version": "5.1"}  # seeds and versions aside
    assert build_study([("a.json", a), ("b.json", b)])["num_models"] == 2
    b["model"]["config"].update(n_heads=2, mlp_groups=4)
    with pytest.raises(
        StudyError, match=r"model configuration differs between a.json and b.json \(mlp_groups, n_heads\)"
    ):
        build_study([("a.json", a), ("b.json", b)])
    again = copy.deepcopy(THREE[1][1])
    again["model"]["fingerprint"] = "e" * 64
    again["training"]["seed"] = 0  # another model, trained from a's seed
    with pytest.raises(StudyError, match="again.json: training seed 0 again \\(also a.json\\)"):
        build_study([THREE[0], ("again.json", again)])
    other_text = copy.deepcopy(THREE[1][1])
    other_text["cache"].update(split_seed=5, corpus_fingerprint=None, documents=None)  # trained on split seed 0, of
    # another corpus: no training text
    assert build_study([THREE[0], ("odd.json", other_text)])["num_models"] == 2
    other_text["training"]["corpus"] = "kjv.txt"  # the same corpus, split otherwise
    with pytest.raises(StudyError, match="odd.json: evaluated on a split drawn with split seed 5, but the model was"):
        build_study([THREE[0], ("odd.json", other_text)])
    # Where both fingerprints are known they decide, not the names: a renamed copy is the same text ...
    other_text["cache"]["corpus_fingerprint"] = "1" * 64
    other_text["training"].update(corpus="renamed.txt", corpus_fingerprint="1" * 64)
    with pytest.raises(StudyError, match="odd.json: evaluated on a split drawn with split seed 5, but the model was"):
        build_study([THREE[0], ("odd.json", other_text)])
    other_text["training"].update(
        corpus="kjv.txt", corpus_fingerprint="2" * 64
    )  # ... and other text of one name is not
    assert build_study([THREE[0], ("odd.json", other_text)])["num_models"] == 2
    trained_elsewhere = copy.deepcopy(other_text)
    trained_elsewhere["model"]["fingerprint"], trained_elsewhere["training"]["seed"] = "f" * 64, 3
    trained_elsewhere["training"]["corpus_fingerprint"] = "3" * 64
    with pytest.raises(StudyError, match="training.corpus_fingerprint differs between odd.json"):
        build_study([("odd.json", other_text), ("elsewhere.json", trained_elsewhere)])
    faster = copy.deepcopy(THREE[1][1])
    slower = copy.deepcopy(THREE[0][1])
    slower["training"]["lr"], faster["training"]["lr"] = 2e-3, 1e-3
    with pytest.raises(StudyError, match="training.lr differs between a.json"):
        build_study([("a.json", slower), ("faster.json", faster)])


@pytest.mark.parametrize(
    "command", [["train-seeds", "--seeds", "1", "2", "1"], ["train-seeds", "--seeds", "1", "--arch", "dense", "dense"]]
)
def test_a_seed_or_arch_given_twice_is_refused_before_training(command, tmp_path, capsys):
    """The second run of a repeated seed replaced the first without --overwrite."""
    assert main([*command, "--corpus", str(tmp_path / "none.txt"), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fca: error: --") and "more than once" in err and not (tmp_path / "m").exists()


def test_markdown_page():
    text = study.render_markdown(build_study(THREE))
    assert text.startswith("# FCA study: 3 models")
    assert "| correct | 3.2000 ± 0.2000 [2.7032, 3.6968] |  |  |" in text
    assert "| static_layer | 3.7333 ± " in text and "46.7% ± 15.3% [8.7%, 84.6%]" in text
    assert "| latency vs Dense twin (x) | 1.100 ± 0.100 [0.852, 1.348] |" in text
    undefined = copy.deepcopy(THREE)  # a figure some models lack is averaged over the others, and says so
    undefined[2][1]["gap_retention"]["static_layer"] = None
    assert "55.0% ± 7.1% [-8.5%, 118.5%] (n=2)" in study.render_markdown(build_study(undefined))
    assert "| 2 | featuregate | `cccccccccccc` | 3.4000 |" in text and "t(0.975, n - 1)" in text


def _write(tmp_path: Path, audits) -> list[str]:
    paths = []
    for name, report in audits:
        (tmp_path / name).write_text(json.dumps(report))
        paths.append(str(tmp_path / name))
    return paths


def test_cli_study_writes_json_and_markdown(tmp_path, capsys):
    paths = _write(tmp_path, THREE)
    out = tmp_path / "study" / "study.json"
    assert main(["study", *paths, "--json", str(out), "--markdown", str(out.with_suffix(".md"))]) == 0
    written = json.loads(out.read_text())
    assert written["summary"] == json.loads(json.dumps(build_study(THREE)["summary"]))
    assert [r["audit"] for r in written["seeds"]] == ["../a.json", "../b.json", "../c.json"]  # relative to the study
    assert out.with_suffix(".md").read_text().startswith("# FCA study: 3 models")
    assert "3 models, static_layer gap retention mean 46.7%;" in capsys.readouterr().out
    # Undefined for one model: its line says the mean is of the others only (the Markdown's "n=2" said so).
    undefined = copy.deepcopy(THREE)
    undefined[2][1]["gap_retention"]["static_layer"] = None
    (tmp_path / "u").mkdir()
    paths = _write(tmp_path / "u", undefined)
    assert main(["study", *paths, "--json", str(tmp_path / "u" / "s.json")]) == 0
    assert "static_layer gap retention mean " in (out := capsys.readouterr().out) and "(defined for 2 of the 3)" in out


def test_cli_study_rejects_a_non_report_in_one_line(tmp_path, capsys):
    paths = _write(tmp_path, THREE[:1])
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 32}))
    assert main(["study", paths[0], str(tmp_path / "config.json"), "--json", str(tmp_path / "s.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fca: error:") and "config.json: not an FCA audit report" in err and "\n" not in err
    (tmp_path / "broken.json").write_text("{not json")
    assert main(["study", str(tmp_path / "broken.json")]) == 2
    assert "broken.json: not a readable audit report" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()


# ------------------------------------------------------------------ training: the path CUDA shares


@pytest.mark.slow
def test_training_smoke_is_deterministic_and_learns(tmp_path):
    from safetensors.torch import load_file

    from fca.engine.models.featuregate import FeatureGateConfig
    from fca.jobs.train import TrainSettings, precision_for, train
    from fca.tables.schema import file_sha256
    from tests.helpers import TINY, write_corpus

    corpus = write_corpus(tmp_path / "corpus.txt")
    settings = TrainSettings(
        steps=25,
        batch_size=8,
        lr=3e-3,
        warmup=5,
        eval_every=10,
        eval_windows=8,
        final_eval_windows=8,
        vocab_size=300,
        seed=7,
    )
    logs = [
        train(corpus, tmp_path / name, FeatureGateConfig(**TINY), settings, show_progress=False) for name in ("a", "b")
    ]
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and (a[k] == b[k]).all() for k in a)
    assert all(t.dtype.is_floating_point and t.dtype.itemsize == 4 for t in a.values())  # float32 checkpoint
    history = logs[0]["history"]
    assert len(history) == 25 and history[0]["loss"] > history[-1]["loss"] + 0.5
    assert [h["loss"] for h in history] == [h["loss"] for h in logs[1]["history"]]
    log = json.loads((tmp_path / "a" / "training_log.json").read_text())
    assert log["device"] == "cpu" and log["precision"] == "float32" and log["optimizer"] == "AdamW"
    assert log["tokens_seen"] == 25 * 8 * TINY["max_seq_len"] and log["tokens_per_second"] > 0
    assert log["corpus_fingerprint"] == file_sha256(corpus)  # what a study compares with the evaluated cache's
    assert study.model_training(tmp_path / "a")["corpus_fingerprint"] == file_sha256(corpus)  # ... and reads
    cpu = precision_for("cpu")
    assert cpu.autocast is None and not cpu.fused_optimizer and not cpu.deterministic
    other_seed = train(
        corpus, tmp_path / "c", FeatureGateConfig(**TINY), replace(settings, seed=8), show_progress=False
    )
    assert other_seed["history"][0]["loss"] != history[0]["loss"]


# ------------------------------------------------------------------ demo-study end to end (tiny)

_BUILT: dict[str, Path] = {}


def build_tiny_study(tmp_path_factory) -> Path:
    """`make_demo_study` on the generated corpus with a 2-layer model: seeds 1 and 2, each trained
    (gated and dense), cached and audited for real. Built once per test session (also used by the
    Study page's test)."""
    if "root" not in _BUILT:
        from fca.jobs.demo import make_demo_study
        from fca.jobs.train import TrainSettings
        from tests.helpers import TINY, write_corpus

        root = tmp_path_factory.mktemp("tiny_study")
        corpus = write_corpus(root / "corpus.txt")
        settings = TrainSettings(
            steps=15,
            batch_size=8,
            lr=3e-3,
            warmup=3,
            eval_every=15,
            eval_windows=8,
            final_eval_windows=8,
            vocab_size=300,
        )
        make_demo_study(
            root / "study", corpus, [1, 2], include=[], config=TINY, settings=settings, num_seqs=8, show_progress=False
        )
        _BUILT["root"] = root
    return _BUILT["root"] / "study"


@pytest.fixture(scope="session")
def tiny_study(tmp_path_factory) -> Path:
    return build_tiny_study(tmp_path_factory)


def test_demo_study_end_to_end(tiny_study, tiny_demo, tmp_path, capsys):
    written = json.loads((tiny_study / "study.json").read_text())
    assert written["num_models"] == 2 and [r["seed"] for r in written["seeds"]] == [1, 2]
    for seed in (1, 2):
        seed_dir = tiny_study / f"seed{seed}"
        report = json.loads((seed_dir / "audit.json").read_text())
        assert report["training"]["seed"] == seed and report["training"]["device"] == "cpu"
        assert (seed_dir / "audit.md").is_file() and (seed_dir / "eval" / "manifest.json").is_file()
        row = written["seeds"][seed - 1]
        assert row["audit"] == f"seed{seed}/audit.json" and row["evaluated_cache"] == f"seed{seed}/eval"
        assert row["nll"] == {k: v["nll"] for k, v in report["conditions"].items()}
    assert written["seeds"][0]["fingerprint"] != written["seeds"][1]["fingerprint"]
    assert written["summary"]["conditions"]["static_layer"]["penalty"]["n"] == 2
    assert (tiny_study / "study.md").read_text().startswith("# FCA study: 2 models")
    # The study command over the same audits gives the same study.
    out = tmp_path / "again" / "study.json"
    audits = [str(tiny_study / f"seed{s}" / "audit.json") for s in (1, 2)]
    assert main(["study", *audits, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["summary"] == written["summary"]
    # A real audit of another setup (the fixture's demo: another corpus, untrained models) is refused by name.
    assert main(["study", *audits, str(tiny_demo / "audit.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "differs between" in err and "seed1/audit.json" in err and "audit.json" in err and "\n" not in err


def test_a_study_that_cannot_sit_with_its_audits_is_refused_before_training(tmp_path):
    """Hours of GPU training must not end in a refusal: included audits, and a study the new one would
    replace, are checked against the planned caches first (nothing is trained or written)."""
    from fca.jobs.demo import make_demo_study
    from tests.helpers import TINY

    from .conftest import REPO

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("unused")
    config = TINY  # windows of 16 tokens
    with pytest.raises(StudyError, match=r"demo/audit.json: an audit with cache.seq_len 128, and this study's seeds"):
        make_demo_study(tmp_path / "new", corpus, [1], include=[REPO / "cache/demo/audit.json"], config=config)
    (tmp_path / "old").mkdir()
    shutil.copy(REPO / "cache/demo-study/study.json", tmp_path / "old" / "study.json")
    with pytest.raises(StudyError, match=r"old/study.json: a study of audits with cache.seq_len 128.*choose another"):
        make_demo_study(tmp_path / "old", corpus, [1], include=[], config=config)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["corpus.txt", "old", "old/study.json"]
    (tmp_path / "cache").mkdir()
    shutil.copy(REPO / "cache/demo/eval/manifest.json", tmp_path / "cache" / "manifest.json")
    with pytest.raises(OutputError, match=r"cache/x/study.json: inside the cache .*cache"):  # (refused after training)
        make_demo_study(tmp_path / "cache" / "x", corpus, [1], include=[], config=config)
    assert not (tmp_path / "cache" / "x").exists()


def test_a_kept_model_of_other_settings_is_refused_not_audited_under_the_new_flags(tmp_path):
    """A study resumed into an --out holding models of d_model 32 and 40 steps, asked for 64 and 20, had
    kept and audited them without a word."""
    from fca.jobs.demo import train_pair
    from fca.jobs.train import TrainSettings

    from .conftest import REPO

    for arch in ("featuregate", "dense"):  # the shipped demo's files, as an earlier run would have left them
        (tmp_path / arch).mkdir()
        for name in ("config.json", "training_log.json", "model.safetensors"):
            shutil.copy(REPO / "cache/demo/featuregate" / name, tmp_path / arch / name)
    demo = dict(d_model=192, n_layers=6, n_heads=6, mlp_groups=6, max_seq_len=128)
    corpus = tmp_path / "unused.txt"
    train_pair(tmp_path, corpus, demo, TrainSettings(steps=800, seed=0))  # as trained: kept, nothing to do
    with pytest.raises(StudyError, match=r"featuregate: kept from an earlier run, which trained it with d_model 192 "):
        train_pair(tmp_path, corpus, {**demo, "d_model": 64}, TrainSettings(steps=800, seed=0))
    with pytest.raises(StudyError, match=r"trained it with steps 800 \(asked 20\), lr 0.002 \(asked 0.001\)"):
        train_pair(tmp_path, corpus, demo, TrainSettings(steps=20, lr=1e-3, seed=0))


def test_demo_study_command_defaults_are_the_demo_configuration(monkeypatch, tmp_path):
    """`python -m fca demo-study` with no size flags must train exactly what `fca demo` trained (seed 0
    of the study is the shipped demo); the flags reach `make_demo_study`."""
    from fca.jobs import demo
    from fca.jobs.train import TrainSettings

    seen = {}

    def fake(*args, **kwargs) -> dict:
        seen.update(args=args, **kwargs)
        return build_study(THREE)

    monkeypatch.setattr(demo, "make_demo_study", fake)
    assert main(["demo-study", "--out", str(tmp_path)]) == 0
    assert seen["args"][2] == [1, 2] and seen["include"] == [Path("cache/demo/audit.json")]
    assert {k: seen["config"][k] for k in demo.DEMO_CONFIG} == demo.DEMO_CONFIG
    assert seen["config"]["controller"] == "linear" and seen["config"]["granularity"] == "group"
    assert seen["settings"] == TrainSettings() and seen["num_seqs"] == demo.DEMO_SEQS
    assert seen["device"] == "cpu" and seen["audit_device"] == "cpu"
    flags = ["--seeds", "4", "--device", "cuda", "--include", "--d-model", "512"]
    assert main(["demo-study", "--out", str(tmp_path), *flags]) == 0
    assert seen["args"][2] == [4] and seen["include"] == [] and seen["device"] == "cuda"
    assert seen["config"]["d_model"] == 512


def test_audits_with_a_damaged_or_huge_field_are_one_line_or_summarized(tmp_path, capsys):
    """A string where a study reads a number was a bare 'could not convert' without the file, and a
    retention of 1e300 an OverflowError traceback (its squared deviation)."""
    audit = json.loads((DEMO / "audit.json").read_text())
    other = copy.deepcopy(audit)
    other["model"]["fingerprint"] = "another model"
    other["variance"]["layer_identity_share"] = "x"
    (tmp_path / "damaged.json").write_text(json.dumps(other))
    assert main(["study", str(DEMO / "audit.json"), str(tmp_path / "damaged.json")]) == 2
    err = capsys.readouterr().err
    said = "damaged.json: not an FCA audit report (variance.layer_identity_share is a string, not a number)"
    assert err.count("\n") == 1 and said in err
    assert study.spread([1e300, 0.5])["sd"] == pytest.approx(7.0710678e299)  # absurd, but figures, not a crash


@pytest.mark.parametrize("name", ["demo-study", "kjv-34m-study"])
def test_shipped_studies_are_what_their_shipped_audits_give(name):
    """A shipped study is a function of the audits it names: one re-audited (cache/demo/audit.json is the
    demo study's seed 0) leaves the study stale until `fca study` rebuilds it (README, "Multi-seed studies")."""
    folder = Path(__file__).parents[1] / "cache" / name
    shipped = json.loads((folder / "study.json").read_text())
    audits = [folder / row["audit"] for row in shipped["seeds"]]
    rebuilt = json.loads(json.dumps(study.study_from_files(audits, relative_to=folder)))
    assert rebuilt == shipped
    assert (folder / "study.md").read_text() == study.render_markdown(rebuilt)
