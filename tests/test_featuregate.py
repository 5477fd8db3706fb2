"""FeatureGate model, its Dense twin, sites, training, corpora and loading."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from torch import nn

import fca
from fca.cli import main
from fca.engine.environment import current_environment
from fca.engine.loading import ModelLoadError, fingerprint_state
from fca.engine.models.featuregate import (
    FeatureGateConfig,
    FeatureGateModel,
    build_featuregate,
)
from fca.engine.sites import Site, controller_parameters, find_sites, site_modes
from fca.jobs.train import TrainSettings, heldout_nll, train
from fca.tables import data
from fca.tables.conditions import check_sites_named
from fca.tables.errors import CacheError

from .helpers import TINY, make_model_dir, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "prose.txt")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, corpus):
    return make_model_dir(tmp_path_factory.mktemp("models") / "gated", corpus)


def tiny(**kw) -> FeatureGateModel:
    return build_featuregate(FeatureGateConfig(vocab_size=97, **{**TINY, **kw})).eval()


@pytest.mark.slow
def test_shapes_and_sites():
    model = tiny()
    ids = torch.randint(0, 97, (3, 16))
    assert model(ids).logits.shape == (3, 16, 97)
    coefficients = fca.capture(model, ids)
    assert list(coefficients) == ["blocks.0.gate", "blocks.1.gate"]
    assert all(c.shape == (3, 16, 2 + 2) and c.dtype == np.float32 for c in coefficients.values())
    per_feature = fca.capture(tiny(granularity="feature", controller="mlp"), ids)
    assert per_feature["blocks.0.gate"].shape == (3, 16, 2 * 32)


def test_gates_start_near_one():
    coefficients = fca.capture(tiny(), torch.randint(0, 97, (2, 16)))
    for c in coefficients.values():
        assert np.abs(c - 1).mean() < 0.05 and np.abs(c - 1).max() < 0.3  # logits ~ N(0, 0.02^2 * d_model)
        assert ((c > 0) & (c < 2)).all()


def test_dense_twin_has_no_controller_and_same_init():
    gated, dense = tiny(), tiny(gated=False)
    assert find_sites(dense) == {}
    assert not any("gate" in name for name, _ in dense.named_parameters())
    shared = dict(dense.named_parameters())
    gated_params = dict(gated.named_parameters())
    assert set(shared) < set(gated_params)
    assert all(torch.equal(shared[n], gated_params[n]) for n in shared)
    assert sum(p.numel() for p in gated.parameters()) - sum(p.numel() for p in dense.parameters()) == 2 * (32 * 4 + 4)


def test_exact_correct_replay_and_controller_never_runs():
    model = tiny()
    ids = torch.randint(0, 97, (4, 16))
    live = model(ids).logits
    coefficients = fca.capture(model, ids)
    calls = []
    handles = [s.controller.register_forward_hook(lambda *a: calls.append(1)) for s in find_sites(model).values()]
    replayed = fca.replay(model, ids, coefficients)
    assert calls == []
    assert torch.equal(replayed, live)  # bit-exact, not just close
    with torch.no_grad():
        for site in find_sites(model).values():
            for p in site.controller.parameters():
                p.fill_(float("nan"))
    assert torch.equal(fca.replay(model, ids, coefficients), live)
    assert torch.isnan(model(ids).logits).all()  # live now really is broken
    for h in handles:
        h.remove()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_model_is_the_uncompiled_one_and_replays_without_its_controllers(backend):
    """`torch.compile` wraps the model in a module whose tree and state dict prefix every name with
    `_orig_mod.`: its site names, fingerprint and controller parameters are still the uncompiled model's,
    so one cache serves both. Its replays go through compiled graphs, equal to the uncompiled model's, and
    those graphs hold no controller: NaN controller weights leave a replay unchanged, while the compiled
    live pass turns NaN (the graphs read the weights as they are now, so a controller in them would show)."""
    import torch._dynamo

    torch._dynamo.reset()  # (graphs another test compiled, and its recompiles, stay out of this one)
    torch._dynamo.utils.counters.clear()
    model = tiny()
    compiled = torch.compile(model, backend=backend)
    assert list(find_sites(compiled)) == list(find_sites(model)) == ["blocks.0.gate", "blocks.1.gate"]
    assert fingerprint_state(compiled) == fingerprint_state(model)
    assert controller_parameters(compiled) == controller_parameters(model)
    assert current_environment(compiled)["numerics"].endswith(f"torch.compile {backend}")
    assert "torch.compile" not in current_environment(model)["numerics"]
    ids = torch.randint(0, 97, (4, 16))
    with torch.no_grad():
        live = model(ids).logits
    coefficients = fca.capture(compiled, ids)
    static = {k: v.mean((0, 1)) for k, v in coefficients.items()}
    assert torch.equal(fca.replay(compiled, ids, coefficients), live)  # bit-exact
    assert torch.equal(fca.replay(compiled, ids, static), fca.replay(model, ids, static))
    with torch.no_grad():
        for site in find_sites(compiled).values():
            for p in site.controller.parameters():
                p.fill_(float("nan"))
    assert torch.equal(fca.replay(compiled, ids, coefficients), live)
    with torch.no_grad():
        assert torch.isnan(compiled(ids).logits).all()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # compiled, not run eagerly
    # Each pass one graph: a replayed site's check whether it may hand on the caller's tensor (`data_ptr`)
    # broke the graph at every site.
    assert not torch._dynamo.utils.counters["graph_break"], list(torch._dynamo.utils.counters["graph_break"])
    # Compiled in place (`model.compile()`: no wrapper), the backend is recorded too: with inductor, whose
    # kernels differ from the uncompiled model's by 1.2e-7, a cache built uncompiled was refused as "not this
    # model's output" in what its manifest recorded as this very environment.
    compiled.train()  # (messages name the model's class, not the wrapper's)
    with pytest.raises(ValueError, match="^FeatureGateModel is in training mode"):
        fca.capture(compiled, ids)
    in_place = tiny()
    in_place.compile(backend=backend)
    assert current_environment(in_place)["numerics"].endswith(f"torch.compile {backend}")
    # (the sites and weights of a model built alike: `model`'s controllers are NaN by now)
    assert list(find_sites(in_place)) == list(find_sites(model))
    assert fingerprint_state(in_place) == fingerprint_state(tiny())


@pytest.mark.slow
def test_static_replay_differs_and_broadcasts():
    model = tiny()
    ids = torch.randint(0, 97, (2, 16))
    live = model(ids).logits
    static = {k: v.mean((0, 1)) for k, v in fca.capture(model, ids).items()}  # [K]
    assert not torch.equal(fca.replay(model, ids, static), live)
    with pytest.raises(KeyError, match="blocks.1.gate"):
        fca.replay(model, ids, {"blocks.0.gate": static["blocks.0.gate"]})


def test_replay_refuses_bad_coefficients_with_a_value_error_naming_the_site():
    """Site names the model lacks, sites left without coefficients, shapes that do not broadcast and
    values that are no numbers: each a ValueError naming the site (site-name errors stay KeyErrors too),
    its message without a KeyError's quotes, never torch's own error."""
    model = tiny()
    ids = torch.randint(0, 97, (2, 16))
    coefficients = fca.capture(model, ids)
    static = {k: v.mean((0, 1)) for k, v in coefficients.items()}
    bad = {
        r"site\(s\) \['blocks\.9\.gate'\] that the model lacks": (
            {**static, "blocks.9.gate": static["blocks.0.gate"]},
            None,
        ),
        r"no coefficients given for site\(s\) \['blocks\.1\.gate'\]": (
            {"blocks.0.gate": static["blocks.0.gate"]},
            None,
        ),
        r"unknown site\(s\) \['blocks\.9\.gate'\]": (static, {"blocks.9.gate"}),
        r"site 'blocks\.0\.gate': replay coefficients of shape \[2, 16, 3\] do not broadcast": (
            {k: v[..., :3] for k, v in coefficients.items()},
            None,
        ),
        r"site 'blocks\.0\.gate': replay coefficients must be an array of numbers, not None": (
            dict.fromkeys(static),
            None,
        ),
    }
    for message, (given, only) in bad.items():
        with pytest.raises(ValueError, match=message) as raised:
            fca.replay(model, ids, given, only=only)
        assert not str(raised.value).startswith(("'", '"'))
    with pytest.raises(ValueError, match=r"condition static_layer@gatee: unknown site\(s\) \['gatee'\]"):
        check_sites_named([fca.Condition("static_layer", sites=("gatee",))], list(static))


def test_find_sites_names_sites_as_named_modules_does():
    """The sites' own walk keeps named_modules' order and names: a site reached twice keeps its first
    name, an empty slot is skipped, a site inside another's controller is found, a bare site is named ''."""
    model = tiny()
    model.blocks[1].again = model.blocks[0].gate  # shared: named once, as blocks.0.gate
    model.blocks[0].empty = None
    inner = model.blocks[1].gate
    model.blocks[1].gate = Site(nn.Sequential(nn.Identity(), inner), inner.spec)
    expected = [name for name, m in model.named_modules() if isinstance(m, Site)]
    assert list(find_sites(model)) == expected
    assert expected[:3] == ["blocks.0.gate", "blocks.1.gate", "blocks.1.gate.controller.1"]
    assert all(site.site_name == name for name, site in find_sites(model).items())
    assert list(find_sites(inner)) == [""]


