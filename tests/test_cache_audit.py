"""Coefficient cache, conditions, statistics, replay runner and the audit, on tiny real artifacts."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import fca
from fca.cli import main
from fca.engine.replay import (
    ExactnessError,
    ReplayResults,
    check_exactness,
    run_conditions,
)
from fca.jobs.build import build_cache_from_corpus
from fca.tables import data
from fca.tables.conditions import (
    Condition,
    condition_coefficients,
    derangement,
    parse_condition,
    position_permutation,
)
from fca.tables.errors import CacheError
from fca.tables.fidelity import judge_mechanism
from fca.tables.outputs import strict_json
from fca.tables.profiles import calibration_profiles
from fca.tables.schema import MANIFEST
from fca.tables.scoring import gap_retention, gap_retention_ci, summarize_conditions
from fca.tables.stats import (
    Moments,
    SlotLayout,
    paired_bootstrap_ci,
    percentile_interval,
    resampled_means,
    token_sums,
    variance_decomposition,
)
from fca.tables.store import open_cache

from .helpers import make_model_dir, write_corpus

N_SEQS = 12


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A tiny demo: model, Dense twin, eval and calibration caches."""
    root = tmp_path_factory.mktemp("demo")
    corpus = write_corpus(root / "prose.txt")
    make_model_dir(root / "featuregate", corpus)
    make_model_dir(root / "dense", corpus, gated=False)
    for split in ("eval", "calibration"):
        build_cache_from_corpus(
            root / "featuregate",
            corpus,
            split,
            root / split,
            num_seqs=N_SEQS,
            batch_size=5,
            device="cpu",
            show_progress=False,
        )
    return root


