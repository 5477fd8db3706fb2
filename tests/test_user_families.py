"""Families declared outside FCA: a family file (`--family FILE`, FCA_FAMILIES) or an installed package
(entry-point group `fca.families`) is loaded on request, registered with the precedence the README states,
and a bad one is one line naming it (exit code 2, never a traceback). The example DeepSeek-V3 family file
is audited end to end from the command line and opened in the dashboard."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fca
from fca.cli import dashboard_environment, main
from fca.engine import families as registry
from fca.engine.families import family_for_type, registered_families
from fca.engine.user_families import entry_point_families, family_source, load_family_file
from fca.tables import catalog
from fca.tables.errors import ModelLoadError

from .helpers import write_corpus

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_FAMILY = REPO / "examples" / "deepseek_v3_family.py"
EXAMPLE_MODEL = REPO / "examples" / "tiny_deepseek_v3.py"


@pytest.fixture
def registry_guard():
    """Registrations made by a test are undone afterwards."""
    families, twins = dict(registered_families()), dict(catalog.DENSE_TWINS)
    yield
    registry._FAMILIES.clear()
    registry._FAMILIES.update(families)
    catalog.DENSE_TWINS.clear()
    catalog.DENSE_TWINS.update(twins)


def family_file(folder: Path, body: str, name: str = "family.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


TOY = """
from fca.engine.family import Family
"""

BAD_FILES = {  # name -> (file text, or None for no file; what the one line must say)
    "missing": (None, "no such family file"),
    "syntax": (TOY + "FAMILY = Family('toy'\n", "line 3: syntax error: '(' was never closed"),
    "import": (TOY + "import no_such_module_here\n", "line 3: running it raised ModuleNotFoundError: No module named"),
    "raises": (
        TOY + "\n\ndef f():\n    raise RuntimeError('bad config')\n\nf()\n",
        "line 6: running it raised RuntimeError",
    ),
    "exits": ("import sys\nsys.exit(3)\n", "line 2: running it raised SystemExit: 3"),
    "nothing": (TOY + "x = 1\n", "declares no family (define FAMILY = Family(...) or FAMILIES"),
    "not_a_family": ("FAMILY = 'deepseek_v3'\n", "declares a str ('deepseek_v3'), not a Family"),
    "families_not_a_list": (TOY + "FAMILIES = Family('toy')\n", "FAMILIES is a Family, not a list or tuple"),
    "twice": (TOY + "FAMILIES = [Family('toy'), Family('toy')]\n", "declares two families of model_type 'toy'"),
    "empty_type": (TOY + "FAMILY = Family('')\n", "model_type must be a non-empty name"),
    "load_not_callable": (TOY + "FAMILY = Family('toy', load='model.safetensors')\n", "load must be a function"),
    "paths_not_tuple": (TOY + "FAMILY = Family('toy', expert_paths='a.b')\n", "expert_paths must be a tuple"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_family_file_is_one_line_naming_it_with_exit_code_2(case, tmp_path, capsys, registry_guard):
    text, said = BAD_FILES[case]
    path = tmp_path / "family.py" if text is None else family_file(tmp_path, text)
    before = registered_families()
    rc = main(["replay", "--family", str(path), "--model", "m", "--cache", "c", "--calibration", "k"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"fca: error: {path}") and said in err, err
    assert registered_families() == before  # nothing of a bad file is registered


def test_a_family_path_that_is_no_python_file_is_refused(tmp_path, capsys):
    (tmp_path / "family.txt").write_text("FAMILY = None\n")
    for path, said in ((tmp_path, "not a file"), (tmp_path / "family.txt", "not a Python file (.py)")):
        assert main(["audit", "--family", str(path), "--model", "m", "--cache", "c", "--calibration", "k"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fca: error: {path}: ") and said in err and err.count("\n") == 1, err


def test_a_family_file_registers_its_families_over_the_built_in_ones(tmp_path, registry_guard):
    """FAMILY, FAMILIES and register_family calls all declare; a family file's family of a built-in
    model_type replaces it, and a later file replaces an earlier one."""
    first = family_file(
        tmp_path,
        TOY
        + "from fca.engine.families import register_family\n"
        + "FAMILY = Family('featuregate', coefficient_kind='from the file')\n"
        + "FAMILIES = (Family('toy_a'), FAMILY)\n"
        + "register_family(Family('toy_b'))\n",
    )
    declared = fca.load_family_file(first)
    assert [f.model_type for f in declared] == ["featuregate", "toy_a", "toy_b"]
    assert family_for_type("featuregate").coefficient_kind == "from the file"
    assert family_for_type("muddpythia").load is not None  # the other built-ins stay
    assert family_source("toy_b") == str(first) and family_source("muddpythia") is None
    second = family_file(tmp_path, TOY + "FAMILY = Family('toy_a', coefficient_kind='second')\n", "second.py")
    load_family_file(second)
    assert family_for_type("toy_a").coefficient_kind == "second" and family_source("toy_a") == str(second)


def test_an_unchanged_family_file_runs_once_and_an_edited_one_again(tmp_path, registry_guard):
    runs = tmp_path / "runs.txt"
    body = TOY + f"open({str(runs)!r}, 'a').write('ran\\n')\nFAMILY = Family('toy_once', coefficient_kind='{{}}')\n"
    path = family_file(tmp_path, body.format("one"))
    first = load_family_file(path)
    assert load_family_file(path) == first and runs.read_text() == "ran\n"
    path.write_text(body.format("two, edited"))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert load_family_file(path)[0].coefficient_kind == "two, edited" and runs.read_text() == "ran\nran\n"


def test_a_family_without_a_load_function_is_said_when_a_directory_of_it_is_loaded(tmp_path, registry_guard):
    path = family_file(tmp_path, TOY + "FAMILY = Family('toy_noload')\n")
    load_family_file(path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "toy_noload"}))
    with pytest.raises(
        ModelLoadError, match=rf"toy_noload' \(declared in {tmp_path}.*family.py\) has no load function"
    ):
        fca.load_model(tmp_path / "m")


def test_the_dashboard_command_checks_its_family_files_and_hands_them_on(tmp_path, capsys, monkeypatch, registry_guard):
    bad = family_file(tmp_path, "FAMILY = 3\n")
    assert main(["dashboard", "--family", str(bad)]) == 2
    assert (
        capsys.readouterr().err == f"fca: error: {bad}: declares a int (3), not a Family (fca.engine.family.Family)\n"
    )
    monkeypatch.chdir(tmp_path)
    env = dashboard_environment({"FCA_FAMILIES": f" mine.py{os.pathsep}{tmp_path}/b.py "})
    assert env["FCA_FAMILIES"] == f"{tmp_path / 'mine.py'}{os.pathsep}{tmp_path / 'b.py'}"
    # Given relative to the folder the command runs in, the files reach the server (started in the
    # repository) as absolute paths, FCA_FAMILIES's first. (The server itself is not started: the
    # process it would become is caught at the exec.)
    good = family_file(tmp_path, "from fca.engine.family import Family\nFAMILY = Family('toy_dash')\n", "good.py")
    monkeypatch.setenv("FCA_FAMILIES", "good.py")
    monkeypatch.setenv("FCA_CACHE_ROOTS", "caches")
    started = {}

    def exec_server(path, argv, environ):
        started.update(environ=environ, cwd=os.getcwd())
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "execve", exec_server)
    assert main(["dashboard", "--family", "good.py"]) == 130
    assert started["environ"]["FCA_FAMILIES"] == f"{good}{os.pathsep}{good}" and started["cwd"] == str(REPO)
    assert started["environ"]["FCA_CACHE_ROOTS"] == str(tmp_path / "caches")


# ------------------------------------------------------------------------------ installed packages


def write_distribution(folder: Path, entry_points: str, module: str) -> importlib.metadata.Distribution:
    """A package installed in `folder` as pip would leave it: the module and its .dist-info (the metadata
    and the entry points), found by importlib.metadata once `folder` is on sys.path."""
    (folder / "toyplugin.py").write_text(textwrap.dedent(module))
    info = folder / "toyplugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyplugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    return importlib.metadata.PathDistribution(info)


PLUGIN = """
    from fca.engine.family import Family
    from fca.engine.families import family_for_type

    BASE = family_for_type("mixtral")  # (a package may build on a built-in family as it loads)
    FAMILY = Family("toy_plugin", load=BASE.load, coefficient_kind="from a package")
    OTHERS = [Family("toy_plugin_b")]