def test_site_modes_restore_after_error():
    model = tiny()
    with pytest.raises(RuntimeError):
        with site_modes(model, "record", sink={}):
            raise RuntimeError("boom")
    assert all(s.mode == "live" and s._sink is None and s._provider is None for s in find_sites(model).values())


@pytest.mark.slow
def test_a_second_pass_over_sites_in_a_pass_is_refused():
    """A record or replay pass over a model whose sites are in another pass (here one this thread is
    inside, then one another thread holds open) is refused, and the first pass keeps its modes: two at
    once would record into one sink or replay the other's coefficients."""
    import threading

    model = tiny()
    ids = torch.randint(0, 97, (2, 8))
    coefficients = fca.capture(model, ids)
    with site_modes(model, "record", sink={}):
        with pytest.raises(RuntimeError, match=r"already in a record or replay pass.*one pass at a time"):
            fca.replay(model, ids, coefficients)
        assert all(s.mode == "record" for s in find_sites(model).values())
    inside, leave = threading.Event(), threading.Event()

    def hold_a_pass() -> None:
        with site_modes(model, "record", sink={}):
            inside.set()
            leave.wait(10)

    holder = threading.Thread(target=hold_a_pass)
    holder.start()
    inside.wait(10)
    try:
        with pytest.raises(RuntimeError, match="already in a record or replay pass"):
            fca.capture(model, ids)
    finally:
        leave.set()
        holder.join()
    assert torch.equal(fca.replay(model, ids, coefficients), model(ids).logits)  # free again


