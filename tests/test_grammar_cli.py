"""One condition grammar (text in, the same text out), a command line that starts without torch, a
clear answer for a JSON that is not an audit report, and a package whose declared dependencies agree
with requirements.txt."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib
from hypothesis import given, settings
from hypothesis import strategies as st

from fca.cli import main
from fca.tables.conditions import KINDS, Condition, format_condition, parse_condition

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------ condition grammar

site_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}(\.[A-Za-z0-9_]{1,6}){0,3}", fullmatch=True)


@st.composite
def conditions(draw) -> Condition:
    kind = draw(st.sampled_from(KINDS))
    alpha = draw(st.floats(allow_nan=False, allow_infinity=False)) if kind == "interpolate" else None
    sites = draw(st.none() | st.lists(site_names, min_size=1, max_size=4, unique=True).map(tuple))
    independent = draw(st.booleans()) if kind == "token_shuffle" else False
    return Condition(kind, alpha, sites, independent, draw(st.integers(0, 2**31 - 1)))


@pytest.mark.slow
@settings(database=None)  # no example database left in the working tree
@given(conditions())
def test_parse_reads_back_what_format_writes(condition: Condition) -> None:
    text = format_condition(condition)
    assert parse_condition(text, condition.seed) == condition
    assert condition.spec == condition.name == text


EDGE_ALPHAS = [0.0, 1.0, 1e-9, 0.1 + 0.2, -0.5, -0.0, 5e-324, 1e300, 123456789.0, 2.5e16]


@pytest.mark.parametrize("alpha", EDGE_ALPHAS)
@pytest.mark.parametrize("independent", [False, True])
@pytest.mark.parametrize("sites", [None, ("blocks.0.gate",), ("dense.3", "dense.10")])
def test_round_trip_at_the_edges(alpha: float, independent: bool, sites) -> None:
    for kind in KINDS:
        ind = independent and kind == "token_shuffle"
        condition = Condition(kind, alpha if kind == "interpolate" else None, sites, ind, seed=7)
        back = parse_condition(condition.spec, seed=7)
        assert back == condition
        assert back.alpha is None or repr(back.alpha) == repr(condition.alpha)  # bit-exact, sign of zero too


def test_canonical_text_forms() -> None:
    assert Condition("interpolate", 0.5).name == "interpolate:0.5"
    assert Condition("interpolate", 1).name == "interpolate:1"  # as users type it; alpha is still the float 1.0
    assert Condition("interpolate", 0.1 + 0.2).name == "interpolate:0.30000000000000004"
    assert Condition("token_shuffle", independent=True, sites=("a", "b.c")).name == "token_shuffle+independent@a,b.c"
    assert parse_condition(" interpolate:5e-1 ").name == "interpolate:0.5"


@pytest.mark.parametrize(
    "text, said",
    [
        ("interpolate(0.5)", "cannot read condition"),
        ("token_shuffle[independent]", "cannot read condition"),
        ("interpolate:nan", "cannot read condition"),
        ("interpolate:inf", "cannot read condition"),
        ("interpolate", "interpolate needs alpha"),
        ("correct:0.5", "correct takes no alpha"),
        ("wobble", "unknown condition 'wobble'"),
        ("static_layer@", "cannot read condition"),
        ("static_layer@,", "sites must be non-empty names"),
    ],
)
def test_other_spellings_are_refused(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        parse_condition(text)


def test_sites_that_would_not_read_back_are_refused() -> None:
    for sites in [(), ("a,b",), ("a b",), ("",), ("x@y",)]:
        with pytest.raises(ValueError, match="sites must be non-empty names without spaces"):
            Condition("static_layer", sites=sites)


# ------------------------------------------------------------------------------------ command line

HEAVY = ("torch", "pyarrow", "pandas", "transformers")
PROBE = """
import sys, time
start = time.perf_counter()
{body}
print(sorted(m for m in {heavy!r} if m in sys.modules), round(time.perf_counter() - start, 3))
"""


def _fresh(body: str) -> tuple[list[str], float]:
    code = PROBE.format(body=body, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    loaded, seconds = out.strip().splitlines()[-1].rsplit(" ", 1)
    return eval(loaded), float(seconds)  # noqa: S307  (our own probe's output)


def test_help_does_not_import_torch() -> None:
    loaded, _ = _fresh("import fca.cli\nfca.cli.build_parser()")
    assert loaded == []
    body = (
        "import runpy\nsys.argv = ['fca', '--help']\n"
        "try:\n    runpy.run_module('fca', run_name='__main__')\nexcept SystemExit:\n    pass"
    )
    loaded, _ = _fresh(body)
    assert loaded == []


def test_the_public_api_is_listed_and_conditions_need_no_torch() -> None:
    loaded, _ = _fresh("import fca\nassert fca.Condition('interpolate', 0.5).spec == 'interpolate:0.5'")
    assert loaded == []
    import fca

    assert {"Condition", "SiteDeclaration", "audit", "build_cache", "Experiment"} <= set(dir(fca))


def test_help_lists_the_commands() -> None:
    """`--help` answers without torch (above: what keeps it quick) and names the commands a user starts with."""
    done = subprocess.run([sys.executable, "-m", "fca", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert {"build-cache", "audit", "replay", "inspect", "report", "dashboard"} <= set(
        re.findall(r"[a-z][a-z-]+", done.stdout)
    )


def test_an_undefined_layer_identity_share_is_not_reported_as_zero(tmp_path, capsys) -> None:
    report = json.loads((ROOT / "cache" / "demo" / "audit.json").read_text())
    report["variance"]["layer_identity_share"] = None  # (null where the coefficients do not vary)
    path = tmp_path / "audit.json"
    path.write_text(json.dumps(report))
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "explains an undefined share of the coefficient variance (the coefficients do not vary)" in out
    assert "**0.0%**" not in out


@pytest.mark.parametrize("content", [{"schema_version": 1, "sites": {}, "parts": []}, [1, 2], {"exactness": {}}])
def test_report_of_another_json_is_one_line(tmp_path, capsys, content) -> None:
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(content))
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "not an FCA audit report" in err


@pytest.mark.parametrize(
    "where, value, said",
    [
        (("exactness", "max_abs_logit_diff"), None, "exactness.max_abs_logit_diff is null, not a number"),
        (("variance", "per_site"), "x", "variance.per_site is a string, not an object"),
        (("model", "fingerprint"), None, "model.fingerprint is null, not a string"),
        (("execution", "ratio_min"), "x", "execution.ratio_min is a string, not a number"),
        (("cache", "path"), ..., "cache.path is missing"),
        (("variance", "chance_levels"), [0.01, 0.02], "variance.chance_levels is a list, not an object"),
        (("variance", "chance_levels"), {"token_id_within_slot": "x"}, "token_id_within_slot is a string"),
    ],
)
def test_a_report_with_a_damaged_field_is_one_line(tmp_path, capsys, where, value, said) -> None:
    """Only the top-level sections were checked: a damaged field inside one was a traceback halfway
    through rendering (and an exception box in the Overview, which reads reports the same way)."""
    report = json.loads((ROOT / "cache" / "demo" / "audit.json").read_text())
    section, key = where
    if value is ...:
        del report[section][key]
    else:
        report[section][key] = value
    path = tmp_path / "audit.json"
    path.write_text(json.dumps(report))
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}: not an FCA audit report (" in err and said in err


def test_report_of_the_shipped_audit_still_renders(capsys) -> None:
    assert main(["report", str(ROOT / "cache/demo/audit.json")]) == 0
    assert capsys.readouterr().out.startswith("# FCA audit")


# ------------------------------------------------------------------------------------ packaging


def _requirement(line: str) -> tuple[str, str]:
    name, pin = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)\s*", line).groups()
    return name.lower().replace("_", "-"), pin


def test_declared_dependencies_agree_with_requirements() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    declared = [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]
    text = (ROOT / "requirements.txt").read_text()
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    declared_pins = dict(_requirement(d) for d in declared)
    assert len(declared_pins) == len(declared)  # no package in two places
    assert declared_pins == dict(_requirement(line) for line in lines)
    assert project["scripts"] == {"fca": "fca.cli:main"}


def test_the_dashboard_command_serves_this_machine_with_the_repositorys_settings() -> None:
    """`fca dashboard` works from any folder: streamlit reads `.streamlit/config.toml` only from the folder it
    starts in, so the launcher passes what matters itself."""
    from fca.cli import build_parser, dashboard_command

    command = dashboard_command("127.0.0.1", 8765)
    assert command[1:4] == ["-m", "streamlit", "run"] and command[4] == str(ROOT / "app" / "main.py")
    assert {"--server.address=127.0.0.1", "--server.port=8765", "--browser.gatherUsageStats=false"} <= set(command)
    args = build_parser().parse_args(["dashboard"])
    assert (args.address, args.port) == ("127.0.0.1", 8501)
    config = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert config["server"]["address"] == "127.0.0.1" and config["browser"]["gatherUsageStats"] is False


def test_the_package_ships_every_layer() -> None:
    from setuptools import find_packages

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(find_packages(where=str(ROOT), include=include))
    assert {"fca", "fca.tables", "fca.engine", "fca.engine.models", "fca.jobs"} <= found
    assert not {p for p in found if not p.startswith("fca")}


def test_conditions_given_as_specs_one_spec_or_objects():
    from fca.tables.conditions import Condition, as_conditions

    assert as_conditions("correct") == [Condition("correct")]  # one spec, not its letters
    assert as_conditions(["interpolate:0.5", Condition("global_mean")], seed=3) == [
        Condition("interpolate", 0.5, seed=3),
        Condition("global_mean"),
    ]
    with pytest.raises(ValueError, match="not 0.5"):
        as_conditions([0.5])


def test_usage_mistakes_are_one_line_naming_the_command(capsys, monkeypatch) -> None:
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("a mistaken dashboard command started the server"))
    for argv, said in (
        (["replay", "--num-seqs", "0"], "fca: error: replay: argument --num-seqs: must be at least 1, not 0"),
        (["replya"], "fca: error: argument COMMAND: invalid choice: 'replya'"),
        ([], "fca: error: the following arguments are required: COMMAND"),
        (["inspect", "a", "--bogus"], "fca: error: inspect: unrecognized arguments: --bogus"),
        (["dashboard", "--port", "0"], "fca: error: dashboard: argument --port: must be at least 1, not 0"),
        (["dashboard", "--port", "70000"], "fca: error: dashboard: argument --port: must be at most 65535, not 70000"),
        (["train", "--vocab-size", "256"], "fca: error: train: argument --vocab-size: must be at least 257, not 256"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith(said), err
        assert "--help)" in err  # where the command's options are


def test_the_dashboard_without_its_extra_says_what_to_install(monkeypatch, capsys) -> None:
    """Without streamlit, `fca dashboard` printed its URL, then a bare `No module named streamlit`."""
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "streamlit" else found(name, *a))
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("the server was started"))
    assert main(["dashboard"]) == 2
    said = capsys.readouterr()
    assert said.out == "" and said.err == 'fca: error: the dashboard needs streamlit (pip install -e ".[app]")\n'


@pytest.mark.slow
def test_the_dashboard_command_is_the_server(tmp_path) -> None:
    """`fca dashboard` becomes the streamlit server: its exit status is the server's (a taken port: 1; the
    launcher had exited 0), and stopping the command stops the server (a launcher stopped by its pid had
    left the server running)."""
    import signal
    import socket
    import urllib.request

    launch = [sys.executable, "-m", "fca", "dashboard", "--port"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert subprocess.run([*launch, port], cwd=tmp_path, env=env, capture_output=True, timeout=60).returncode == 1
    server = subprocess.Popen(
        [*launch, port], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as answer:
                    assert answer.read() == b"ok"
                    break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "the dashboard did not start"
                time.sleep(0.5)
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        with pytest.raises(OSError):  # nothing listens there any more
            urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2)
    finally:
        server.kill()


def test_the_dashboard_reads_relative_paths_from_where_it_was_started(tmp_path, monkeypatch) -> None:
    """The app runs in the repository: `FCA_DEFAULT_CACHE=mine fca dashboard` means ./mine of the caller."""
    from fca.cli import dashboard_environment

    monkeypatch.chdir(tmp_path)
    env = dashboard_environment(
        {"FCA_DEFAULT_CACHE": "mine/eval", "FCA_CACHE_ROOTS": f"mine{os.pathsep}/abs", "X": "y"}
    )
    assert env == {
        "FCA_DEFAULT_CACHE": str(tmp_path / "mine" / "eval"),
        "FCA_CACHE_ROOTS": f"{tmp_path / 'mine'}{os.pathsep}/abs",
        "X": "y",
    }
    assert dashboard_environment({"FCA_DEFAULT_CACHE": " "}) == {"FCA_DEFAULT_CACHE": " "}  # unset, as the app reads it


def test_inspect_says_what_a_path_is_and_a_device_is_named_as_given(tmp_path, capsys) -> None:
    """`inspect` of a file, or of a build still under way (its `.partial` beside it), said only 'cache directory
    not found'; `--device cuda:3` without a GPU was reported as 'cuda'."""
    (tmp_path / "notes.txt").write_text("not a cache")
    (tmp_path / "building.partial").mkdir()
    for path, said in (
        ("notes.txt", "a file, not a cache directory"),
        ("building", "cache directory not found (an unfinished build: rerun build-cache to resume)"),
    ):
        assert main(["inspect", str(tmp_path / path)]) == 2
        assert f"{tmp_path / path}: {said}" in capsys.readouterr().err
    import torch

    from fca.engine.loading import resolve_device

    if not torch.cuda.is_available():
        with pytest.raises(Exception, match=r"device 'cuda:3' asked for, but no CUDA device is available"):
            resolve_device("cuda:3")


