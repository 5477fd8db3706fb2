"""Ray as the engine, on a local two-CPU cluster (no network): a distributed build is the single-process
build, stored moments are the scanned ones, a sharded audit is the single-process audit, and a build
whose workers are lost resumes to the same cache."""

from __future__ import annotations

import json
import os
import socket

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from fca.jobs.build import build_cache_from_corpus  # noqa: E402
from fca.jobs.distributed import REPO_ROOT, build_cache_distributed, shard_bounds  # noqa: E402
from fca.jobs.experiment import ReplaySpec  # noqa: E402
from fca.tables.errors import CacheError  # noqa: E402
from fca.tables.profiles import cache_moments, scan_moments, slot_layout  # noqa: E402
from fca.tables.stats import variance_decomposition  # noqa: E402
from fca.tables.store import open_cache
from fca.tables.writer_store import PartStore

SIZES = dict(num_seqs=8, seq_len=16, batch_size=2, device="cpu", part_seqs=2)  # 4 parts of 2 sequences


@pytest.fixture(scope="module")
def cluster():
    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def single(tiny_demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "eval"
    return build_cache_from_corpus(
        tiny_demo / "featuregate", tiny_demo / "corpus.txt", "eval", out, show_progress=False, **SIZES
    )


def _distributed(tiny_demo, out, **kw):
    return build_cache_distributed(
        tiny_demo / "featuregate",
        tiny_demo / "corpus.txt",
        "eval",
        out,
        workers=2,
        show_progress=False,
        **SIZES,
        **kw,
    )


def _same_cache(a, b) -> None:
    ca, cb = open_cache(a, verify=True), open_cache(b, verify=True)
    ma, mb = ca.manifest.raw, cb.manifest.raw
    for key in ("parts", "moments", "sites", "num_seqs", "environment", "model", "corpus", "seqs_per_part"):
        assert ma[key] == mb[key], key  # part records hold each part's sha256; `moments` its sidecars' sha256
    seqs = list(range(ca.num_seqs))
    ra, rb = ca.read_seqs(seqs), cb.read_seqs(seqs)
    assert all(np.array_equal(ra[k], rb[k]) for k in ra)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_two_workers_build_the_single_process_cache(tiny_demo, single, tmp_path):
    out = _distributed(tiny_demo, tmp_path / "eval")
    assert len(open_cache(out).manifest.parts) == 4
    _same_cache(out, single)
    assert not (tmp_path / "eval.partial").exists() and not (tmp_path / "eval.lock").exists()


def test_stored_moments_equal_a_scan_of_the_coefficients(single):
    cache = open_cache(single)
    assert cache.manifest.raw["moments"]["token_sums"]
    stored, layout = cache_moments(cache)
    scanned, _ = scan_moments(cache, slot_layout(cache))
    for key in ("sum", "sumsq", "pos_count", "pos_sum", "seq_term", "minimum", "maximum", "tok_count", "tok_sum"):
        np.testing.assert_allclose(getattr(stored, key), getattr(scanned, key), rtol=1e-12, atol=1e-12, err_msg=key)
    assert (stored.count, stored.num_seqs) == (scanned.count, scanned.num_seqs)
    a, b = variance_decomposition(stored, layout), variance_decomposition(scanned, layout)
    assert a["layer_identity_share"] == pytest.approx(b["layer_identity_share"], rel=1e-12, abs=1e-12)
    for name, value in a["factors"].items():
        assert value == pytest.approx(b["factors"][name], rel=1e-12, abs=1e-12), name


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_lost_workers_then_resume_give_the_same_cache(tiny_demo, single, tmp_path):
    out = tmp_path / "eval"
    with pytest.raises(CacheError, match="every build worker failed"):
        _distributed(tiny_demo, out, fail_after=1)  # each worker commits one part, then is lost
    assert not out.exists() and not (tmp_path / "eval.lock").exists()
    assert len(PartStore(tmp_path / "eval").records()) == 2  # committed parts are kept...
    assert not (tmp_path / "eval.partial" / "manifest.json").exists()  # ...and nothing looks finished
    _same_cache(_distributed(tiny_demo, out), single)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_an_unfinished_build_of_other_settings_is_said_to_start_over(tiny_demo, tmp_path, capsys):
    """As the single-process build: the parts an interrupted build kept are not silently lost to a rerun
    with another flag; the line names the setting that differs."""
    out = tmp_path / "eval"
    with pytest.raises(CacheError, match="every build worker failed"):
        _distributed(tiny_demo, out, fail_after=1)
    capsys.readouterr()
    settings = {**SIZES, "num_seqs": 6}
    build_cache_distributed(
        tiny_demo / "featuregate", tiny_demo / "corpus.txt", "eval", out, workers=2, show_progress=True, **settings
    )
    said = capsys.readouterr().err
    assert f"{out}.partial: unfinished build with other settings (num-seqs 8 -> 6); starting over" in said
    assert open_cache(out, verify=True).num_seqs == 6


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_build_to_a_filesystem_uri_commits_parts_and_resumes(tiny_demo, single, tmp_path):
    """`--out` a pyarrow filesystem URI (here file://, through the same pyarrow filesystem calls as
    s3:// or gs://): actors commit parts under `<uri>.partial/`, a stopped build keeps them and resumes,
    the published cache is the local build's, and nothing at the URI looks finished before it is."""
    uri = (tmp_path / "remote" / "eval").as_uri()
    root = tmp_path / "remote"
    with pytest.raises(CacheError, match="every build worker failed"):
        _distributed(tiny_demo, uri, fail_after=1)
    assert len(list((root / "eval.partial").glob("part-*.record.json"))) == 2  # one committed per worker
    kept = {p.name: p.stat().st_mtime_ns for p in (root / "eval.partial").glob("part-*.parquet")}
    assert len(kept) == 2 and not (root / "eval").exists() and not (root / "eval.lock").exists()
    # One committed part changed in place, its size kept: redone, not published (a size check had taken it).
    damaged = sorted(kept)[1]
    data = bytearray((root / "eval.partial" / damaged).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (root / "eval.partial" / damaged).write_bytes(bytes(data))
    kept[damaged] = (root / "eval.partial" / damaged).stat().st_mtime_ns
    assert _distributed(tiny_demo, uri) == uri
    moved = {name: (root / "eval" / name).stat().st_mtime_ns for name in kept}
    assert moved[sorted(kept)[0]] == kept[sorted(kept)[0]] and moved[damaged] != kept[damaged]  # moved / redone
    assert not (root / "eval.partial").exists() and not (root / "eval.lock").exists()
    _same_cache(root / "eval", single)
    with pytest.raises(CacheError, match="already exists"):
        _distributed(tiny_demo, uri)


@pytest.mark.slow
def test_single_process_build_to_a_uri_and_refusals(tiny_demo, single, tmp_path):
    uri = (tmp_path / "eval").as_uri()
    out = build_cache_from_corpus(
        tiny_demo / "featuregate", tiny_demo / "corpus.txt", "eval", uri, show_progress=False, **SIZES
    )
    assert out == uri
    _same_cache(tmp_path / "eval", single)
    held = PartStore(uri).lock()  # another build holds the URI
    held.acquire()
    try:
        with pytest.raises(CacheError, match=r"another build is writing this cache .*eval.lock"):
            build_cache_from_corpus(
                tiny_demo / "featuregate",
                tiny_demo / "corpus.txt",
                "eval",
                uri,
                overwrite=True,
                show_progress=False,
                **SIZES,
            )
    finally:
        held.release()
    # A lock left by a build that died on this host is taken over.
    (tmp_path / "eval.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 1, "started": ""}))
    build_cache_from_corpus(
        tiny_demo / "featuregate", tiny_demo / "corpus.txt", "eval", uri, overwrite=True, show_progress=False, **SIZES
    )
    _same_cache(tmp_path / "eval", single)
    assert not (tmp_path / "eval.lock").exists()
    with pytest.raises(CacheError, match="not a filesystem pyarrow can open"):
        PartStore("nosuchscheme://bucket/cache")
    # A folder of other files is neither written among nor (with --overwrite) deleted, as a local --out.
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.txt").write_text("keep")
    (tmp_path / "project" / "manifest.json").write_text('{"manifest_version": 3}')  # (a browser extension's)
    for overwrite in (False, True):
        with pytest.raises(CacheError, match=r"project: holds notes.txt, which no cache holds; a build would"):
            build_cache_from_corpus(
                tiny_demo / "featuregate",
                tiny_demo / "corpus.txt",
                "eval",
                (tmp_path / "project").as_uri(),
                overwrite=overwrite,
                show_progress=False,
                **SIZES,
            )
    assert sorted(p.name for p in (tmp_path / "project").iterdir()) == ["manifest.json", "notes.txt"]


def test_shard_bounds_fall_on_batches():
    assert shard_bounds(10, 4, 2) == [(0, 8), (8, 10)]
    assert shard_bounds(3, 4, 5) == [(0, 3)]
    assert all(lo % 4 == 0 for lo, _ in shard_bounds(37, 4, 3))


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_sharded_audit_is_the_single_process_audit(tiny_demo):
    from fca.jobs.audit import audit_experiment, run_audit
    from fca.jobs.distributed import ShardedExperiment

    paths = (tiny_demo / "featuregate", tiny_demo / "eval", tiny_demo / "calibration")
    kw = dict(batch_size=4, latency_runs=1)
    local = run_audit(*paths, device="cpu", **kw)
    experiment = ShardedExperiment.open_sharded(ReplaySpec(*paths, device="cpu"), verify=True, workers=2)
    try:
        sharded = audit_experiment(experiment, **kw)
    finally:
        experiment.close()
    for key in ("conditions", "exactness", "gap_retention", "variance", "cache", "calibration", "definitions"):
        # same NLLs, same CIs (NaN from 8 sequences: compared as JSON), same checks: equal, not close
        assert json.dumps(sharded.to_json()[key], sort_keys=True) == json.dumps(local.to_json()[key], sort_keys=True), (
            key
        )


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_a_sharded_run_is_checked_reports_progress_and_stops(tiny_demo):
    """The sharded run refuses what the local run refuses, and honours progress and cancel."""
    from fca.jobs.distributed import ShardedExperiment
    from fca.tables.errors import Cancelled

    paths = (tiny_demo / "featuregate", tiny_demo / "eval", tiny_demo / "calibration")
    experiment = ShardedExperiment.open_sharded(ReplaySpec(*paths, device="cpu"), workers=2)
    try:
        with pytest.raises(ValueError, match="a batch of at least one"):
            experiment.run(["correct"], batch_size=0)
        seen = []
        experiment.run(["correct"], num_seqs=8, batch_size=2, progress=lambda done, n: seen.append((done, n)))
        assert seen[-1] == (8, 8) and all(n == 8 for _, n in seen)
        with pytest.raises(Cancelled):
            experiment.run(["correct", "cross_input"], num_seqs=8, batch_size=2, should_stop=lambda: True)
    finally:
        experiment.close()


# ------------------------------------------------------------------ bookkeeping (no Ray, no model)


def _synthetic_writer(out, num_seqs, vocab=64, **kw):
    from bench.scale_driver import SPECS, T, synthetic_plan
    from fca.tables.schema import cache_schema
    from fca.tables.writer import CacheWriter

    plan = synthetic_plan(num_seqs)
    plan["tokenizer"]["vocab_size"] = plan["model"]["config"]["vocab_size"] = vocab
    return CacheWriter(out, plan, cache_schema(SPECS), 1, **kw), T


def test_a_resume_takes_up_every_committed_part(tmp_path):
    from bench.scale_driver import synthetic_rows

    out = tmp_path / "many"
    writer, _ = _synthetic_writer(out, 40)
    for k in range(30):
        writer.write(*synthetic_rows(k, k + 1))
    assert len(list((tmp_path / "many.partial").glob("part-*.record.json"))) == 30  # one record per part
    writer.abort()
    resumed, _ = _synthetic_writer(out, 40)
    assert resumed.pending_parts() == list(range(30, 40))
    for k in resumed.pending_parts():
        resumed.write(*synthetic_rows(k, k + 1))
    cache = open_cache(resumed.finish(), verify=True)
    stored, layout = cache_moments(cache)
    scanned, _ = scan_moments(cache, layout)
    np.testing.assert_allclose(stored.tok_sum, scanned.tok_sum, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(stored.pos_sum, scanned.pos_sum, rtol=1e-12, atol=1e-12)


def test_token_sums_too_large_to_store_are_scanned_or_left_out(tmp_path, monkeypatch):
    import fca.tables.writer as writer_module
    from bench.scale_driver import synthetic_rows

    # Parts of one 8-token sequence hold ~8 distinct ids (more than rows / 8): without the small-size
    # allowance their token sums are dropped, as for a large vocabulary.
    monkeypatch.setattr(writer_module, "TOKEN_SUMS_ALLOWANCE", 0)
    writer, _ = _synthetic_writer(tmp_path / "c", 4)
    for k in range(4):
        writer.write(*synthetic_rows(k, k + 1))
    cache = open_cache(writer.finish())
    assert not cache.manifest.raw["moments"]["token_sums"]
    without, _ = cache_moments(cache)  # stored, without the token-id factor: no coefficient is read
    assert without.tok_sum is None
    scanned, _ = cache_moments(cache, scan_for_tokens=True)  # a full scan, token-id factor included
    assert scanned.tok_sum is not None
    np.testing.assert_allclose(without.sumsq, scanned.sumsq, rtol=1e-12, atol=1e-12)


def test_merged_shards_keep_each_shards_rows_of_routing_agreement():
    """A sharded replay of an MoE model: each shard fills its positions of the [n, S] routing figures, and
    the merged run has every shard's rows (zeros elsewhere would halve the agreement of a two-shard run);
    its mechanism check is the worst shard's."""
    from fca.engine.replay import ReplayResults
    from fca.engine.routing import ROUTING_FIGURES
    from fca.jobs.distributed import merge_results
    from fca.tables.fidelity import FidelityMeasure

    n, bounds = 4, [(0, 2), (2, 4)]
    rng = np.random.default_rng(0)
    whole = {figure: rng.uniform(size=(n, 2)) for figure in ROUTING_FIGURES}  # [n, S] of the whole run

    def shard(lo: int, hi: int, max_diff: float = 0.0) -> ReplayResults:
        routing = {figure: np.zeros((n, 2)) for figure in ROUTING_FIGURES}  # filled on the shard's rows only
        for figure, values in routing.items():
            values[lo:hi] = whole[figure][lo:hi]
        zeros = np.zeros(n)
        return ReplayResults(
            seqs=list(range(n)), per_seq_nll={"cross_input": zeros}, conditions={}, fidelity=FidelityMeasure(),
            max_abs_logit_diff=max_diff, batches=1,
            live_per_seq=zeros, cache_correct_per_seq=zeros, replayed_per_seq=zeros,
            routers={"a": 2, "b": 2}, routing={"cross_input": routing},
        )  # fmt: skip

    merged = merge_results([shard(0, 2), shard(2, 4, max_diff=3e-7)], bounds)
    assert merged.routers == {"a": 2, "b": 2}
    assert (merged.max_abs_logit_diff, merged.batches) == (3e-7, 2)  # the worst shard's, every shard's batches
    elsewhere = shard(2, 4)
    elsewhere.replayed_on = {"device_type": "cuda"}
    with pytest.raises(CacheError, match="replay workers ran in different environments"):
        merge_results([shard(0, 2), elsewhere], bounds)
    for figure in ROUTING_FIGURES:
        np.testing.assert_array_equal(merged.routing["cross_input"][figure], whole[figure])
    # A router one shard could not observe has no figure in the merged run; the other keeps its column.
    blind = shard(2, 4)
    blind.routers, blind.routing_unobserved = {"a": 2}, {"b": "its experts module m.b was never called"}
    blind.routing = {"cross_input": {f: v[:, :1] for f, v in blind.routing["cross_input"].items()}}
    merged = merge_results([shard(0, 2), blind], bounds)
    assert merged.routers == {"a": 2} and merged.routing_unobserved == blind.routing_unobserved
    for figure in ROUTING_FIGURES:
        np.testing.assert_array_equal(merged.routing["cross_input"][figure], whole[figure][:, :1])


def test_workers_run_the_family_files_the_driver_ran(tiny_demo, single, tmp_path):
    """A model of a family declared in a file loads in every actor (a process of its own), as in the
    driver: the build is the single-process build of the same weights."""
    import shutil

    from fca.engine import families as registry
    from fca.engine.user_families import load_family_file

    model = shutil.copytree(tiny_demo / "featuregate", tmp_path / "renamed")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "featuregate_by_file"}))
    family = tmp_path / "family.py"
    family.write_text(
        "import dataclasses\nfrom fca.engine.models.featuregate import FAMILY as BUILT_IN\n"
        "FAMILY = dataclasses.replace(BUILT_IN, model_type='featuregate_by_file')\n"
    )
    saved = dict(registry.registered_families())
    try:
        load_family_file(family)
        out = build_cache_distributed(
            model, tiny_demo / "corpus.txt", "eval", tmp_path / "eval", workers=2, show_progress=False, **SIZES
        )
    finally:
        registry._FAMILIES.clear()
        registry._FAMILIES.update(saved)
    a, b = open_cache(out, verify=True), open_cache(single, verify=True)
    assert a.manifest.model.fingerprint == b.manifest.model.fingerprint
    seqs = list(range(a.num_seqs))
    assert np.array_equal(a.read_seqs(seqs)["blocks.0.gate"], b.read_seqs(seqs)["blocks.0.gate"])