"""


def test_installed_packages_declare_families_by_entry_point(tmp_path, monkeypatch):
    distribution = write_distribution(
        tmp_path, "[fca.families]\ntoy = toyplugin:FAMILY\nmore = toyplugin:OTHERS\nmodule = toyplugin\n", PLUGIN
    )
    (tmp_path / "toyplugin.py").write_text(textwrap.dedent(PLUGIN) + "FAMILIES = [FAMILY]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    points = lambda group: [p for p in distribution.entry_points if p.group == group]  # noqa: E731
    found, complete = entry_point_families(points)
    assert complete and sorted(f.model_type for f in found) == ["toy_plugin", "toy_plugin_b"]
    assert next(f for f in found if f.model_type == "toy_plugin").coefficient_kind == "from a package"
    monkeypatch.setenv("FCA_FAMILY_ENTRY_POINTS", "0")
    assert entry_point_families(points) == ([], True)


@pytest.mark.slow
def test_an_installed_family_joins_the_registry_and_a_family_file_replaces_it(tmp_path):
    """In a fresh interpreter with the package on its path: found at the registry's first lookup (under
    a family registered before it), replaced by a family file; a broken package is one line, exit 2."""
    write_distribution(tmp_path, "[fca.families]\ntoy = toyplugin:FAMILY\n", PLUGIN)
    override = family_file(tmp_path, TOY + "FAMILY = Family('toy_plugin', coefficient_kind='from a file')\n", "f.py")
    script = textwrap.dedent(f"""
        import fca
        from fca.engine.families import family_for_type
        from fca.engine.user_families import family_source
        import toyplugin
        assert family_for_type("toy_plugin") is toyplugin.FAMILY
        assert family_source("toy_plugin") == "entry point toy = toyplugin:FAMILY of toyplugin (group fca.families)"
        assert family_for_type("mixtral").load is not None
        fca.load_family_file({str(override)!r})
        assert family_for_type("toy_plugin").coefficient_kind == "from a file"
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    (tmp_path / "toyplugin.py").write_text("raise ImportError('its dependency is missing')\n")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    command = [sys.executable, "-m", "fca", "replay", "--model", str(model), "--cache", "c", "--calibration", "k"]
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("fca: error: entry point toy = toyplugin:FAMILY of toyplugin (group fca.families):")
    assert "ImportError: its dependency is missing; uninstall toyplugin or set FCA_FAMILY_ENTRY_POINTS=0" in run.stderr