def test_save_load_round_trip(tmp_path, model_dir):
    model = fca.load_model(model_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    expected = model(ids).logits
    model.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert torch.equal(FeatureGateModel.from_pretrained(tmp_path / "hf").eval()(ids).logits, expected)
    from transformers import AutoModelForCausalLM

    assert torch.equal(
        AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()(ids).logits, expected
    )
    assert torch.equal(fca.load_model(model_dir)(ids).logits, expected)


def test_missing_or_corrupt_checkpoint_errors(tmp_path, model_dir, corpus, capsys):
    with pytest.raises(ModelLoadError, match="model directory not found"):
        fca.load_model(tmp_path / "nowhere")
    (tmp_path / "audit.json").write_text("{}")  # a file given for the model: named as such (was "<file>/config.json")
    with pytest.raises(ModelLoadError, match=f"^{tmp_path / 'audit.json'}: a file, not a model directory$"):
        fca.load_model(tmp_path / "audit.json")
    build = ["build-cache", "--model", str(tmp_path / "audit.json"), "--corpus", str(corpus), "--split", "eval"]
    assert main([*build, "--out", str(tmp_path / "c"), "--num-seqs", "2", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == f"fca: error: {tmp_path / 'audit.json'}: a file, not a model directory\n"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dir / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError) as err:
        fca.load_model(broken)
    assert "model.safetensors" in str(err.value) and "\n" not in str(err.value)
    from safetensors.torch import load_file, save_file

    state = load_file(model_dir / "model.safetensors")
    state.pop("blocks.1.gate.controller.net.weight")
    save_file(state, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing keys.*blocks.1.gate.controller.net.weight"):
        fca.load_model(broken)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads files without permission")
def test_weights_without_read_permission_are_said_so(tmp_path, model_dir):
    """safetensors describes a file it may not open as "No such file or directory"."""
    locked = tmp_path / "locked"
    shutil.copytree(model_dir, locked)
    (locked / "model.safetensors").chmod(0)
    with pytest.raises(ModelLoadError, match=r"model.safetensors: unreadable weights \(Permission denied\)"):
        fca.load_model(locked)


def test_a_weights_file_that_cannot_be_opened_is_said_so_for_any_user(tmp_path, model_dir, monkeypatch):
    """The test above needs a user without root's rights; this one refuses the open itself, so the message
    is checked wherever the suite runs (safetensors alone would say "No such file or directory")."""
    import pathlib

    real_open = pathlib.Path.open

    def refusing_open(self, *args, **kwargs):
        if self.name == "model.safetensors":
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", refusing_open)
    with pytest.raises(ModelLoadError, match=r"model.safetensors: unreadable weights \(Permission denied\)"):
        fca.load_model(model_dir)


@pytest.mark.slow
def test_training_reduces_loss(tmp_path, corpus):
    config = FeatureGateConfig(**TINY)
    log = train(
        corpus,
        tmp_path / "m",
        config,
        TrainSettings(
            steps=40,
            batch_size=8,
            lr=3e-3,
            warmup=5,
            eval_every=20,
            eval_windows=16,
            final_eval_windows=16,
            vocab_size=300,
        ),
        show_progress=False,
    )
    assert log["history"][0]["loss"] > log["history"][-1]["loss"] + 1.0
    saved = json.loads((tmp_path / "m" / "training_log.json").read_text())
    assert saved["final_eval_nll"] == pytest.approx(log["final_eval_nll"])
    model = fca.load_model(tmp_path / "m")
    tok = data.load_tokenizer(tmp_path / "m")
    windows = data.split_windows(corpus, "eval", tok, 16, 0, 16)
    assert heldout_nll(model, windows) == pytest.approx(log["final_eval_nll"], rel=1e-5)


@pytest.mark.slow
def test_a_diverged_training_saves_no_model_and_a_nan_model_writes_no_cache(tmp_path, corpus):
    """A learning rate of 1e30 saved a model of NaN weights (exit 0), and its cache of NaN coefficients
    was written and passed `inspect --verify`."""
    settings = TrainSettings(steps=3, batch_size=4, lr=1e30, warmup=1, eval_every=3, eval_windows=4, vocab_size=300)
    with pytest.raises(
        ValueError, match=r"/m: training diverged \(held-out NLL nan.*no model is saved; train with a lower"
    ):
        train(corpus, tmp_path / "m", FeatureGateConfig(**TINY), settings, show_progress=False)
    assert not (tmp_path / "m").exists()
    (tmp_path / "one.txt").write_text("only one document\n")
    with pytest.raises(data.CorpusError, match=r"one\.txt: need at least 3 documents"):  # named, as build-cache does
        train(tmp_path / "one.txt", tmp_path / "m", FeatureGateConfig(**TINY), settings, show_progress=False)
    model = build_featuregate(FeatureGateConfig(**TINY)).eval()
    with torch.no_grad():
        model.blocks[1].gate.controller.net.weight[0, 0] = float("nan")
    windows = np.random.default_rng(0).integers(0, 300, (4, 17))
    with pytest.raises(
        CacheError, match=r"non-finite coefficients \(NaN or inf\) at site 'blocks\.1\.gate' in sequences 0-3"
    ):
        fca.build_cache(model, windows, tmp_path / "c", batch_size=4)
    assert not (tmp_path / "c").exists()


def test_splits_are_deterministic_and_disjoint():
    docs = [f"document {i}" for i in range(200)]
    a, b = data.split_documents(docs, seed=3), data.split_documents(docs, seed=3)
    assert a == b
    assert data.split_documents(docs, seed=4)["eval"] != a["eval"]
    seen = [d for split in a.values() for d in split]
    assert sorted(seen) == sorted(docs) and len(set(seen)) == len(docs)
    assert len(a["calibration"]) == len(a["eval"]) == 10


def test_tokenizer_round_trip(model_dir):
    tok = data.load_tokenizer(model_dir)
    text = "The shepherd went up to the mountain, and was afraid."
    assert tok.decode(tok.encode(text).ids) == text


def test_corpus_loaders(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "b.txt").write_text("second document")
    (folder / "a.txt").write_text("first document")
    (folder / "empty.txt").write_text("   ")
    assert data.load_documents(folder) == ["first document", "second document"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one", "", "two"], "id": [1, 2, 3]}), tmp_path / "d.parquet")
    assert data.load_documents(tmp_path / "d.parquet") == ["one", "two"]
    with pytest.raises(data.CorpusError, match="no column 'body'"):
        data.load_documents(tmp_path / "d.parquet", text_column="body")
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(data.CorpusError, match="empty"):
        data.load_documents(tmp_path / "empty.txt")
    # A column asked of plain text would be ignored: refused instead.
    with pytest.raises(data.CorpusError, match=r"a.txt: a text corpus has no columns; --text-column body is for"):
        data.load_documents(folder / "a.txt", text_column="body")
    with pytest.raises(data.CorpusError, match="text corpus has no columns"):
        data.load_documents(folder, text_column="body")


def test_a_corpus_folder_without_text_files_is_named_as_such(tmp_path, capsys):
    """A folder of other files (a model directory given by mistake) was called an empty corpus."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    out = tmp_path / "m"
    assert main(["train", "--corpus", str(folder), "--out", str(out), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"fca: error: {folder}: a folder without .txt or .md files; a corpus folder holds one document per such file, or Parquet files with a text column"
    ), err
    assert not out.exists()


def test_cli_train_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    assert main(["train", "--corpus", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "m"), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fca: error:") and "empty.txt" in err and "\n" not in err
    assert not (tmp_path / "m").exists()


def test_library_is_ui_free():
    import pathlib
    import re

    root = pathlib.Path(fca.__file__).parent
    offenders = [
        p.name for p in root.rglob("*.py") if re.search(r"^\s*(import|from)\s+(streamlit|plotly)", p.read_text(), re.M)
    ]
    assert offenders == []


def test_a_run_not_longer_than_its_warmup_still_warms_up_and_decays():
    """A 30-step run under the default 50-step warm-up never reached its learning rate, nor decayed."""
    from fca.jobs.train import lr_at, warmup_steps

    short = TrainSettings(steps=30)
    assert warmup_steps(short) == 3 and warmup_steps(TrainSettings(steps=800)) == 50  # the demo's: unchanged
    rates = [lr_at(step, short) for step in range(30)]
    assert max(rates) == pytest.approx(short.lr) and rates[-1] < 0.05 * short.lr + short.min_lr