def test_cache_layout_and_round_trip(demo):
    cache = open_cache(demo / "eval", verify=True)
    m = cache.manifest.raw  # the file as written
    assert m["num_seqs"] == N_SEQS and m["seq_len"] == 16 and m["num_tokens"] == N_SEQS * 16
    assert list(m["sites"]) == ["blocks.0.gate", "blocks.1.gate"] and m["sites"]["blocks.0.gate"]["shape"] == [4]
    assert m["corpus"]["split"] == "eval" and len(m["model"]["fingerprint"]) == 64
    # Floats (the live NLL and every site's values) are stored byte-stream-split, the int32 keys plain.
    meta = pq.ParquetFile(cache.part_paths()[0]).metadata.row_group(0)
    encodings = {meta.column(i).path_in_schema: meta.column(i).encodings for i in range(meta.num_columns)}
    split = {path for path, used in encodings.items() if "BYTE_STREAM_SPLIT" in used}
    assert split == {"live_nll", "blocks.0.gate.list.element", "blocks.1.gate.list.element"}, encodings
    # Coefficients are never null, and the items say so: Parquet then keeps no definition level per value.
    parquet_schema = pq.ParquetFile(cache.part_paths()[0]).schema
    assert parquet_schema.column(parquet_schema.names.index("element")).max_definition_level == 1
    assert not pq.read_schema(cache.part_paths()[0]).field("blocks.0.gate").type.value_field.nullable
    model = fca.load_model(demo / "featuregate")
    cache.check_model(fca.engine.loading.fingerprint_state(model))
    got = cache.read_seqs([7, 2])
    fresh = fca.capture(model, got["token"])
    for site in cache.sites:
        np.testing.assert_array_equal(got[site], fresh[site])
    live = torch.nn.functional.cross_entropy(
        model(torch.from_numpy(got["token"]).long()).logits.flatten(0, 1),
        torch.from_numpy(got["target"]).long().flatten(),
        reduction="none",
    )
    np.testing.assert_allclose(got["live_nll"].reshape(-1), live.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_part_files_readable_without_fca(demo):
    parts = sorted((demo / "eval").glob("part-*.parquet"))
    frame = pd.concat([pd.read_parquet(part) for part in parts])
    assert len(frame) == N_SEQS * 16 and list(frame.columns[:5]) == ["seq", "pos", "token", "target", "live_nll"]
    assert sorted(frame["seq"].unique()) == list(range(N_SEQS))
    assert len(frame["blocks.1.gate"].iloc[0]) == 4
    meta = pq.ParquetFile(parts[0]).metadata
    assert meta.row_group(0).column(5).compression == "ZSTD"
    query = f"select count(distinct seq) from read_parquet('{demo / 'eval'}/part-*.parquet')"
    assert duckdb.sql(query).fetchall()[0][0] == N_SEQS
    assert pl.read_parquet(f"{demo / 'eval'}/part-*.parquet").height == N_SEQS * 16


def test_same_inputs_give_same_cache(demo, tmp_path):
    build_cache_from_corpus(
        demo / "featuregate",
        demo / "prose.txt",
        "eval",
        tmp_path / "again",
        num_seqs=N_SEQS,
        batch_size=5,
        device="cpu",
        show_progress=False,
    )
    assert [p.sha256 for p in open_cache(tmp_path / "again").manifest.parts] == [
        p.sha256 for p in open_cache(demo / "eval").manifest.parts
    ]


def test_interrupted_build_leaves_no_manifest_and_resumes(demo, tmp_path):
    """Stopped after its fourth batch of two sequences, a build of parts of two sequences keeps the parts it
    finished: the resumed build starts from them and ends equal to an uninterrupted one, part for part."""
    out = tmp_path / "cache"
    seen: list[tuple[int, int]] = []

    def interrupt_at_the_fourth_batch(done, total):
        seen.append((done, total))
        if len(seen) == 4:
            raise KeyboardInterrupt

    def build(path=out, **kw):
        return build_cache_from_corpus(
            demo / "featuregate",
            demo / "prose.txt",
            "eval",
            path,
            num_seqs=N_SEQS,
            batch_size=2,
            part_seqs=2,
            workers=1,
            device="cpu",
            show_progress=False,
            **kw,
        )

    with pytest.raises(KeyboardInterrupt):
        build(progress=interrupt_at_the_fourth_batch)
    partial = out.with_name("cache.partial")
    assert not out.exists() and not (partial / MANIFEST).exists()
    with pytest.raises(CacheError, match="missing; not a finished cache"):
        open_cache(partial)
    kept = {p.name: p.stat().st_mtime_ns for p in partial.glob("part-*.parquet")}
    assert len(kept) == 4  # one writer, in the forward's thread: each batch's part is written before its progress
    seen.clear()
    build(progress=lambda done, total: seen.append((done, total)))
    assert seen[0] == (10, N_SEQS) and seen[-1] == (N_SEQS, N_SEQS)  # the first batch after the kept parts
    assert all((out / name).stat().st_mtime_ns == mtime for name, mtime in kept.items())
    assert not partial.exists()
    resumed, clean = open_cache(out, verify=True), open_cache(build(tmp_path / "clean"), verify=True)
    assert [p.sha256 for p in resumed.manifest.parts] == [p.sha256 for p in clean.manifest.parts]
    assert len(resumed.manifest.parts) == N_SEQS // 2
    demo_cache, every = open_cache(demo / "eval"), list(range(N_SEQS))
    a, b = resumed.read_seqs(every), demo_cache.read_seqs(every)  # other part boundaries, the same values
    assert all(np.array_equal(a[k], b[k]) for k in a)


def _copy(demo, tmp_path, name="eval"):
    dst = tmp_path / name
    shutil.copytree(demo / name, dst)
    return dst


def _snapshot(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _audit_args(model, cache, calibration, report) -> list[str]:
    """`fca audit` arguments: the model, evaluated and calibration caches, and the JSON report's path."""
    return [
        "audit",
        "--model",
        str(model),
        "--cache",
        str(cache),
        "--calibration",
        str(calibration),
        "--json",
        str(report),
    ]


def _cli_error(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code != 0 and err.startswith("fca: error:") and "\n" not in err, err
    return err


def test_a_file_where_the_runs_folder_belongs_is_refused_before_the_replay(demo, tmp_path, capsys, monkeypatch):
    """The replay ran whole and then failed to save (`[Errno 17] File exists`): its figures were lost."""
    from fca.jobs import experiment

    cache = _copy(demo, tmp_path)
    (tmp_path / "eval.runs").write_text("notes")
    monkeypatch.setattr(experiment, "run_conditions", lambda *a, **k: pytest.fail("replayed before the check"))
    args = ["replay", "--model", str(demo / "featuregate"), "--cache", str(cache), "--num-seqs", "2", "--calibration"]
    args.append(str(demo / "calibration"))
    err = _cli_error(args, capsys)
    assert f"{tmp_path / 'eval.runs'}: a file, where the cache's runs folder belongs" in err


def test_a_manifest_that_lists_fewer_sites_than_its_parts_is_refused(demo, tmp_path, capsys):
    """It passed `inspect --verify`, and the audit then failed on statistics of another width, without a file."""
    cache = _copy(demo, tmp_path)
    manifest = json.loads((cache / "manifest.json").read_text())
    dropped = list(manifest["sites"])[-1]
    del manifest["sites"][dropped]
    (cache / "manifest.json").write_text(json.dumps(manifest))
    err = _cli_error(["inspect", str(cache), "--verify"], capsys)
    assert f"part-00000.parquet: column {dropped!r} is not a site of the manifest" in err


@pytest.mark.parametrize("damage", ["truncated", "other arrays", "another file named"])
def test_stored_moments_consistent_with_their_hash_but_malformed_are_one_line(demo, tmp_path, capsys, damage):
    """A manifest edited along with its moments file gave BadZipFile and TypeError tracebacks, or bare
    'count'; and its moments entry could name any file (/etc/passwd was read and hashed)."""
    import hashlib

    calibration = _copy(demo, tmp_path, "calibration")
    manifest = json.loads((calibration / "manifest.json").read_text())
    moments = calibration / "moments.npz"
    if damage == "truncated":
        moments.write_bytes(moments.read_bytes()[:500])
    elif damage == "other arrays":
        np.savez(moments, x=np.zeros(3))
    else:
        manifest["moments"]["file"] = "../eval/moments.npz"
    manifest["moments"]["sha256"] = hashlib.sha256(moments.read_bytes()).hexdigest()
    (calibration / "manifest.json").write_text(json.dumps(manifest))
    args = [*_audit_args(demo / "featuregate", demo / "eval", calibration, tmp_path / "r.json"), "--sweep", "none"]
    err = _cli_error(args, capsys)
    assert err.split(": ", 1)[1] in _cli_error(["inspect", str(calibration), "--verify"], capsys)  # it passed
    said = {
        "truncated": "moments.npz: malformed stored moments (File is not a zip file)",
        "other arrays": "moments.npz: malformed stored moments (no 'count')",
        "another file named": "manifest.json: its moments entry names '../eval/moments.npz', not 'moments.npz'",
    }
    assert said[damage] in err


def test_corrupt_part_file(demo, tmp_path, capsys):
    bad = _copy(demo, tmp_path)
    part = bad / "part-00000.parquet"
    part.write_bytes(part.read_bytes()[: len(part.read_bytes()) // 2])
    before = _snapshot(bad)
    with pytest.raises(CacheError, match="part-00000.parquet"):
        open_cache(bad)
    err = _cli_error(
        _audit_args(demo / "featuregate", bad, demo / "calibration", tmp_path / "r.json"),
        capsys,
    )
    assert "part-00000.parquet" in err
    assert _snapshot(bad) == before and not (tmp_path / "r.json").exists()


def test_modified_part_fails_verification(demo, tmp_path):
    bad = _copy(demo, tmp_path)
    part = bad / "part-00000.parquet"
    pq.write_table(pq.read_table(part), part, compression="zstd")  # valid Parquet, different bytes
    with pytest.raises(CacheError, match=r"not the part the manifest records \(.* bytes, recorded"):
        open_cache(bad, verify=True)  # (another size: said so; the same size is found by its hash, below)


def test_replay_refuses_a_part_changed_in_place(demo, tmp_path, capsys):
    """Values changed inside a part (same size, still valid Parquet) are refused as a hash mismatch by
    replay too, before any figure: not read, and not judged as another machine's rounding."""
    bad = _copy(demo, tmp_path)
    part = bad / "part-00000.parquet"
    data = bytearray(part.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0x01 for b in data[middle : middle + 8])
    part.write_bytes(bytes(data))  # the same size: only the hash tells
    args = ["replay", "--model", str(demo / "featuregate"), "--cache", str(bad), "--calibration"]
    err = _cli_error([*args, str(demo / "calibration"), "--device", "cpu", "--no-save"], capsys)
    assert "part-00000.parquet" in err and "sha256" in err
    assert not (tmp_path / "eval.runs").exists()


def test_fingerprint_mismatch(demo, tmp_path, capsys):
    other = make_model_dir(tmp_path / "other", demo / "prose.txt", seed=1)
    err = _cli_error(
        _audit_args(other, demo / "eval", demo / "calibration", tmp_path / "r.json"),
        capsys,
    )
    assert "different model" in err and "manifest.json" in err


def test_nan_coefficients(demo, tmp_path, capsys):
    bad = _copy(demo, tmp_path, "calibration")
    part = bad / "part-00000.parquet"
    table = pq.read_table(part)
    values = table.column("blocks.0.gate").combine_chunks()
    flat = values.flatten().to_numpy().copy()
    flat[3] = np.nan
    import pyarrow as pa

    table = table.set_column(
        table.schema.get_field_index("blocks.0.gate"),
        table.schema.field("blocks.0.gate"),
        pa.FixedSizeListArray.from_arrays(pa.array(flat), type=values.type),
    )
    pq.write_table(table, part, compression="zstd")
    manifest = json.loads((bad / MANIFEST).read_text())
    # a consistent cache that holds NaN: its record says the new part's hash and size
    manifest["parts"][0].update(sha256=fca.tables.schema.file_sha256(part), bytes=part.stat().st_size)
    (bad / MANIFEST).write_text(json.dumps(manifest))
    before = _snapshot(bad)
    with pytest.raises(CacheError, match="non-finite"):
        open_cache(bad).read_seqs([0])
    err = _cli_error(
        _audit_args(demo / "featuregate", demo / "eval", bad, tmp_path / "r.json"),
        capsys,
    )
    assert "non-finite" in err
    assert _snapshot(bad) == before


def test_null_values_in_a_part_are_refused_in_one_line(demo, tmp_path, capsys):
    """A site column of null rows was read as too few values (a bare IndexError), a null token as NaN
    ("cannot convert float NaN to integer"); a null live NLL passed for a fidelity failure."""
    import pyarrow as pa

    for column in ("blocks.0.gate", "token", "live_nll"):
        bad = tmp_path / column
        shutil.copytree(demo / "eval", bad)
        part = bad / "part-00000.parquet"
        table = pq.read_table(part)
        field = table.schema.field(column)
        nulls = pa.array([None] * table.num_rows, type=field.type)
        table = table.set_column(table.schema.get_field_index(column), field.with_nullable(True), nulls)
        pq.write_table(table, part)
        manifest = json.loads((bad / MANIFEST).read_text())  # recorded as it now is: only the nulls are wrong
        manifest["parts"][0].update(sha256=fca.tables.schema.file_sha256(part), bytes=part.stat().st_size)
        (bad / MANIFEST).write_text(json.dumps(manifest))
        args = ["replay", "--model", str(demo / "featuregate"), "--cache", str(bad), "--calibration"]
        assert main([*args, str(demo / "calibration"), "--num-seqs", "2", "--device", "cpu", "--no-save"]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]  # (after the progress bar)
        assert err == f"fca: error: {bad}: column(s) {column} hold missing (null) values", err


def test_missing_site_column(demo, tmp_path, capsys):
    bad = _copy(demo, tmp_path)
    part = bad / "part-00000.parquet"
    pq.write_table(pq.read_table(part).drop_columns(["blocks.1.gate"]), part)
    recorded = json.loads((bad / MANIFEST).read_text())["parts"][0]["bytes"]
    said = (
        f"part-00000.parquet: not the part the manifest records ({part.stat().st_size:,} bytes, recorded {recorded:,}:"
    )
    for verify in (False, True):  # (verified, it was "does not match the manifest's sha256", sizes unsaid)
        with pytest.raises(CacheError, match=re.escape(said)):
            open_cache(bad, verify=verify)  # its size is not the recorded one
    manifest = json.loads((bad / MANIFEST).read_text())  # recorded as it now is: the schema check refuses it
    manifest["parts"][0].update(sha256=fca.tables.schema.file_sha256(part), bytes=part.stat().st_size)
    (bad / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CacheError, match="column 'blocks.1.gate' is missing"):
        open_cache(bad)
    err = _cli_error(["inspect", str(bad)], capsys)
    assert "blocks.1.gate" in err


def test_derangement_and_shuffle():
    for seed in range(20):
        perm = derangement(7, seed)
        assert sorted(perm) == list(range(7)) and not (perm == np.arange(7)).any()
    assert np.array_equal(derangement(50, 3), derangement(50, 3))
    sigma = position_permutation(4, 16, seed=9)
    assert sorted(sigma) == list(range(16)) and np.array_equal(sigma, position_permutation(4, 16, seed=9))
    assert not np.array_equal(sigma, position_permutation(5, 16, seed=9))
    own = {
        "a": np.arange(2 * 16 * 3, dtype=np.float32).reshape(2, 16, 3),
        "b": np.arange(2 * 16 * 2, dtype=np.float32).reshape(2, 16, 2),
    }
    shared = condition_coefficients(Condition("token_shuffle", seed=1), own, [0, 1])
    for n in range(2):
        p = position_permutation(n, 16, 1)
        assert np.array_equal(shared["a"][n], own["a"][n, p]) and np.array_equal(shared["b"][n], own["b"][n, p])
    independent = condition_coefficients(Condition("token_shuffle", independent=True, seed=1), own, [0, 1])
    assert not np.array_equal(independent["b"], shared["b"])
    assert not np.array_equal(independent["a"], shared["a"])  # (the first site too: it once drew the shared one)
    frozen = condition_coefficients(parse_condition("token_shuffle@b", 1), own, [0, 1])
    assert frozen["a"] is own["a"] and np.array_equal(frozen["b"], shared["b"])
    assert parse_condition("interpolate:0.25@a,b").name == "interpolate:0.25@a,b"
    with pytest.raises(ValueError, match="unknown condition 'wobble'; choose one of correct"):
        parse_condition("wobble")


def test_static_profile_is_calibration_mean(demo):
    cal = open_cache(demo / "calibration")
    profiles = calibration_profiles(cal)
    everything = cal.read_seqs(range(cal.num_seqs))
    for site in cal.sites:
        np.testing.assert_allclose(profiles.static[site], everything[site].reshape(-1, 4).mean(0), rtol=1e-6)
        np.testing.assert_allclose(profiles.position[site], everything[site].mean(0), rtol=1e-6)
    grand = np.mean([everything[s] for s in cal.sites])
    assert all(np.allclose(profiles.global_mean[s], grand, rtol=1e-6) for s in cal.sites)


def _moments(values: np.ndarray, vocab: int = 10) -> Moments:
    m = Moments(values.shape[2], values.shape[1], vocab)
    tokens = np.arange(values.shape[0] * values.shape[1]).reshape(values.shape[:2]) % vocab
    m.add(values[: values.shape[0] // 2], tokens[: values.shape[0] // 2])
    other = Moments(values.shape[2], values.shape[1], vocab)
    other.add(values[values.shape[0] // 2 :], tokens[values.shape[0] // 2 :])
    return m.merge(other)


def test_variance_share_hand_cases():
    layout = SlotLayout(sites=["s0", "s1", "s2"], widths=[2, 2, 2], families=["g"] * 6)
    slot_means = np.array([0.2, 0.4, 0.9, 1.1, 1.6, 1.8])
    pure_site = np.broadcast_to(slot_means, (8, 5, 6)).copy()
    result = variance_decomposition(_moments(pure_site), layout)
    assert result["layer_identity_share"] == pytest.approx(1.0)
    assert result["factors"]["residual_after_slot"] == pytest.approx(0.0, abs=1e-9)
    noise = np.random.default_rng(0).normal(1.0, 0.3, (400, 8, 6))
    assert variance_decomposition(_moments(noise), layout)["layer_identity_share"] < 0.01
    # Hand-computed: two slots, values {0, 2} and {4, 6}: grand mean 3, SS_total 20, SS_between 16.
    tiny = np.array([[[0.0, 4.0], [2.0, 6.0]]])  # [1 seq, 2 positions, 2 slots]
    r = variance_decomposition(_moments(tiny), SlotLayout(["a"], [2], ["g", "g"]))
    assert r["layer_identity_share"] == pytest.approx(16 / 20)
    assert r["factors"]["position_within_slot"] == pytest.approx(4 / 20)


def test_every_share_and_factor_against_a_brute_force_computation():
    """Each figure of the decomposition from its definition (README, "What is measured, exactly"), on raw
    values of three sites and two families: a per-site share measured around another quantity, the site
    factor without its channel count, or the sequence factor off by a term all passed the other tests."""
    rng = np.random.default_rng(4)
    n, T, vocab = 7, 9, 5
    families = ["g", "g", "r", "g", "r", "r"]  # sites a (g, g), b (r, g), c (r, r)
    layout = SlotLayout(["a", "b", "c"], [2, 2, 2], families)
    tokens = rng.integers(0, vocab, (n, T))
    values = rng.normal(0, 1, (n, T, 6)) + np.array([0.0, 1.0, 3.0, 0.5, 2.0, 2.5])  # slot offsets
    values += 0.3 * np.sin(tokens)[:, :, None] + 0.2 * np.arange(T)[None, :, None] / T  # token, position
    m = Moments(6, T, vocab)
    m.add(values, tokens)
    r = variance_decomposition(m, layout)

    fam = np.array(families)
    flat = values.reshape(-1, 6)  # [n*T, C]
    grand = {f: flat[:, fam == f].mean() for f in ("g", "r")}
    around = flat - np.array([grand[f] for f in families])  # each value around its family's grand mean
    ss_total = (around**2).sum()
    slot_means = flat.mean(0)
    ss_between = flat.shape[0] * (slot_means - np.array([grand[f] for f in families])) ** 2  # [C]
    within = flat - slot_means
    assert r["layer_identity_share"] == pytest.approx(ss_between.sum() / ss_total, rel=1e-12)
    for site, cols in (("a", [0, 1]), ("b", [2, 3]), ("c", [4, 5])):
        share = ss_between[cols].sum() / (around[:, cols] ** 2).sum()  # around the family's grand mean
        assert r["per_site"][site] == pytest.approx(share, rel=1e-12), site
    for f in ("g", "r"):
        assert r["per_family"][f] == pytest.approx(ss_between[fam == f].sum() / (around[:, fam == f] ** 2).sum())
    ss_site = 0.0  # every channel of a site (and family) at one mean
    for cols in ([0, 1], [2, 3], [4, 5]):
        for f in dict.fromkeys(fam[cols]):
            chosen = [c for c in cols if fam[c] == f]
            ss_site += flat.shape[0] * len(chosen) * (flat[:, chosen].mean() - grand[f]) ** 2
    factors = r["factors"]
    assert factors["site"] == pytest.approx(ss_site / ss_total, rel=1e-12)
    assert factors["channel_within_site"] == pytest.approx((ss_between.sum() - ss_site) / ss_total, rel=1e-12)

    def within_slot(groups: np.ndarray) -> float:  # group means within each slot, around the slot mean
        keys = groups.reshape(-1)
        return sum((keys == g).sum() * ((within[keys == g].mean(0)) ** 2).sum() for g in np.unique(keys)) / ss_total

    assert factors["position_within_slot"] == pytest.approx(within_slot(np.broadcast_to(np.arange(T), (n, T))))
    assert factors["sequence_within_slot"] == pytest.approx(within_slot(np.repeat(np.arange(n), T)))
    assert factors["token_id_within_slot"] == pytest.approx(within_slot(tokens))
    assert factors["residual_after_slot"] == pytest.approx((within**2).sum() / ss_total)


def test_within_slot_factors_have_their_chance_level():
    """A grouping with no effect explains (k - 1) / (n - 1) of a slot's within variance in expectation:
    the demo's 1,565 token ids take 3.8% of pure noise, beside the 67% its gates give them."""
    layout = SlotLayout(["a"], [3], ["g"] * 3)
    rng = np.random.default_rng(0)
    n_seqs, T, vocab = 40, 50, 400
    tokens = rng.integers(0, vocab, (n_seqs, T))
    noise = rng.normal(0.5, 0.1, (n_seqs, T, 3))
    shares, chance = [], []
    for effect in (0.0, 0.3):
        values = noise + effect * np.sin(tokens)[:, :, None]  # a function of the token id
        m = Moments(3, T, vocab)
        m.add(values, tokens)
        r = variance_decomposition(m, layout)
        shares.append(r["factors"]["token_id_within_slot"])
        chance.append(r["chance_levels"])
    k = len(np.unique(tokens))
    residual = variance_decomposition(m, layout)["factors"]["residual_after_slot"]
    assert chance[1]["token_id_within_slot"] == pytest.approx((k - 1) / (n_seqs * T - 1) * residual)
    assert chance[1]["position_within_slot"] == pytest.approx((T - 1) / (n_seqs * T - 1) * residual)
    assert chance[1]["sequence_within_slot"] == pytest.approx((n_seqs - 1) / (n_seqs * T - 1) * residual)
    # No effect: the token factor is its chance level (within sampling error), far from zero; an effect: far above.
    assert shares[0] == pytest.approx(chance[0]["token_id_within_slot"], rel=0.1) and shares[0] > 0.15
    assert shares[1] > 0.7 > 3 * chance[1]["token_id_within_slot"]


def test_shares_do_not_depend_on_the_values_scale():
    """An absolute threshold on SS_total made a family scaled by 1e-7 report no share at all."""
    layout = SlotLayout(["a", "b"], [2, 2], ["g"] * 4)
    values = np.random.default_rng(1).normal(0, 1, (6, 8, 4)) + np.array([0.0, 1.0, 2.0, 3.0])
    base = variance_decomposition(_moments(values), layout)
    for scale in (1e-7, 1e-12, 1e6):
        scaled = variance_decomposition(_moments(values * scale), layout)
        assert scaled["layer_identity_share"] == pytest.approx(base["layer_identity_share"], rel=1e-9)
        assert scaled["per_site"] == pytest.approx(base["per_site"], rel=1e-9)
    constant = variance_decomposition(_moments(np.full((6, 8, 4), 0.3)), layout)
    assert constant["layer_identity_share"] is None and constant["per_slot_share"] == [None] * 4


def test_an_sd_over_one_sequence_is_undefined():
    from fca.tables.scoring import summarize_conditions

    one = summarize_conditions({"correct": np.array([3.0]), "static_layer": np.array([3.5])})
    assert one["static_layer"]["nll_sd_over_sequences"] is None and one["static_layer"]["penalty"] == 0.5
    two = summarize_conditions({"correct": np.array([3.0, 3.2]), "static_layer": np.array([3.5, 3.5])})
    assert two["correct"]["nll_sd_over_sequences"] == pytest.approx(np.std([3.0, 3.2], ddof=1))


def test_too_few_sequences_give_no_interval_nor_retention():
    """Under 10 sequences a percentile bootstrap's "95% CI" covers the mean far less often (2 values: half
    the time): none is given, so no gap retention either. From 10 on, both are."""
    rng = np.random.default_rng(0)
    base = rng.normal(3.0, 0.1, 10)
    nll = {"correct": base, "static_layer": base + 0.1, "global_mean": base + 0.4 + rng.normal(0, 0.01, 10)}
    nine = summarize_conditions({k: v[:9] for k, v in nll.items()})
    assert np.isnan(nine["global_mean"]["penalty_ci95"]).all() and nine["global_mean"]["penalty"] > 0.35
    assert gap_retention(nine) == {"static_layer": None}
    assert gap_retention_ci({k: v[:9] for k, v in nll.items()}, {"static_layer": 0.75}) == {}
    ten = summarize_conditions(nll)
    lo, hi = ten["global_mean"]["penalty_ci95"]
    assert 0.38 < lo < hi < 0.42 and gap_retention(ten)["static_layer"] == pytest.approx(0.75, abs=0.01)


def test_bootstrap_ci():
    lo, hi = paired_bootstrap_ci(np.full(30, 0.5))
    assert lo == hi == pytest.approx(0.5)
    d = np.random.default_rng(1).normal(0.2, 0.1, 200)
    lo, hi = paired_bootstrap_ci(d, seed=3)
    assert lo < d.mean() < hi and hi - lo < 0.05 and (lo, hi) == paired_bootstrap_ci(d, seed=3)
    # The definition, spelled out: 2,000 resamples of the sequences with default_rng(seed), the 2.5 and
    # 97.5 percentiles of their means (a 90% interval, or 200 resamples, passed the checks above).
    means = d[np.random.default_rng(3).integers(0, d.size, size=(2000, d.size))].mean(1)
    assert (lo, hi) == tuple(np.quantile(means, [0.025, 0.975]))


def test_resampling_documents_draws_whole_documents():
    """The document bootstrap, spelled out: default_rng(seed) draws U documents with replacement per resample
    (U the number of documents), each resample's mean is over the windows its documents hold; one document
    per window gives the sequence interval bit for bit."""
    rng = np.random.default_rng(5)
    documents = np.repeat(np.arange(12), rng.integers(1, 8, 12))  # [n]: 12 documents of 1 to 7 windows
    values = rng.normal(0.3, 0.1, (len(documents), 2))  # [n, 2] two paired columns
    draws = resampled_means(values, documents, 500, seed=3)
    idx = np.random.default_rng(3).integers(0, 12, size=(500, 12))
    by_hand = np.array([np.concatenate([values[documents == u] for u in row]).mean(0) for row in idx])
    assert draws.shape == (500, 2) and np.allclose(draws, by_hand, rtol=0, atol=1e-12)
    d = values[:, 0]
    assert percentile_interval(resampled_means(d[:, None], np.arange(len(d)), 2000, 3)[:, 0]) == paired_bootstrap_ci(
        d, seed=3
    )
    # Windows of one document alike: resampled one by one, their interval is far too narrow.
    shared = np.repeat(rng.normal(0.3, 0.1, 20), 10)  # [200]: 20 documents of 10 identical windows
    by_window = paired_bootstrap_ci(shared)
    by_document = summarize_conditions({"correct": np.zeros(200), "x": shared}, documents=np.repeat(np.arange(20), 10))[
        "x"
    ]["penalty_ci95_documents"]
    assert (by_document[1] - by_document[0]) > 2.5 * (by_window[1] - by_window[0])
    # One document: no interval over documents (summarize_conditions leaves the key out).
    assert (
        "penalty_ci95_documents"
        not in summarize_conditions({"correct": np.zeros(4), "x": np.ones(4)}, documents=np.zeros(4))["x"]
    )


def test_resamples_drawn_in_blocks_are_the_draws_of_one_block(monkeypatch):
    """Bounded memory changes no draw: 2,000 resamples a few at a time give what 2,000 at once gave."""
    from fca.tables import stats

    values = np.random.default_rng(0).normal(size=(300, 3))
    groups = np.random.default_rng(1).integers(0, 40, 300)
    at_once = [resampled_means(values, g, 2000, 5) for g in (None, groups)]
    monkeypatch.setattr(stats, "RESAMPLE_BLOCK", 7 * 300)  # 7 resamples (of 300 sequences) per block
    assert all(np.array_equal(a, resampled_means(values, g, 2000, 5)) for a, g in zip(at_once, (None, groups)))


def test_intervals_over_documents_are_paired_and_refuse_what_they_cannot_give():
    rng = np.random.default_rng(4)
    documents = np.repeat(np.arange(12), 5)
    correct = rng.normal(3.0, 0.2, 60)
    per_seq = {"correct": correct, "a": correct + rng.normal(0.5, 0.2, 60), "b": correct + rng.normal(0.2, 0.2, 60)}
    table = summarize_conditions(per_seq, seed=1, documents=documents)
    draws = resampled_means(np.stack([per_seq[k] - correct for k in per_seq], 1), documents, 2000, 1)
    for j, name in enumerate(per_seq):  # one draw of documents for all conditions: paired
        assert table[name]["penalty_ci95_documents"] == (
            [0.0, 0.0] if j == 0 else list(percentile_interval(draws[:, j]))
        )
    assert "penalty_ci95_documents" not in summarize_conditions(per_seq, documents=documents // 2)["a"]  # 6 < 10
    # A gap that is not clearly positive over documents: no retention, and no interval built from lucky draws.
    z = np.array([1.5, -1.2, 0.8, -0.9, 1.1, -1.4, 0.6, -0.5, 0.3, -0.2, 0.7, -0.8])  # document effects, mean 0
    shaky = {**per_seq, "global_mean": correct + np.repeat(0.02 + 0.06 * z, 5), "static_layer": correct + 0.01}
    gaps = summarize_conditions(shaky, documents=documents)["global_mean"]
    assert gaps["penalty_ci95"][0] > 0 > gaps["penalty_ci95_documents"][0]  # positive only window by window
    assert gap_retention(summarize_conditions(shaky, documents=documents))["static_layer"] is None
    assert gap_retention_ci(shaky, {"static_layer": 0.5}, documents=documents) == {}  # (> 2.5% of gaps <= 0)
    # NaN stays NaN (an interval from the finite draws only would look like a result).
    assert all(np.isnan(paired_bootstrap_ci(np.array([1.0] * 30 + [np.nan]))))


def test_intervals_over_documents_start_at_min_documents():
    from fca.tables.scoring import MIN_DOCUMENTS

    rng = np.random.default_rng(7)
    n = 4 * MIN_DOCUMENTS
    correct = rng.normal(3.0, 0.2, n)
    per_seq = {
        "correct": correct,
        "global_mean": correct + rng.normal(0.8, 0.1, n),
        "x": correct + rng.normal(0.4, 0.1, n),
    }
    enough, fewer = np.arange(n) % MIN_DOCUMENTS, np.arange(n) % (MIN_DOCUMENTS - 1)
    assert "penalty_ci95_documents" in summarize_conditions(per_seq, documents=enough)["x"]
    assert "penalty_ci95_documents" not in summarize_conditions(per_seq, documents=fewer)["x"]
    retention = {"x": 0.5}
    assert gap_retention_ci(per_seq, retention, documents=enough) != gap_retention_ci(per_seq, retention)
    assert gap_retention_ci(per_seq, retention, documents=fewer) == gap_retention_ci(per_seq, retention)
    # A few resamples (0 < share <= 2.5%) without a positive gap: left out of the interval, not made NaN.
    z = rng.normal(size=100)
    gap = 0.23 + (z - z.mean()) / z.std()  # mean 2.3 standard errors above 0: about 1% of resamples at or below
    shaky = {"correct": np.zeros(100), "global_mean": gap, "x": 0.5 * gap + rng.normal(0, 0.1, 100)}
    draws = resampled_means(np.stack([shaky["global_mean"], shaky["x"]], 1), None, 2000, 0)
    gapped = draws[:, 0] > 0
    assert 0 < 1 - gapped.mean() <= 0.025, 1 - gapped.mean()
    assert gap_retention_ci(shaky, retention)["x"] == list(percentile_interval(1 - draws[gapped, 1] / draws[gapped, 0]))


def test_gap_retention_interval_is_the_ratio_of_paired_resampled_means():
    rng = np.random.default_rng(2)
    correct = rng.normal(3.0, 0.2, 40)
    per_seq = {
        "correct": correct,
        "global_mean": correct + rng.normal(0.8, 0.1, 40),
        "static_layer": correct + rng.normal(0.4, 0.1, 40),
    }
    documents = np.repeat(np.arange(10), 4)
    table = summarize_conditions(per_seq, documents=documents)
    retention = gap_retention(table)
    ci = gap_retention_ci(per_seq, retention, seed=0, documents=documents)
    draws = resampled_means(
        np.stack([per_seq["global_mean"] - correct, per_seq["static_layer"] - correct], 1), documents
    )
    assert ci["static_layer"] == list(percentile_interval(1 - draws[:, 1] / draws[:, 0]))
    assert ci["static_layer"][0] < retention["static_layer"] < ci["static_layer"][1]
    assert set(ci) == {"static_layer"}  # the anchors have none
    by_sequence = gap_retention_ci(per_seq, retention, seed=0)  # no documents recorded: sequences resampled
    assert by_sequence["static_layer"] != ci["static_layer"]
    assert gap_retention_ci(per_seq, {"static_layer": None}) == {}  # undefined retention: no interval


def test_the_penalty_interval_is_paired_over_sequences():
    """Sequences differ far more from each other than a condition moves each one: a paired interval (of the
    per-sequence differences) is narrow, an unpaired one would be wide. An unpaired scorer (each
    condition's sequences in another order) passed every other test."""
    from fca.tables.scoring import BOOTSTRAP_RESAMPLES, summarize_conditions

    rng = np.random.default_rng(0)
    base = rng.normal(3.5, 0.5, 64)  # per-sequence NLLs, sequences far apart
    shifted = base + 0.1 + rng.normal(0, 0.01, 64)  # every sequence 0.1 nats worse
    row = summarize_conditions({"correct": base, "static_layer": shifted}, seed=5)["static_layer"]
    assert row["penalty_ci95"] == list(paired_bootstrap_ci(shifted - base, BOOTSTRAP_RESAMPLES, 5))
    lo, hi = row["penalty_ci95"]
    assert 0.095 < lo < 0.1 < hi < 0.105  # unpaired, the interval would be about +-0.17 wide


@pytest.mark.slow
def test_replay_runner_conditions(demo):
    model = fca.load_model(demo / "featuregate")
    ev, cal = open_cache(demo / "eval"), open_cache(demo / "calibration")
    conditions = [
        parse_condition(c)
        for c in (
            "correct",
            "cross_input",
            "token_shuffle",
            "static_layer",
            "global_mean",
            "interpolate:1",
            "interpolate:0",
        )
    ]
    results = run_conditions(model, ev, conditions, calibration_profiles(cal), batch_size=5)
    assert results.max_abs_logit_diff == 0.0 and results.nll_live == results.nll_correct
    # Built here in batches of 5 and replayed in the same batches: the cache is what this model computes now.
    fidelity = check_exactness(results)["fidelity"]
    assert fidelity["same_environment"] and fidelity["same_batches"] and fidelity["verdict"] == "bit-identical"
    assert fidelity["tolerances"]["bit_identical_required"] and fidelity["nll_diff"] == 0.0
    nll = {name: results.nll(name) for name in results.per_seq_nll}
    assert nll["correct"] == pytest.approx(results.nll_live, abs=1e-6)
    assert nll["interpolate:1"] == pytest.approx(nll["correct"], abs=1e-6)
    assert nll["interpolate:0"] == pytest.approx(nll["static_layer"], abs=1e-6)
    assert (
        len({round(nll[k], 7) for k in ("correct", "cross_input", "token_shuffle", "static_layer", "global_mean")}) == 5
    )
    # Batch composition does not change per-sequence NLL of a condition beyond float noise.
    again = run_conditions(model, ev, conditions[:2], calibration_profiles(cal), batch_size=3)
    np.testing.assert_allclose(again.per_seq_nll["cross_input"], results.per_seq_nll["cross_input"], atol=1e-5)
    # Other batches than the build's: measured against the tolerances, not required to be bit-identical.
    assert not check_exactness(again)["fidelity"]["tolerances"]["bit_identical_required"]


def test_window_documents_follow_the_corpus(demo, tmp_path):
    """Each window's document, from the end-of-document ids the manifest names, is the one it begins in in
    the split's text; caches that do not record the id have none (their windows' order is unknown)."""
    cache = open_cache(demo / "eval")
    assert cache.manifest.raw["tokenizer"]["end_of_document"] == cache.manifest.tokenizer.end_of_document == 0
    docs = data.split_documents(data.load_documents(demo / "prose.txt"), 0)["eval"]
    tokenizer = data.load_tokenizer(demo / "featuregate")
    ends = np.cumsum([len(e.ids) + 1 for e in tokenizer.encode_batch(docs)])  # where each document's end id ends
    begins = np.searchsorted(ends, np.arange(N_SEQS) * (cache.seq_len + 1), side="right")  # [n]
    found = cache.window_documents(N_SEQS)
    assert found.tolist() == (begins - begins[0]).tolist() and len(set(found.tolist())) == 2
    assert cache.window_documents(5).tolist() == found[:5].tolist()
    older = tmp_path / "older"
    shutil.copytree(demo / "eval", older)
    manifest = json.loads((older / MANIFEST).read_text())
    del manifest["tokenizer"]["end_of_document"]
    (older / MANIFEST).write_text(json.dumps(manifest))
    assert open_cache(older).window_documents(N_SEQS) is None
    manifest["tokenizer"]["end_of_document"] = "0"
    (older / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CacheError, match="tokenizer.end_of_document"):
        open_cache(older)


def test_window_documents_at_document_boundaries(demo, tmp_path):
    """End ids where a window begins, where it ends (its last target) and twice inside one: a window opening
    on an end id predicts the next document, so it is that one's; documents may be skipped (a window ending
    two), and resampling takes their labels as they are."""
    windows = np.random.default_rng(0).integers(3, 300, (5, 17))  # [N, T + 1], no end id (0) yet
    windows[0, [5, 10]] = 0  # window 0 ends documents 0 and 1
    windows[1, 0] = 0  # window 1 opens on document 2's end: it is document 3's
    windows[2, 16] = 0  # window 2's last target ends document 3
    cache = fca.build_cache(fca.load_model(demo / "featuregate"), windows, tmp_path / "eval", batch_size=5)
    assert open_cache(cache).window_documents(5) is None  # windows from memory: their order in a text is unknown
    manifest = json.loads((cache / MANIFEST).read_text())
    manifest["tokenizer"]["end_of_document"] = 0
    (cache / MANIFEST).write_text(json.dumps(manifest))
    documents = open_cache(cache).window_documents(5)
    assert documents.tolist() == [0, 3, 3, 4, 4]
    values = np.arange(5.0)[:, None]
    assert np.array_equal(resampled_means(values, documents, 50), resampled_means(values, [0, 1, 1, 2, 2], 50))
    vocab = manifest["tokenizer"]["vocab_size"]
    for bogus in (-1, vocab, 300 * 10):  # ids no window can hold: every window would be one document
        manifest["tokenizer"]["end_of_document"] = bogus
        (cache / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(CacheError, match=f"tokenizer.end_of_document {bogus} is not a token id in"):
            open_cache(cache)


@pytest.mark.slow
def test_audit_report(demo, tmp_path):
    assert (
        main(
            [
                "audit",
                "--model",
                str(demo / "featuregate"),
                "--cache",
                str(demo / "eval"),
                "--calibration",
                str(demo / "calibration"),
                "--dense",
                str(demo / "dense"),
                "--json",
                str(tmp_path / "a.json"),
                "--markdown",
                str(tmp_path / "a.md"),
                "--extra-conditions",
                "static_layer",  # one of the paper's conditions again: run once (it was refused as a repeat)
                "static_layer@blocks.0.gate",
                "static_layer@blocks.0.gate",  # an extra given twice: run once too
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "a.json").read_text())
    assert list(report["definitions"]["extra_conditions"]) == ["static_layer@blocks.0.gate"]  # (not static_layer)
    assert report["exactness"]["max_abs_logit_diff"] == 0.0
    assert report["exactness"]["nll_live"] == report["exactness"]["nll_correct"]
    assert set(report["conditions"]) >= {"correct", "cross_input", "token_shuffle", "static_layer", "global_mean"}
    for row in report["conditions"].values():
        assert row["penalty_ci95"][0] <= row["penalty"] <= row["penalty_ci95"][1]
    # The windows' documents: two, too few for CIs that resample them (the shipped demo's audit has them).
    documents = open_cache(demo / "eval").window_documents(N_SEQS)
    assert report["cache"]["documents"] == len(set(documents.tolist())) == 2
    assert not any("penalty_ci95_documents" in row for row in report["conditions"].values())
    assert 0.0 <= report["variance"]["layer_identity_share"] <= 1.0 and set(report["variance"]["per_site"]) == {
        "blocks.0.gate",
        "blocks.1.gate",
    }
    assert report["execution"]["blocks_executed_fraction"] == 1.0
    assert 0 < report["execution"]["controller_flops_share"] < 0.2
    assert report["execution"]["latency_ratio_vs_dense"] > 0
    assert report["definitions"]["global_mean_families"] == {"gate": ["blocks.0.gate", "blocks.1.gate"]}
    markdown = (tmp_path / "a.md").read_text()
    assert "# FCA audit: featuregate\n\nModel type `featuregate`, " in markdown
    assert f"All {N_SEQS} evaluated windows lie in only 2 documents: too few for a CI over documents" in markdown
    # What global_mean used is the calibration cache's grand mean, said in both (the evaluated cache's differs).
    used = calibration_profiles(open_cache(demo / "calibration")).family_means["gate"]
    assert report["calibration"]["family_grand_means"] == {"gate": pytest.approx(used, rel=1e-12)}
    assert used != pytest.approx(report["variance"]["family_grand_means"]["gate"], rel=1e-9)
    assert f"global_mean gives every coefficient its family's calibration grand mean: gate {used:.6g}." in markdown
    # The fingerprint is what its definition says, so a reader can recompute it without FCA.
    assert "not the hash of a checkpoint file" in report["definitions"]["model_fingerprint"]
    digest = hashlib.sha256()
    for name, tensor in sorted(fca.load_model(demo / "featuregate").state_dict().items()):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode() + tensor.contiguous().numpy().tobytes())
    assert report["model"]["fingerprint"] == digest.hexdigest()
    exe = report["execution"]
    assert (
        f"(the median of {exe['runs']} interleaved runs' ratios, batch {exe['batch_shape']}, cpu; median times "
        f"{exe['model_ms_median']:.1f} ms and {exe['dense_ms_median']:.1f} ms, whose quotient" in markdown
    )
    chance = report["variance"]["chance_levels"]
    assert set(chance) == {"position_within_slot", "token_id_within_slot", "sequence_within_slot"}
    token_row = f"| token id within slot | {100 * report['variance']['factors']['token_id_within_slot']:.1f}% | "
    assert f"{token_row}{100 * chance['token_id_within_slot']:.2f}% |" in markdown
    assert main(["report", str(tmp_path / "a.json"), "--markdown", str(tmp_path / "b.md")]) == 0
    assert (tmp_path / "b.md").read_text() == (tmp_path / "a.md").read_text()


def test_audit_refuses_when_correct_is_not_exact(demo, tmp_path, monkeypatch, capsys):
    fake = ReplayResults(
        seqs=[0, 1],
        per_seq_nll={"correct": np.zeros(2)},
        conditions={},
        max_abs_logit_diff=1e-3,
        nll_live=1.0,
        nll_correct=1.0,
    )
    with pytest.raises(ExactnessError):
        check_exactness(fake)
    # Within the logit tolerance, the NLL may move by what such logits can move it, and no more.
    assert judge_mechanism(5e-7, 1.0, 1.0 + 1e-6, batches=1)["passed"]
    for logit_diff, nll_replayed in [(0.0, 1.0 + 1e-5), (2e-6, 1.0)]:
        with pytest.raises(ExactnessError, match="does not reproduce the live run"):
            judge_mechanism(logit_diff, 1.0, nll_replayed, batches=1)
    # The replays' figures as an inexact run gives them: `Experiment.run` judges them before the audit sees them.
    monkeypatch.setattr("fca.jobs.experiment.run_conditions", lambda *a, **k: fake)
    code = main(_audit_args(demo / "featuregate", demo / "eval", demo / "calibration", tmp_path / "r.json"))
    assert code == 3 and "does not reproduce" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_calibration_must_be_independent(demo, tmp_path, capsys):
    err = _cli_error(
        _audit_args(demo / "featuregate", demo / "eval", demo / "eval", tmp_path / "r.json"),
        capsys,
    )
    assert "same split" in err


def test_calibration_drawn_with_another_split_seed_is_refused(demo, tmp_path, capsys):
    """Splits of one corpus drawn with different seeds share documents: not an independent calibration."""
    build_cache_from_corpus(
        demo / "featuregate",
        demo / "prose.txt",
        "calibration",
        tmp_path / "calibration-seed1",
        num_seqs=4,
        batch_size=4,
        device="cpu",
        split_seed=1,
        show_progress=False,
    )
    err = _cli_error(
        _audit_args(demo / "featuregate", demo / "eval", tmp_path / "calibration-seed1", tmp_path / "r.json"), capsys
    )
    assert "calibration-seed1" in err and "split seed 1" in err and "--split-seed 0" in err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_the_same_text_in_another_corpus_file_is_not_an_independent_calibration(demo, tmp_path, capsys):
    """Another corpus file counted as independent by its fingerprint alone: the evaluated split's own text,
    saved as Parquet, was accepted as its calibration cache. Another file's text is compared now; other
    text still passes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fca.tables import data

    docs = data.load_documents(demo / "prose.txt")
    pq.write_table(pa.table({"body": docs}), tmp_path / "prose.parquet")
    write_corpus(tmp_path / "other.txt", seed=7)
    for corpus, out, column in (("prose.parquet", "same-text", "body"), ("other.txt", "other-text", "text")):
        build_cache_from_corpus(
            demo / "featuregate", tmp_path / corpus, "eval", tmp_path / out, num_seqs=8, batch_size=4,
            device="cpu", text_column=column, show_progress=False,
        )  # fmt: skip
    err = _cli_error(
        _audit_args(demo / "featuregate", demo / "eval", tmp_path / "same-text", tmp_path / "r.json"), capsys
    )
    assert "same-text: shares text with the evaluated cache" in err and "static profiles must be estimated" in err
    assert not (tmp_path / "r.json").exists()
    args = ["replay", "--model", str(demo / "featuregate"), "--cache", str(demo / "eval"), "--no-save"]
    args += ["--calibration", str(tmp_path / "other-text"), "--conditions", "static_layer", "--device", "cpu"]
    assert main(args) == 0, capsys.readouterr().err


def test_position_profile_needs_a_calibration_as_long_as_the_evaluated_windows(demo, tmp_path, capsys):
    build_cache_from_corpus(
        demo / "featuregate", demo / "prose.txt", "calibration", tmp_path / "short", num_seqs=4, seq_len=8,
        batch_size=4, device="cpu", show_progress=False,
    )  # fmt: skip
    args = ["replay", "--model", str(demo / "featuregate"), "--cache", str(demo / "eval"), "--no-save"]
    args += ["--calibration", str(tmp_path / "short"), "--conditions", "position_profile", "--device", "cpu"]
    err = _cli_error(args, capsys)
    assert "short" in err and "16 positions" in err and "has 8" in err
    assert main([*args[:-4], "--conditions", "static_layer", "--device", "cpu"]) == 0  # a per-site profile is fine
    assert f"{demo / 'eval'}: 12 sequences replayed (all it has; 32 asked for)" in capsys.readouterr().out


def test_an_audit_of_the_first_sequences_measures_their_variance_only(demo, tmp_path):
    from fca.tables.profiles import cache_moments

    cache = open_cache(demo / "eval")
    first, layout = cache_moments(cache, num_seqs=5)
    rows = cache.read_seqs(range(5))
    values = np.concatenate([rows[s].astype(np.float64) for s in layout.sites], axis=2)  # [5, T, C]
    assert first.num_seqs == 5 and first.count == 5 * 16
    np.testing.assert_allclose(first.slot_mean, values.mean(axis=(0, 1)), rtol=1e-12)
    whole, _ = cache_moments(cache)
    assert whole.num_seqs == N_SEQS and cache_moments(cache, num_seqs=N_SEQS)[0].count == whole.count
    args = _audit_args(demo / "featuregate", demo / "eval", demo / "calibration", tmp_path / "r.json")
    assert main([*args, "--num-seqs", "5", "--device", "cpu", "--sweep", "none"]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["variance"]["num_tokens"] == 5 * 16 == report["cache"]["sequences"] * 16


def test_gap_retention_undefined_without_gap():
    table = {
        "correct": {"nll": 2.0, "penalty_ci95": [0, 0]},
        "global_mean": {"nll": 2.001, "penalty_ci95": [-0.01, 0.01]},
        "static_layer": {"nll": 2.0005, "penalty_ci95": [0, 0]},
    }
    assert gap_retention(table) == {"static_layer": None}
    # no gap at all, every sequence alike: a zero-width CI at zero is not a positive gap (no 0/0)
    table["global_mean"] = {"nll": 2.0, "penalty_ci95": [0.0, 0.0]}
    assert gap_retention(table) == {"static_layer": None}
    # one sequence: no CI, NaN live and null once saved
    for undefined in ([float("nan")] * 2, [None, None]):
        table["global_mean"] = {"nll": 2.001, "penalty_ci95": undefined}
        assert gap_retention(table) == {"static_layer": None}
    table["global_mean"]["penalty_ci95"] = [0.0005, 0.0015]
    assert gap_retention(table)["static_layer"] == pytest.approx(0.5)
    table["static_layer"]["nll"] = 2.0002  # near correct: most of the gap kept
    assert gap_retention(table)["static_layer"] == pytest.approx(0.8)
    assert gap_retention({"global_mean": table["global_mean"], "static_layer": table["static_layer"]}) == {}


@pytest.mark.slow
def test_replay_cli_saves_runs(demo, capsys):
    from app.figures import nll_bars
    from fca.jobs.runs import run_replay
    from fca.tables.runs import condition_rows, list_runs

    FIGURE_COLUMNS = {"NLL (nats/token)": "nll", "NLL 95% CI low": "ci_lo", "NLL 95% CI high": "ci_hi"}

    assert (
        main(
            [
                "replay",
                "--model",
                str(demo / "featuregate"),
                "--cache",
                str(demo / "eval"),
                "--calibration",
                str(demo / "calibration"),
                "--conditions",
                "static_layer",
                "interpolate:0.5",
                "--num-seqs",
                "6",
                "--seed",
                "2",
            ]
        )
        == 0
    )
    runs = list_runs(demo / "eval")
    assert runs and runs[0]["spec"]["conditions"] == ["correct", "static_layer", "interpolate:0.5"]
    # Six windows of two documents: too few to resample, said so (the shipped demo's replay prints both CIs).
    out = capsys.readouterr().out
    assert runs[0]["results"]["documents"] == 2 and "] over documents" not in out
    assert "All 6 evaluated windows lie in only 2 documents: too few for a CI over documents" in out
    again = run_replay(
        demo / "featuregate",
        demo / "eval",
        demo / "calibration",
        ["static_layer", "interpolate:0.5"],
        num_seqs=6,
        seed=2,
        device="cpu",
        save=False,
    )
    assert json.loads(strict_json(again["results"]["conditions"])) == runs[0]["results"]["conditions"]  # (NaN: null)
    assert not (demo / "eval" / "runs").exists()  # runs live beside the cache, never inside it
    # One sequence has no CI: said so, and saved as null (strict JSON readers refuse NaN).
    base = ["replay", "--model", str(demo / "featuregate"), "--cache", str(demo / "eval")]
    capsys.readouterr()
    one = ["--calibration", str(demo / "calibration"), "--conditions", "static_layer", "global_mean"]
    assert main([*base, *one, "--num-seqs", "1"]) == 0
    said = capsys.readouterr().out
    assert "(no CI from under 10 sequences)" in said
    long = "interpolate:0.25@blocks.0.gate,blocks.1.gate"  # longer than the columns once were
    assert main([*base, *one[:2], "--conditions", long, "--num-seqs", "2", "--no-save"]) == 0
    rows_said = [line for line in (said + capsys.readouterr().out).splitlines() if "  NLL " in line]
    assert {line.split()[0] for line in rows_said} >= {"static_layer", long}
    assert len({line.index("  NLL ") for line in rows_said[-2:]}) == 1  # (correct and the long one, in line)
    # It is listed (its null CI bounds once broke the gap retention, and the run vanished from the list),
    # with no interval where one sequence gives none, and no retention: the gap is not shown positive.
    newest = list_runs(demo / "eval")[0]  # the run just made, though both may fall in one second
    assert newest["spec"]["num_seqs"] == 1 and newest["created"] > runs[0]["created"]
    assert newest["spec"]["calibration_fingerprint"] == open_cache(demo / "calibration").fingerprint
    assert newest["spec"]["batch_size"] == open_cache(demo / "eval").environment["batch_size"]  # (no --batch given)
    rows = {r["condition"]: r for r in condition_rows(newest)}
    assert set(rows) == {"correct", "static_layer", "global_mean"}
    for name in ("static_layer", "global_mean"):
        bounds = [rows[name][k] for k in ("NLL 95% CI low", "NLL 95% CI high", "penalty 95% CI low")]
        assert np.isnan(bounds).all() and np.isfinite(rows[name]["NLL (nats/token)"])
    assert [r["gap retention"] for r in rows.values()] == [None] * 3
    # its bars keep their height though no CI reaches above them
    figure = nll_bars(pd.DataFrame(condition_rows(newest)).rename(columns=FIGURE_COLUMNS))
    assert figure.layout.yaxis.range[1] >= max(r["NLL (nats/token)"] for r in rows.values())
    saved = Path(newest["path"]).read_text()

    def refuse(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")

    strict = json.loads(saved, parse_constant=refuse)
    assert strict["results"]["conditions"]["static_layer"]["penalty_ci95"] == [None, None]
    # Files in the runs folder that are not run records are skipped, not shown half-read.
    folder = Path(list_runs(demo / "eval")[0]["path"]).parent
    count = len(list_runs(demo / "eval"))
    for name, junk in [("a", []), ("b", {}), ("c", {"spec": {"conditions": "abc"}}), ("d", {"spec": None})]:
        (folder / f"zzzz-{name}.json").write_text(json.dumps(junk))
    damaged = json.loads(saved)
    damaged["results"]["conditions"]["correct"]["penalty_ci95"] = [0.0]
    (folder / "zzzz-e.json").write_text(json.dumps(damaged))
    assert len(list_runs(demo / "eval")) == count


@pytest.mark.parametrize("alpha", ["1e30", "1e40"])  # (1e40 overflows float32 while the coefficients are made)
def test_coefficients_that_overflow_the_model_give_no_figures(demo, capsys, recwarn, alpha):
    """interpolate:1e30 drives the gates to inf: the NLL is not a number, and the run says so (exit 2)
    rather than reporting, saving and plotting NaN as a result; numpy's overflow warnings do not come first."""
    args = ["replay", "--model", str(demo / "featuregate"), "--cache", str(demo / "eval"), "--no-save"]
    code = main(
        [*args, "--calibration", str(demo / "calibration"), "--num-seqs", "2", "--conditions", f"interpolate:{alpha}"]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (after the progress bar)
    assert code == 2 and err.startswith("fca: error: interpolate:") and "NLL is not finite in 2 of 2 sequences" in err
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in recwarn]


def test_blocked_moments_equal_the_whole_array_moments():
    """The writer's cache-sized blocks (`Moments.add_blocked`) give the sums of `Moments.add` over the
    whole array, whatever the block size (positions not a multiple of it, one-row blocks); given per-site
    arrays instead of one, the same bits (and the same token sums)."""
    rng = np.random.default_rng(3)
    values = (rng.standard_normal((4, 37, 9)) + rng.standard_normal(9)).astype(np.float32)  # [n, T, C]
    tokens = rng.integers(0, 50, (4, 37))
    whole = Moments(9, 37, None)
    whole.add(values, tokens)
    whole.add(values[:3], tokens[:3])
    sites = [values[..., :2], values[..., 2:3], values[..., 3:]]  # per-site arrays, as a writer passes them
    for rows in (1, 8, 37, 64, 80, 200, None):  # 80, 200 and None: several whole sequences per block
        blocked, by_site = Moments(9, 37, None), Moments(9, 37, None)
        blocked.add_blocked(values, rows)
        blocked.add_blocked(values[:3], rows)
        by_site.add_blocked(sites, rows)
        by_site.add_blocked([s[:3] for s in sites], rows)
        assert (blocked.count, blocked.num_seqs) == (whole.count, whole.num_seqs)
        for key in ("sum", "sumsq", "pos_count", "pos_sum", "seq_term", "minimum", "maximum"):
            np.testing.assert_allclose(getattr(blocked, key), getattr(whole, key), rtol=1e-13, atol=0, err_msg=key)
            np.testing.assert_array_equal(getattr(by_site, key), getattr(blocked, key), err_msg=key)  # same order
    with pytest.raises(ValueError, match="slots"):
        Moments(9, 37, None).add_blocked(sites[:2])
    for got, expected in zip(token_sums(sites, tokens), token_sums(values, tokens)):
        np.testing.assert_array_equal(got, expected)


# ---------------------------------------------------------------------------------------------
# Outputs never replace what they are not: a mistyped path loses nothing.


def _tree(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_overwrite_replaces_only_a_cache(demo, tmp_path, capsys, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(demo / "featuregate", model)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    before = {p: _tree(p) for p in (model, notes)}
    build = ["build-cache", "--model", str(model), "--corpus", str(demo / "prose.txt"), "--split", "eval"]
    for out in (model, notes):
        err = _cli_error([*build, "--out", str(out), "--num-seqs", "4", "--batch", "4", "--overwrite"], capsys)
        assert str(out) in err and "not a cache" in err
    (tmp_path / "afile").write_text("x")
    err = _cli_error([*build, "--out", str(tmp_path / "afile"), "--num-seqs", "4", "--overwrite"], capsys)
    assert "is a file" in err
    err = _cli_error([*build, "--out", str(tmp_path / "afile" / "cache"), "--num-seqs", "4"], capsys)
    assert f"{tmp_path / 'afile'} is a file, so no folder can be made below it" in err  # ([Errno 17] File exists)
    # Reports, studies and corpora below a file: refused before the work, not by mkdir after it.
    from fca.jobs.experiment import Experiment

    monkeypatch.setattr(Experiment, "run", lambda *a, **k: pytest.fail("audited before the check"))
    below = tmp_path / "afile" / "out"
    audit = _audit_args(demo / "featuregate", demo / "eval", demo / "calibration", tmp_path / "ok.json")
    for command in (
        [*audit[: audit.index("--json")], "--json", str(below / "a.json")],
        [*audit[: audit.index("--json")], "--markdown", str(below / "a.md")],
        ["study", str(Path(__file__).parents[1] / "cache" / "demo" / "audit.json"), "--json", str(below / "s.json")],
    ):
        err = _cli_error(command, capsys)
        assert f"{tmp_path / 'afile'} is a file, so no folder can be made below it" in err, command
    assert {p: _tree(p) for p in (model, notes)} == before and (tmp_path / "afile").read_text() == "x"
    # Training refuses an existing folder before it trains, and with --overwrite replaces only a model.
    train = ["train", "--corpus", str(demo / "prose.txt"), "--steps", "1"]
    err = _cli_error([*train, "--out", str(model)], capsys)
    assert "already exists" in err and "--overwrite" in err
    err = _cli_error([*train, "--out", str(demo / "eval"), "--overwrite"], capsys)
    assert "not a model" in err
    assert _tree(model) == before[model]


def test_reports_and_studies_replace_only_earlier_ones(demo, tmp_path, capsys):
    cache = _copy(demo, tmp_path)
    manifest = (cache / MANIFEST).read_bytes()
    args = _audit_args(demo / "featuregate", cache, demo / "calibration", cache / MANIFEST)
    err = _cli_error([*args, "--num-seqs", "4", "--sweep", "none", "--device", "cpu"], capsys)
    assert f"manifest.json: inside the cache {cache}; write the audit report (JSON) beside the cache" in err
    assert (cache / MANIFEST).read_bytes() == manifest and not list(tmp_path.rglob("*.tmp"))
    report = tmp_path / "audit.json"
    assert main([*args[:-1], str(report), "--num-seqs", "4", "--sweep", "none", "--device", "cpu"]) == 0
    assert main([*args[:-1], str(report), "--num-seqs", "4", "--sweep", "none", "--device", "cpu"]) == 0  # again
    capsys.readouterr()
    text = report.read_text()
    assert "not an earlier audit report (Markdown)" in _cli_error(
        ["report", str(report), "--markdown", str(report)], capsys
    )
    err = _cli_error(["study", str(report), str(tmp_path / "other.json"), "--json", str(report)], capsys)
    assert "not an earlier study (JSON)" in err and report.read_text() == text  # refused before reading audits
    (tmp_path / "future.json").write_text(json.dumps({**json.loads(text), "fca_report_version": 99}))
    assert "report version 99" in _cli_error(["report", str(tmp_path / "future.json")], capsys)


def test_a_gated_model_is_not_a_dense_twin(demo, tmp_path, capsys):
    args = _audit_args(demo / "featuregate", demo / "eval", demo / "calibration", tmp_path / "r.json")
    err = _cli_error([*args, "--dense", str(demo / "featuregate"), "--num-seqs", "4", "--sweep", "none"], capsys)
    assert f"error: {demo / 'featuregate'}: has controller sites, so it is not a Dense twin" in err  # the whole path
    assert not (tmp_path / "r.json").exists()
    # A dense model of other sizes would give a latency ratio that says nothing about the controllers.
    corpus = next(demo.glob("*.txt"))
    make_model_dir(tmp_path / "wider", corpus, gated=False, d_model=48)
    err = _cli_error([*args, "--dense", str(tmp_path / "wider"), "--num-seqs", "4", "--sweep", "none"], capsys)
    assert f"{tmp_path / 'wider'}: not the Dense twin of featuregate (a twin is the same family with the same" in err


def test_a_damaged_model_directory_or_corpus_is_named_in_one_line(demo, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(demo / "featuregate", model)
    config = json.loads((model / "config.json").read_text())
    build = ["build-cache", "--model", str(model), "--corpus", str(demo / "prose.txt"), "--split", "eval"]
    build += ["--out", str(tmp_path / "c"), "--num-seqs", "4", "--batch", "4", "--device", "cpu"]
    for broken, said in (
        ([], "a JSON list, not an object"),
        # The reason names the setting (it was "not all arguments converted during string formatting").
        ({**config, "d_model": "32"}, "cannot build a featuregate model from it (d_model must be a whole number"),
        ({**config, "max_seq_len": -1}, "cannot build a featuregate model from it (max_seq_len must be a whole"),
        ({**config, "n_heads": 0}, "cannot build a featuregate model from it (n_heads must be a whole number"),
    ):
        (model / "config.json").write_text(json.dumps(broken))
        err = _cli_error(build, capsys)
        assert f"{model / 'config.json'}: {said}" in err, err
    (model / "config.json").write_text(json.dumps(config))
    (model / "tokenizer.json").write_text("{")
    assert f"{model / 'tokenizer.json'}: not a readable tokenizer" in _cli_error(build, capsys)
    shutil.copy(demo / "featuregate" / "tokenizer.json", model / "tokenizer.json")
    table = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), table)
    err = _cli_error([*build[:4], str(table), *build[5:]], capsys)
    assert f"{table}: column 'text' holds int64, not text" in err
    (tmp_path / "short.txt").write_text("one\n\ntwo\n")
    err = _cli_error([*build[:4], str(tmp_path / "short.txt"), *build[5:]], capsys)
    assert str(tmp_path / "short.txt") in err and "at least 3 documents" in err
    assert not (tmp_path / "c").exists() and not (tmp_path / "c.partial").exists()


def test_overwrite_never_deletes_what_a_cache_or_model_does_not_hold(demo, tmp_path, capsys):
    build = ["build-cache", "--model", str(demo / "featuregate"), "--corpus", str(demo / "prose.txt"), "--split"]
    build += ["eval", "--num-seqs", "4", "--batch", "4", "--overwrite", "--out"]
    site = tmp_path / "site"  # a web project that happens to hold a manifest.json
    (site / "js").mkdir(parents=True)
    (site / "manifest.json").write_text('{"manifest_version": 3}')
    (site / "js" / "a.js").write_text("x")
    notes = _copy(demo, tmp_path)  # a real cache with the user's notes beside its parts
    (notes / "README.txt").write_text("mine")
    project = tmp_path / "project"  # a project that happens to hold a config.json
    (project / "src").mkdir(parents=True)
    (project / "config.json").write_text('{"name": "x"}')
    (project / "src" / "main.py").write_text("x")
    partial = tmp_path / "mine.partial"  # a folder the user named like a build's own
    partial.mkdir()
    (partial / "mine.txt").write_text("mine")
    lone = tmp_path / "lone"  # another tool's manifest.json alone: nothing beside it says it is not a cache
    lone.mkdir()
    (lone / "manifest.json").write_text('{"name": "other tool"}')
    settings = tmp_path / "settings"  # ... and another tool's config.json alone
    settings.mkdir()
    (settings / "config.json").write_text('{"name": "x"}')
    cut = tmp_path / "cut"  # a manifest.json that is not JSON at all: not ours either
    cut.mkdir()
    (cut / "manifest.json").write_text("{not json")
    before = {p: _tree(p) for p in (site, notes, project, partial, lone, settings, cut)}
    assert "cut: its manifest.json is not one FCA writes for a cache" in _cli_error([*build, str(cut)], capsys)
    assert "lone: its manifest.json is not one FCA writes for a cache" in _cli_error([*build, str(lone)], capsys)
    assert "js" in _cli_error([*build, str(site)], capsys)
    assert "README.txt" in _cli_error([*build, str(notes)], capsys)
    assert "mine.partial: is not a build in progress" in _cli_error([*build, str(tmp_path / "mine")], capsys)
    assert "folder of its own" in _cli_error([*build, "."], capsys)
    train = ["train", "--corpus", str(demo / "prose.txt"), "--steps", "1", "--overwrite", "--out", str(project)]
    assert "src" in _cli_error(train, capsys)
    assert "its config.json is not one FCA writes for a model" in _cli_error([*train[:-1], str(settings)], capsys)
    assert "--lr" in _cli_error_argparse([*train[:-2], "--lr", "inf", "--out", str(tmp_path / "m")], capsys)
    corpus = ["corpus", "--overwrite", "--out", str(notes / "manifest.json")]
    assert f"manifest.json: inside the cache {notes}; write the text corpus" in _cli_error(corpus, capsys)
    corpus[-1] = str(project / "config.json")  # not in a cache: refused as no earlier corpus
    assert "not an earlier text corpus" in _cli_error(corpus, capsys)
    assert {p: _tree(p) for p in (site, notes, project, partial, lone, settings, cut)} == before
    (tmp_path / "empty").mkdir()  # an empty folder holds nothing to lose: --overwrite builds into it
    assert main([*build, str(tmp_path / "empty")]) == 0 and open_cache(tmp_path / "empty").num_seqs == 4


def _cli_error_argparse(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("fca: error:") and err.count("\n") == 1, err
    return err


def test_damaged_reports_devices_and_one_path_for_two_outputs_are_refused(demo, tmp_path, capsys):
    args = _audit_args(demo / "featuregate", demo / "eval", demo / "calibration", tmp_path / "r.json")
    assert main([*args, "--num-seqs", "99", "--sweep", "none", "--device", "cpu"]) == 0
    assert f"{demo / 'eval'}: {N_SEQS} sequences audited (all it has; 99 asked for)" in capsys.readouterr().err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["cache"]["sequences"] == N_SEQS  # the JSON counts the sequences evaluated, not those asked for
    correct = report["conditions"]["correct"]
    for damage, said, studied in (  # (each names the field's path)
        ({"conditions": 5}, "(conditions is a number, not an object)", True),
        (
            {"conditions": {**report["conditions"], "correct": {**correct, "nll": "x"}}},
            "conditions.correct.nll is a string",
            True,
        ),
        ({"interpolation_sweep": 7}, "(interpolation_sweep is a number, not a list)", True),
        ({"exactness": None}, "(exactness is null, not an object)", True),
        (
            {"conditions": {**report["conditions"], "correct": {**correct, "penalty_ci95": [0]}}},
            "(conditions.correct.penalty_ci95 is not a [low, high] pair)",
            True,
        ),
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**report, **damage}))
        assert said in _cli_error(["report", str(bad)], capsys)
        if studied:
            assert said in _cli_error(["study", str(bad), str(tmp_path / "r.json")], capsys)
    # NaN is not JSON (FCA writes null): a report edited to hold it was rendered as "nan", with exit code 0.
    correct = {**report["conditions"]["correct"], "nll": float("nan")}
    bad.write_text(json.dumps({**report, "conditions": {**report["conditions"], "correct": correct}}))
    said = "bad.json: not a readable audit report (NaN is not JSON; FCA writes null where a figure is undefined)"
    assert said in _cli_error(["report", str(bad)], capsys)
    assert said in _cli_error(["study", str(bad), str(tmp_path / "r.json")], capsys)
    (tmp_path / "future.json").write_text(json.dumps({**report, "fca_report_version": 99}))
    assert "report version 99" in _cli_error(["study", str(tmp_path / "future.json"), str(bad)], capsys)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for endless in ("/dev/zero", str(fifo)):  # read without end, or never: refused before reading
        assert "not a readable audit report (not a regular file)" in _cli_error(["report", endless], capsys)
    assert "not a regular file" in _cli_error(["report", str(tmp_path / "r.json"), "--markdown", str(fifo)], capsys)
    same = str(tmp_path / "same.out")
    err = _cli_error([*args[:-1], same, "--markdown", same, "--num-seqs", "4", "--sweep", "none"], capsys)
    assert "both the JSON and the Markdown" in err and not (tmp_path / "same.out").exists()
    # `fca bench --json` replaces only an earlier bench result, and says so before minutes of measuring.
    err = _cli_error(["bench", "--model", str(demo / "featuregate"), "--json", str(tmp_path / "r.json")], capsys)
    assert "r.json: exists and is not an earlier bench result (JSON)" in err
    assert json.loads((tmp_path / "r.json").read_text()) == report


@pytest.mark.slow
def test_bench_measures_every_figure_it_documents(demo, tmp_path, monkeypatch, capsys):
    """`fca bench` run small: every README figure is a finite number, the cache it timed replays exactly,
    and its scratch caches are gone (no timing is asserted)."""
    import tempfile

    from fca.jobs.bench import run_bench

    # its own temporary folder: another bench running beside this test leaves none of its scratch here
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    result = run_bench(
        demo / "featuregate",
        None,  # no corpus: the windows stored in the eval cache beside the model
        device="cpu",
        num_seqs=4,
        capture_seqs=8,
        batch_size=4,
        repeats=1,
        stats_seqs=8,
        big_cache_factor=2,
        writer_seqs=8,
        show_progress=True,
    )
    # The writer-scaling step's runs (2 warm-ups, 5 repeats of 1 and 2 threads) each show on the bar.
    shown = capsys.readouterr().err
    assert all(f"writer scaling: run {k}/12" in shown for k in range(1, 13))
    assert "run 12/12, 2 threads" in shown
    figures = (
        "capture_ratio", "replay_ratio", "replay_from_cache_ratio", "batched_conditions_ratio",
        "batched_conditions_ratio_one_sequence", "parquet_bytes_ratio", "long_format_ratio",
        "long_format_bytes_ratio", "writer_mb_s_1", "writer_mb_s_2", "writer_scaling_2", "stats_peak_mem_mb",
    )  # fmt: skip
    for key in figures:
        assert isinstance(result[key], float) and 0 < result[key] < float("inf"), key
    assert result["exactness"] == {"max_abs_logit_diff": 0.0, "fidelity": "bit-identical"}
    assert (result["num_seqs"], result["capture_seqs"], result["device"]) == (4, 8, "cpu")
    assert set(result["capture_stages_s"]) >= {"record", "encode"}
    assert result["stats_big_cache_mb"] > result["stats_demo_cache_mb"]
    assert list(scratch.iterdir()) == []


def test_an_unknown_device_is_one_line(demo, tmp_path, capsys):
    from fca.engine.loading import resolve_device
    from fca.tables.errors import ModelLoadError

    build = ["build-cache", "--model", str(demo / "featuregate"), "--corpus", str(demo / "prose.txt")]
    build += ["--split", "eval", "--out", str(tmp_path / "c")]
    train = ["train", "--corpus", str(demo / "prose.txt"), "--out", str(tmp_path / "m")]
    study = ["demo-study", "--out", str(tmp_path / "s")]
    # every command reads a device the same way, before any work starts
    for args, device in ((build, "gpu"), (train, "cuda:x"), (study, "cuda1"), ([*study, "--device", "cpu"], "gpu")):
        flag = "--audit-device" if "--device" in args else "--device"
        said = _cli_error_argparse([*args, flag, device], capsys)
        assert said.startswith(
            f"fca: error: {args[0]}: argument {flag}: expected auto, cpu, cuda or cuda:N, not {device!r}"
        )
    assert not any(tmp_path.iterdir())
    with pytest.raises(ModelLoadError, match="unknown device 'gpu'"):  # library callers are told too
        resolve_device("gpu")


def test_latency_is_the_median_of_model_over_dense_per_interleaved_pair(monkeypatch):
    """On a clock that each forward advances by a known amount (the model 3 units, its twin 2, one pair
    slowed by other work), the ratio is model / dense, its median over pairs whoever went first, and the
    spread is that of the pairs: a ratio inverted to dense / model passed the audit's range checks."""
    import fca.engine.execution as execution

    clock = [0.0]
    monkeypatch.setattr(execution.time, "perf_counter", lambda: clock[0])
    calls = []

    def forward(cost):
        def run(ids):
            calls.append(cost)
            clock[0] += cost * (4.0 if len(calls) in (7, 8) else 1.0)  # the fourth pair, both slowed

        return run

    out = execution.latency_ratio(forward(3.0), forward(2.0), torch.zeros(1, 4, dtype=torch.long), runs=5, warmup=1)
    assert out["latency_ratio_vs_dense"] == 1.5 and out["ratio_min"] == out["ratio_max"] == 1.5
    assert out["model_ms_median"] == 3000.0 and out["dense_ms_median"] == 2000.0
    assert calls[:4] == [3.0, 2.0, 2.0, 3.0]  # interleaved: the model first, then its twin first
