"""The audit report's schema (`fca.tables.audit_report`): every shipped report reads and comes back as it was
written, a damaged field is one line naming the file and the field's path, and the report an audit writes
reads back unchanged."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from fca.tables.audit_report import AuditReport, ReportError
from fca.tables.outputs import strict_json
from fca.tables.report import read_report, render_markdown, write_report

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted((REPO / "cache").rglob("audit.json"))
DEMO = json.loads((REPO / "cache" / "demo" / "audit.json").read_text())


def test_schema_module_needs_no_torch():
    import subprocess
    import sys

    code = "import sys, fca.tables.audit_report; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO / "cache")))
def test_every_shipped_report_comes_back_as_written(path):
    data = json.loads(path.read_text())
    report = AuditReport.from_json(data, path)
    assert report.to_json() == data
    assert AuditReport.from_json(report.to_json()) == report


def test_the_shipped_reports_are_all_of_them():
    """The demo, the skip demo and the two studies' five seeds: the forms a reader meets."""
    assert len(SHIPPED) == 7


def test_the_shipped_forms_read_as_optional_parts():
    """What the early audits of the studies lack is None (and left out again), not a default."""
    early = read_report(REPO / "cache" / "kjv-34m-study" / "seed0" / "audit.json")
    assert early.model.config is None and early.gap_retention_ci95 is None
    assert early.cache.origin_recorded is False and early.cache.split_seed is None
    assert early.exactness.calibration is None and early.variance.chance_levels is None
    assert early.execution.uncounted_ops is None and "uncounted_ops" not in early.execution.to_json()
    skip = read_report(REPO / "cache" / "demo-skip" / "audit.json")
    assert skip.cache.origin_recorded and skip.cache.documents == 37 and skip.routing is None
    assert skip.execution.latency is not None and skip.execution.latency_ratio_vs_dense == pytest.approx(
        skip.execution.latency.latency_ratio_vs_dense
    )
    assert set(skip.execution.conditions) >= {"correct", "cross_input"} and skip.dense is not None


def _damaged(tmp_path: Path, change) -> str:
    data = copy.deepcopy(DEMO)
    change(data)
    path = tmp_path / "audit.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ReportError) as caught:
        read_report(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message


@pytest.mark.parametrize(
    "change, said",
    [
        (
            lambda d: d["conditions"]["cross_input"].update(penalty_ci95=[0.1]),
            "conditions.cross_input.penalty_ci95 is not a [low, high] pair",
        ),
        (lambda d: d["conditions"]["static_layer"].update(nll="3.1"), "conditions.static_layer.nll is a string"),
        (
            lambda d: d["variance"]["per_site"].update({"blocks.0.gate": []}),
            "variance.per_site.blocks.0.gate is a list",
        ),
        (lambda d: d["execution"].pop("num_blocks"), "execution.num_blocks is missing"),
        (lambda d: d["execution"].update(latency_ratio_vs_dense=None), "execution.model_ms_median is given without"),
        (lambda d: d["interpolation_sweep"][2].update(alpha=True), "interpolation_sweep[2].alpha is a boolean"),
        (lambda d: d["exactness"]["fidelity"].pop("verdict"), "exactness.fidelity.verdict is missing"),
        (lambda d: d["cache"].pop("documents"), "cache.documents is missing"),  # (its origin's fields: all or none)
        (lambda d: d["model"].update(colour="red"), "model.colour is not a field of this FCA's audit report"),
        (lambda d: d["gap_retention"].update(wobble=0.5), "gap_retention.wobble names no condition of the report"),
        (lambda d: d["training"].update(seed="three"), "training.seed is a string, not a whole number"),
        (lambda d: d.pop("variance"), "not an FCA audit report (no 'variance')"),
        (lambda d: d.update(fca_report_version=2), "audit report version 2; this FCA reads version 1"),
    ],
)
def test_a_damaged_field_is_named_by_its_path(tmp_path, change, said):
    assert said in _damaged(tmp_path, change)


def test_the_report_an_audit_writes_reads_back_unchanged(tiny_demo, tmp_path):
    """The writer's report through its JSON and back: the same report, the same file, the same page (the
    tiny demo's 8 sequences give null CIs, NaN live)."""
    import fca

    report = fca.audit(
        tiny_demo / "featuregate", tiny_demo / "eval", tiny_demo / "calibration", tiny_demo / "dense",
        device="cpu", sweep=(0, 1), latency_runs=1,
    )  # fmt: skip
    assert isinstance(report, AuditReport) and report.execution.latency is not None
    assert math.isnan(report.conditions["cross_input"].penalty_ci95[0])  # (under 10 sequences: no CI)
    assert AuditReport.from_json(report.to_json()) == report
    write_report(report, tmp_path / "audit.json", tmp_path / "audit.md")
    written = json.loads((tmp_path / "audit.json").read_text())
    again = read_report(tmp_path / "audit.json")
    assert again.to_json() == written and strict_json(again.to_json()) == (tmp_path / "audit.json").read_text()
    assert render_markdown(again) == (tmp_path / "audit.md").read_text() == render_markdown(report)
    assert list(written) == [
        "fca_report_version", "model", "cache", "calibration", "dense", "exactness", "conditions", "gap_retention",
        "gap_retention_ci95", "interpolation_sweep", "variance", "execution", "definitions", "training", "seconds",
    ]  # fmt: skip