# ------------------------------------------------------------------------- the example, end to end


def _example_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def deepseek_root(tmp_path_factory):
    """The README's walk-through: a tiny DeepSeek-V3 directory, two caches built from the shell with the
    example family file, an audit and its Markdown."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        root = tmp_path_factory.mktemp("dsv3")
        corpus = write_corpus(root / "prose.txt")
        _example_module(EXAMPLE_MODEL, "tiny_deepseek_v3").write_tiny_deepseek_v3(root / "model", corpus)
        family = ["--family", str(EXAMPLE_FAMILY)]
        saved = dict(registered_families())
        try:
            for split in ("eval", "calibration"):
                build = ["build-cache", *family, "--model", str(root / "model"), "--corpus", str(corpus)]
                build += ["--split", split, "--out", str(root / split), "--num-seqs", "6", "--seq-len", "16"]
                assert main([*build, "--batch", "3", "--device", "cpu"]) == 0
            audit = ["audit", *family, "--model", str(root / "model"), "--cache", str(root / "eval")]
            audit += ["--calibration", str(root / "calibration"), "--device", "cpu", "--sweep", "none"]
            assert main([*audit, "--json", str(root / "audit.json")]) == 0
            assert main(["report", str(root / "audit.json"), "--markdown", str(root / "audit.md")]) == 0
        finally:
            registry._FAMILIES.clear()
            registry._FAMILIES.update(saved)
    return root


@pytest.mark.slow
def test_the_example_family_audits_a_deepseek_v3_directory_from_the_shell(deepseek_root, capsys):
    report = json.loads((deepseek_root / "audit.json").read_text())
    assert report["exactness"]["max_abs_logit_diff"] == 0.0
    assert report["model"]["model_type"] == "deepseek_v3"
    sites = json.loads((deepseek_root / "eval" / "manifest.json").read_text())["sites"]
    assert sorted(sites) == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]  # layer 0 is dense
    assert report["conditions"]["cross_input"]["nll"] != report["conditions"]["correct"]["nll"]
    experts = report["execution"]["experts"]
    assert experts["experts_available"] == 8 and experts["experts_run_per_token_mean"] == 2.0
    assert "deepseek_v3" in (deepseek_root / "audit.md").read_text()
    # Without the family file, the directory is recognised by its modules (fca.engine.models.hf_structure):
    # the same router sites, so the cache replays exactly from the shell, routing read at the experts.
    capsys.readouterr()
    replay = ["replay", "--model", str(deepseek_root / "model"), "--cache", str(deepseek_root / "eval")]
    replay += ["--calibration", str(deepseek_root / "calibration"), "--device", "cpu", "--no-save"]
    assert main(replay) == 0
    out = capsys.readouterr().out
    assert "max |difference| 0," in out and "same experts 100.0%" in out
    # inspect reads the cache alone: it needs no family.
    assert main(["inspect", str(deepseek_root / "eval")]) == 0
    assert "model deepseek_v3" in capsys.readouterr().out


@pytest.mark.slow
def test_the_example_family_replays_exactly_with_its_routers_removed(deepseek_root, registry_guard, monkeypatch):
    """The rebuild reproduces the router's three outputs bit for bit; with every router's weight NaN, a
    replay of the captured logits still equals the live logits (the routers do not run)."""
    from fca.engine.sites import find_sites

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    family = fca.load_family_file(EXAMPLE_FAMILY)[0]
    model = fca.load_model(deepseek_root / "model")
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    sites = find_sites(model)
    assert sorted(sites) == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
    router = sites["model.layers.1.mlp.gate"].controller
    assert router.e_score_correction_bias.abs().min() > 0  # the bias takes part in the choice
    hidden = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        live = router(hidden)
        rebuilt = sites["model.layers.1.mlp.gate"].declaration.rebuild(live[0].clone(), router)
    for a, b in zip(live, rebuilt):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with torch.no_grad():
        logits = model(ids).logits
    coefficients = fca.capture(model, ids)
    for site in sites.values():
        site.controller.weight.data.fill_(float("nan"))
    replayed = fca.replay(model, ids, coefficients)
    assert torch.equal(replayed, logits)
    assert family.expert_paths == ("model.layers.*.mlp.experts",)


@pytest.mark.slow
def test_the_dashboard_opens_the_example_model_given_by_its_family_file(deepseek_root, monkeypatch, registry_guard):
    from .test_app import app_for, no_exceptions, render

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FCA_FAMILIES", str(EXAMPLE_FAMILY))
    at = render(app_for(monkeypatch, [deepseek_root], deepseek_root / "eval"), "views/replay_lab.py")
    no_exceptions(at)
    assert not at.error, [e.value for e in at.error]
    said = [c.value.replace("\\", "") for c in at.sidebar.caption]  # (as Markdown: escapes, if any, aside)
    assert any("Families from files: deepseek_v3 (deepseek_v3_family.py)" in c for c in said), said
    at.sidebar.selectbox(key="device").set_value("cpu")
    at.multiselect(key="lab_kinds").set_value(["cross_input"])
    at.number_input(key="lab_num_seqs").set_value(4)
    at.number_input(key="lab_batch").set_value(2)
    next(b for b in at.button if b.label == "Run").click().run()
    job = at.session_state["replay_job"]
    job.wait(120)
    assert job.record is not None, job.error
    assert job.record["results"]["exactness"]["max_abs_logit_diff"] == 0.0
    at = render(at, "views/execution.py")
    at.button(key="exec_measure").click().run()
    no_exceptions(at)
    assert not at.error, [e.value for e in at.error]
    said = " ".join(m.value for m in at.markdown)
    assert "2.00 of 8 routed experts" in said


@pytest.mark.slow
def test_the_dashboard_says_which_family_file_is_bad(tmp_path, monkeypatch, registry_guard):
    from .test_app import app_for, no_exceptions

    bad = family_file(tmp_path, "import no_such_module_here\n", "my_family.py")
    monkeypatch.setenv("FCA_FAMILIES", f"{bad}{os.pathsep}{tmp_path / 'gone.py'}")
    at = app_for(monkeypatch, [tmp_path]).run()
    no_exceptions(at)
    said = [e.value.replace("\\", "") for e in at.sidebar.error]
    assert said == [
        f"Family file (FCA_FAMILIES): {bad}, line 1: running it raised ModuleNotFoundError: No module named "
        "'no_such_module_here'",
        f"Family file (FCA_FAMILIES): {tmp_path / 'gone.py'}: no such family file",
    ]