def test_a_cache_prints_as_one_line() -> None:
    """`print(fca.open_cache(...))` printed the whole manifest, every part's record and hash, twice over."""
    from fca.tables.store import open_cache

    shown = repr(open_cache(ROOT / "cache" / "demo" / "eval"))
    assert shown.endswith(": 256 x 128 tokens, 6 sites, float32 coefficients of a float32 model, 1 part)")
    assert "\n" not in shown and len(shown) < 200


@pytest.mark.skipif(shutil.which("bible") is None, reason="Debian's bible-kjv is not installed (CI installs it)")
def test_the_corpus_command_extracts_the_demos_text(tmp_path, capsys) -> None:
    """`fca corpus` writes, byte for byte, the text the shipped demo's caches record (their corpus
    fingerprint), one chapter per document, and replaces a file only with --overwrite."""
    out = tmp_path / "kjv.txt"
    fingerprint = json.loads((ROOT / "cache" / "demo" / "eval" / "manifest.json").read_text())["corpus"]["fingerprint"]
    assert main(["corpus", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: 1189 documents, 4.")
    assert hashlib.sha256(out.read_bytes()).hexdigest() == fingerprint
    chapters = out.read_text().split("\n\n")
    assert chapters[0].startswith("In the beginning God created the heaven and the earth. And the earth was")
    assert chapters[-1].rstrip().endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    out.write_text("changed")
    assert main(["corpus", "--out", str(out)]) == 2
    assert f"{out}: already exists (--overwrite, or overwrite=True from Python, replaces it)" in capsys.readouterr().err
    assert out.read_text() == "changed"
    assert main(["corpus", "--out", str(out), "--overwrite"]) == 0
    assert hashlib.sha256(out.read_bytes()).hexdigest() == fingerprint


def test_the_corpus_command_says_what_to_install(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no `bible` program anywhere
    assert main(["corpus", "--out", str(tmp_path / "kjv.txt")]) == 2
    assert "the `bible` program is missing: apt-get install bible-kjv bible-kjv-text" in capsys.readouterr().err
    assert not (tmp_path / "kjv.txt").exists()


def test_a_site_the_cache_lacks_is_refused_before_the_model_loads(capsys, monkeypatch) -> None:
    """`--conditions static_layer@<typo>` (or an audit's `--extra-conditions`) was refused only once the model had loaded and the replay's progress
    bar had started (minutes, for a large model); the cache's manifest alone says which sites there are."""
    import fca.jobs.experiment

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the conditions were checked")

    monkeypatch.setattr(fca.jobs.experiment, "load_model", no_loading)
    demo = ROOT / "cache" / "demo"
    caches = ["--model", str(demo / "featuregate"), "--cache", str(demo / "eval")]
    caches += ["--calibration", str(demo / "calibration")]
    said = "condition static_layer@blocks.9.gate: unknown site(s) ['blocks.9.gate']; the sites: ['blocks.0.gate',"
    for command in (["replay", *caches, "--no-save", "--conditions"], ["audit", *caches, "--extra-conditions"]):
        assert main([*command, "static_layer@blocks.9.gate"]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err


def test_a_result_pair_is_written_whole_or_not_at_all(tmp_path, capsys, monkeypatch) -> None:
    """A full disk while the Markdown was written left the new JSON in place beside no Markdown (or an old
    one), with `[Errno 28] No space left on device` naming no file. (Audits and studies write pairs alike.)"""
    audit = str(ROOT / "cache" / "demo" / "audit.json")
    real_write = Path.write_text

    def full_disk_for_markdown(self, text, *args, **kwargs):
        if self.name.endswith(f".md.{os.getpid()}.tmp"):
            raise OSError(28, "No space left on device")
        return real_write(self, text, *args, **kwargs)

    old = json.dumps({"fca_study_version": 0})
    (tmp_path / "old.json").write_text(old)
    monkeypatch.setattr(Path, "write_text", full_disk_for_markdown)
    for json_out in ("new.json", "old.json"):
        assert main(["study", audit, "--json", str(tmp_path / json_out), "--markdown", str(tmp_path / "s.md")]) == 2
        assert capsys.readouterr().err == f"fca: error: {tmp_path / 's.md'}: No space left on device\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]  # no temporary file left either
    assert (tmp_path / "old.json").read_text() == old
    monkeypatch.undo()
    assert main(["study", audit, "--json", str(tmp_path / "new.json"), "--markdown", str(tmp_path / "s.md")]) == 0
    assert (tmp_path / "s.md").read_text().startswith("# FCA study") and "fca_study_version" in (
        tmp_path / "new.json"
    ).read_text()


def test_outputs_inside_a_cache_folder_are_refused(tmp_path, capsys) -> None:
    """A report named part-00099.parquet inside a cache broke every Parquet reader of the folder (DuckDB: "No
    magic bytes"), and a cache built inside another made pandas fail on its manifest; the outer cache's
    `--overwrite` would delete what it counts as its own."""
    import shutil

    cache = tmp_path / "eval"
    shutil.copytree(ROOT / "cache" / "demo" / "eval", cache)
    audit = str(ROOT / "cache" / "demo" / "audit.json")
    demo = ROOT / "cache" / "demo"
    for argv, inside in (
        (["study", audit, "--json", str(cache / "part-00099.parquet")], cache / "part-00099.parquet"),
        (["report", audit, "--markdown", str(cache / "notes" / "audit.md")], cache / "notes" / "audit.md"),
        (["build-cache", "--model", str(demo / "featuregate"), "--corpus", audit, "--split", "eval", "--out",
          str(cache / "inside")], cache / "inside"),
    ):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fca: error: {inside}: inside the cache {cache}; write the ") and err.count("\n") == 1
    assert sorted(p.name for p in cache.iterdir()) == sorted(p.name for p in (demo / "eval").iterdir())


def test_a_cache_in_a_folder_that_cannot_be_written_is_refused_first(tmp_path, capsys, monkeypatch) -> None:
    """A read-only destination was found only when the build lock was made, after the model and the corpus
    had been read. (Root writes anywhere but a read-only mount, so the check is driven by its own question.)"""
    import fca.jobs.build
    import fca.tables.outputs

    monkeypatch.setattr(fca.tables.outputs.os, "access", lambda path, mode: Path(path) != tmp_path)
    monkeypatch.setattr(fca.jobs.build, "load_model", lambda *a, **k: pytest.fail("loaded before refusing"))
    demo = ROOT / "cache" / "demo"
    argv = ["build-cache", "--model", str(demo / "featuregate"), "--corpus", "unused.txt", "--split", "eval"]
    assert main([*argv, "--out", str(tmp_path / "cache")]) == 2
    assert capsys.readouterr().err == (
        f"fca: error: {tmp_path / 'cache'}: its folder {tmp_path} is not writable; choose another path for the cache\n"
    )
