"""Behaviours a second mutation review found untested: the run's seed reaching every random draw, the
position profile's values, the grammar's refusals when a Condition is made directly, the vocabulary bound
of cached token ids, and a cache whose site has another channel count than the model's."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fca.engine.sites import SiteSpec
from fca.tables.conditions import Condition, condition_coefficients, derangement, position_permutation
from fca.tables.errors import CacheError
from fca.tables.profiles import Profiles
from fca.tables.store import open_cache

DEMO = Path(__file__).resolve().parents[1] / "cache" / "demo"


def test_the_seed_reaches_the_derangement_and_the_permutations():
    """With the seed ignored (a fixed generator), every run's cross_input and token_shuffle would be the same
    draw, and a study over seeds would repeat one sample."""
    assert len({tuple(derangement(16, seed)) for seed in range(5)}) == 5
    assert len({tuple(position_permutation(3, 32, seed)) for seed in range(5)}) == 5
    # One permutation per site, each unlike the shared one (site 0's key once drew the shared permutation).
    for n in range(3):
        drawn = {tuple(position_permutation(n, 32, 7, site)) for site in range(4)}
        assert len(drawn) == 4 and tuple(position_permutation(n, 32, 7)) not in drawn
    own = {"a": np.arange(2 * 32 * 1, dtype=np.float32).reshape(2, 32, 1)}
    shuffled = [condition_coefficients(Condition("token_shuffle", seed=s), own, [0, 1])["a"] for s in (1, 2)]
    assert not np.array_equal(*shuffled)


def test_the_position_profile_is_the_calibration_mean_at_each_position():
    T, K = 4, 2
    position = {"a": np.arange(8 * K, dtype=np.float64).reshape(8, K)}  # a calibration cache of 8 positions
    profiles = Profiles({"a": np.full(K, 100.0)}, {"a": np.full(K, -1.0)}, position, {}, None, None)
    own = {"a": np.zeros((3, T, K), np.float32)}
    out = condition_coefficients(Condition("position_profile"), own, [0, 1, 2], profiles)
    np.testing.assert_array_equal(np.broadcast_to(out["a"], (3, T, K))[1], position["a"][:T])


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda: Condition("interpolate", float("nan")), "interpolate needs a finite alpha, not nan"),
        (lambda: Condition("interpolate", float("inf")), "interpolate needs a finite alpha, not inf"),
        (lambda: Condition("static_layer", independent=True), "static_layer takes no \\+independent"),
    ],
)
def test_a_condition_made_directly_is_held_to_the_grammar(make, said):
    with pytest.raises(ValueError, match=said):
        make()


def test_cached_token_ids_must_lie_below_the_vocabulary():
    from fca.engine.replay import check_token_ids

    rows = {"token": np.array([[0, 5, 9]]), "target": np.array([[5, 9, 10]])}
    check_token_ids(rows, 11, Path("c"), [0])
    with pytest.raises(CacheError, match=r"c: sequences 0-0 hold token ids from 0 to 10, outside .*\[0, 10\)"):
        check_token_ids(rows, 10, Path("c"), [0])  # id 10 of a 10-id vocabulary: one past the end


def test_a_site_with_another_channel_count_than_the_models_is_refused():
    cache = open_cache(DEMO / "eval")
    specs = dict(cache.site_specs)
    cache.check_sites(specs)
    first = next(iter(specs))
    specs[first] = SiteSpec(axes=(("gate", specs[first].num_channels + 1),), family=specs[first].family)
    with pytest.raises(CacheError, match=rf"site '{first}' has 12 channels here and 13 in the model"):
        cache.check_sites(specs)


def _rewrite_moments(cache_dir: Path, change) -> None:
    """The cache's stored moments changed by `change(arrays)`, the manifest's hash of them updated to match
    (a hash-consistent file that is still wrong)."""
    import json

    from fca.tables.schema import file_sha256, read_arrays, write_arrays

    arrays = dict(read_arrays(cache_dir / "moments.npz"))
    change(arrays)
    write_arrays(cache_dir / "moments.npz", arrays)
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    manifest["moments"]["sha256"] = file_sha256(cache_dir / "moments.npz")
    (cache_dir / "manifest.json").write_text(json.dumps(manifest))


def test_stored_moments_are_checked_before_they_are_used(tmp_path):
    """The statistics read the moments a build stored, not the coefficients: a changed file, moments of
    another number of sequences, or non-finite sums must be refused, never reported; and a scan of part of
    a cache checks the parts it reads."""
    import shutil

    from fca.tables.profiles import cache_moments

    def copy(name: str) -> Path:
        return Path(shutil.copytree(DEMO / "eval", tmp_path / name))

    changed = copy("changed")
    data = bytearray((changed / "moments.npz").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (changed / "moments.npz").write_bytes(bytes(data))
    for name, change, said in (
        ("seqs", lambda a: a.__setitem__("num_seqs", np.int64(255)), "moments of 255 sequences, the cache has 256"),
        ("nan", lambda a: a["sum"].__setitem__(3, np.nan), "non-finite coefficients \\(NaN or inf\\) in the cache"),
    ):
        _rewrite_moments(copy(name), change)
        with pytest.raises(CacheError, match=said):
            cache_moments(open_cache(tmp_path / name))
    with pytest.raises(CacheError, match="moments.npz: contents do not match the manifest's sha256"):
        cache_moments(open_cache(changed))
    part_changed = copy("part")
    part = next(part_changed.glob("part-*.parquet"))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="contents do not match the manifest's sha256"):
        cache_moments(open_cache(part_changed), num_seqs=4)  # scanned, since the stored moments are all 256's


def test_the_engine_refuses_a_condition_twice():
    """Two conditions of one name would share one row of results, the second overwriting the first."""
    import fca
    from fca.engine.replay import run_conditions

    model = fca.load_model(DEMO / "featuregate")
    twice = [Condition("correct"), Condition("static_layer"), Condition("static_layer")]
    with pytest.raises(ValueError, match=r"^condition\(s\) static_layer given more than once$"):
        run_conditions(model, open_cache(DEMO / "eval"), twice, seqs=[0, 1])


def test_a_shard_must_be_whole_batches_of_the_whole_run():
    """A shard starting inside a batch would score batches the single-process run never forms, and the
    exactness check (which compares within a batch) would judge other batches than the merged run says."""
    from fca.engine.replay import _shard_bounds

    assert _shard_bounds(None, 4, 10) == (0, 10)
    assert _shard_bounds((4, 8), 4, 10) == (4, 8) and _shard_bounds((8, 10), 4, 10) == (8, 10)  # last: short
    assert _shard_bounds((8, 8), 4, 10) == (8, 8)  # an empty shard scores nothing, and is not an error
    for shard in ((2, 8), (4, 6), (8, 12), (8, 4), (-4, 4)):
        with pytest.raises(ValueError, match=re.escape(f"shard {shard} is not whole batches of 4 within 10")):
            _shard_bounds(shard, 4, 10)


@pytest.mark.slow
def test_replaying_some_sites_frees_every_site_and_still_refuses_unknown_names():
    """`replay(..., only=...)` takes every site for its pass: each must be free again after it (a site left
    taken refuses every later pass), and a misspelt site among the coefficients is named, not ignored."""
    import fca
    from fca.engine.sites import find_sites

    model = fca.load_model(DEMO / "featuregate")
    ids = open_cache(DEMO / "eval").read_seqs([0, 1], sites=[])["token"]
    own = fca.capture(model, ids)  # site -> [B, T, K]
    first = next(iter(own))
    once = fca.replay(model, ids, own, only={first})
    assert all(site.mode == "live" and not site._in_pass for site in find_sites(model).values())
    assert np.array_equal(fca.replay(model, ids, own, only=first), once)  # a second pass is not refused
    with pytest.raises(KeyError, match=r"site\(s\) \['gatee'\] that the model lacks"):
        fca.replay(model, ids, {**own, "gatee": own[first]}, only={first})
    # A cache's rows may be given whole: their key columns (token, target, live NLL...) are not sites.
    rows = open_cache(DEMO / "eval").read_seqs([0, 1])
    assert np.array_equal(fca.replay(model, ids, rows), fca.replay(model, ids, {s: rows[s] for s in own}))


def test_an_experiments_profiles_come_from_its_calibration_cache():
    """StaticLayer's claim rests on profiles from an independent split: taken from the evaluated cache, the
    static profile would be fit on the very sequences it is scored on."""
    from fca.jobs.experiment import Experiment
    from fca.tables.profiles import calibration_profiles

    experiment = Experiment.open(DEMO / "featuregate", DEMO / "eval", DEMO / "calibration", device="cpu")
    profiles = experiment.profiles()
    own = calibration_profiles(open_cache(DEMO / "calibration"))
    evaluated = calibration_profiles(open_cache(DEMO / "eval"))
    for site, static in profiles.static.items():
        np.testing.assert_array_equal(static, own.static[site])
        assert not np.array_equal(static, evaluated.static[site])
    assert profiles.family_means == own.family_means != evaluated.family_means


def test_a_run_without_the_checks_scores_what_it_was_asked():
    """check_exactness=False (a bench of the replays themselves): no check pass, no Correct added, and
    nothing read from a Correct that did not run."""
    import fca
    from fca.engine.replay import run_conditions
    from fca.tables.profiles import calibration_profiles

    model = fca.load_model(DEMO / "featuregate")
    profiles = calibration_profiles(open_cache(DEMO / "calibration"))
    cache = open_cache(DEMO / "eval")
    results = run_conditions(model, cache, [Condition("static_layer")], profiles, seqs=[0, 1], check_exactness=False)
    assert list(results.per_seq_nll) == ["static_layer"] and np.isfinite(results.per_seq_nll["static_layer"]).all()
    assert results.fidelity is None and results.batches == 0
