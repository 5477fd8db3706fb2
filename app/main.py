"""FCA dashboard: `streamlit run app/main.py`. The router and the shared sidebar; pages live in views/.

The sidebar picks a cache (every cache under the configured roots, re-scanned as you go), the model it
belongs to and the device; the selection is handed to the page through `st.session_state`.
Roots: `cache/` of this repository plus the folders in FCA_CACHE_ROOTS (os.pathsep-separated);
FCA_DEFAULT_CACHE names the cache selected first (default: cache/demo/eval); FCA_FAMILIES names family files
(os.pathsep-separated) declaring models FCA does not know, as `--family` does for the other commands.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # a fresh clone runs without installing the package
    sys.path.insert(0, str(REPO))

# plotly's JSON encoder imports PIL.Image the first time it draws a chart; imported here, in the first script
# run, before the warm-up thread starts, so that a page and that thread never import it at once (one of them
# then saw it half-initialised).
import PIL.Image  # noqa: E402, F401
import streamlit as st  # noqa: E402

st.set_page_config(page_title="FCA: Frozen-Controller Auditing", page_icon="❄️", layout="wide")
if st.session_state.get("fca_display") == "presenter":  # (views.common.DISPLAY_KEY: the chart, not the controls)
    st.set_page_config(initial_sidebar_state="collapsed")

# The dashboard runs models and reads local files: it serves this machine unless told otherwise. Streamlit
# reads the repository's `.streamlit/config.toml` (address 127.0.0.1) only when started from the
# repository's root; started elsewhere it listens on every interface, so another machine's visit is
# refused unless an address was chosen (`--server.address`).
if st.context.ip_address is not None and not st.get_option("server.address"):
    st.error(
        "This FCA dashboard serves the machine it runs on only, and this visit comes from another machine "
        f"({st.context.ip_address}). It was started outside the repository's root, without its settings: start "
        "it with `python -m fca dashboard` (or `streamlit run app/main.py` from the repository root), or pass "
        "`--server.address` to serve other machines deliberately."
    )
    st.stop()

from app import resources  # noqa: E402
from app.views.common import (
    DISPLAY_KEY,
    SELECTION_KEY,
    THEME_KEY,
    Selection,
    match_typed,
    typed_outside,
    typed_path,
    typed_problem,
)  # noqa: E402
from fca.tables import catalog  # noqa: E402
from fca.tables.errors import CacheError  # noqa: E402
from fca.tables.text import markdown_code, markdown_text  # noqa: E402

PAGES = [
    # (The default page is served at the root URL; its url_path only has to differ from the alias's below.)
    st.Page("views/overview.py", title="Overview", icon=":material/fact_check:", url_path="home", default=True),
    st.Page("views/lecture.py", title="Lecture", icon=":material/co_present:", url_path="lecture"),
    st.Page("views/variance.py", title="Variance", icon=":material/grid_on:", url_path="variance"),
    st.Page("views/profiles.py", title="Profiles", icon=":material/show_chart:", url_path="profiles"),
    st.Page("views/token_text.py", title="Token text", icon=":material/text_fields:", url_path="token_text"),
    st.Page("views/replay_lab.py", title="Replay lab", icon=":material/science:", url_path="replay_lab"),
    st.Page("views/execution.py", title="Execution", icon=":material/speed:", url_path="execution"),
    st.Page("views/study.py", title="Study", icon=":material/stacked_line_chart:", url_path="study"),
    # The default page lives at the root URL; this alias keeps a bookmark or link to /overview working
    # (it hands over to the default page, so that the sidebar marks the Overview as the page shown).
    st.Page("views/overview.py", title="Overview", url_path="overview", visibility="hidden"),
]
OVERVIEW, OVERVIEW_ALIAS, STUDY = PAGES[0], PAGES[-1], PAGES[-2]
DEVICES = ("auto", "cuda", "cpu")


def offered_devices() -> tuple[str, ...]:
    """The Device box's choices, fixed for a session: `cuda` only where a CUDA device may be present."""
    if "fca_devices" not in st.session_state:
        cuda = resources.cuda_may_be_present()
        st.session_state["fca_devices"] = DEVICES if cuda else tuple(d for d in DEVICES if d != "cuda")
    return st.session_state["fca_devices"]


def default_cache(entries: list[catalog.CacheEntry]) -> int:
    """Index of the cache selected first: FCA_DEFAULT_CACHE, else cache/demo/eval, else the first
    evaluated (non-calibration) cache."""
    env = os.environ.get("FCA_DEFAULT_CACHE", "").strip()
    wanted = [catalog.user_path(env)] if env else []
    wanted.append((REPO / "cache" / "demo" / "eval").resolve())
    paths = [e.path for e in entries]
    for w in wanted:
        if w in paths:
            return paths.index(w)
    return next((i for i, e in enumerate(entries) if e.split != "calibration" and e.error is None), 0)


def default_cache_problem(entries: list[catalog.CacheEntry], roots: list[Path]) -> str | None:
    """Why FCA_DEFAULT_CACHE, when set, names none of the listed caches (None: it is listed, or unset), so
    that a mistyped variable is said instead of another cache silently shown in its place."""
    wanted = os.environ.get("FCA_DEFAULT_CACHE", "").strip()
    path = catalog.user_path(wanted)
    if not wanted or path in [e.path for e in entries]:
        return None
    if not catalog.path_allowed(path, roots):
        why = "it is outside the configured roots (add its folder to FCA_CACHE_ROOTS)"
    elif not catalog.is_folder(path):
        why = "there is no such folder"
    elif not (path / "manifest.json").is_file():
        why = "the folder has no manifest.json"
    else:
        why = "it is not among the caches found"
    return f"FCA_DEFAULT_CACHE={wanted}: {why}; another cache is selected instead."


def _on_cache_typed(roots: list[Path]) -> None:
    """Before the rerun: a typed path that names a listed cache selects that entry (not "Add: ...")."""
    choice = st.session_state.get("cache")
    listed = [str(e.path) for e in resources.caches(tuple(str(r) for r in roots))]
    if choice and choice not in listed:
        matched = match_typed(choice, roots, listed, REPO)
        if matched is not None:
            st.session_state["cache"] = matched


def family_files() -> None:
    """Run the family files FCA_FAMILIES names, before any model is loaded (each file once per version:
    `fca.engine.user_families` keeps what it declared); a bad one is said, and the others still load.
    Files are only given when the dashboard starts, never typed in the page: loading one runs its code."""
    files = resources.family_files()
    if not files:
        return
    from fca.jobs.families import load_each_family_file  # (torch: only when families are declared)

    declared, errors = load_each_family_file(files)
    for error in errors:
        st.error(f"Family file (FCA_FAMILIES): {markdown_text(error)}")
    if declared:
        st.caption(
            "Families from files: "
            + ", ".join(f"{markdown_text(t)} ({markdown_text(Path(p).name)})" for t, p in declared)
        )


def unreadable_reason(error: str, width: int = 60) -> str:
    """What is wrong with a listed cache, short enough for its entry in the cache box (the whole line is
    shown when it is picked)."""
    reason = error.split(": not a readable manifest (", 1)[-1].removesuffix(")")
    return reason if len(reason) <= width else reason[: width - 3] + "..."


THEME_CHOSEN = "fca_theme_chosen"  # the Theme switch was used in this session: it, not the browser, decides
# Streamlit keeps its theme in the browser and offers no call to set it, so the switch hands its choice to the
# page's own theme setter (the one its settings menu uses, which also remembers the choice for the next
# visit): found on the app's root component, called only when the page shows another theme.
APPLY_THEME = """<script>(() => {
  const want = %s, root = document.getElementById("root");
  const key = root && Object.keys(root).find(k => k.startsWith("__reactContainer$"));
  const stack = key ? [root[key]] : [];
  while (stack.length) {
    const node = stack.pop(), app = node.stateNode;
    if (app && typeof app.setAndSendTheme === "function") {
      const themes = app.props.theme;
      const theme = themes.availableThemes.find(t => t.name === want || t.name === "Custom Theme " + want);
      if (theme && themes.activeTheme.name !== theme.name) app.setAndSendTheme(theme);
      return;
    }
    if (node.sibling) stack.push(node.sibling);
    if (node.child) stack.push(node.child);
  }
})();</script>"""


def theme_switch() -> None:
    """Light or dark, for the page and its charts (with either Display). Until it is used, it follows the
    browser (its system setting or the theme last chosen); once used, the page takes its choice."""
    state, shown = st.session_state, st.context.theme.type  # (None until the browser has said)
    if shown in ("light", "dark") and (THEME_KEY not in state or not state.get(THEME_CHOSEN)):
        state[THEME_KEY] = shown
    state.setdefault(THEME_KEY, "light")
    st.segmented_control(
        "Theme",
        ["light", "dark"],
        key=THEME_KEY,
        required=True,
        on_change=lambda: state.__setitem__(THEME_CHOSEN, True),
        help="the page and its charts, light or dark (every chart's text at 4.5:1 contrast or more in both)",
    )
    if state.get(THEME_CHOSEN):
        st.html(APPLY_THEME % json.dumps(state[THEME_KEY].capitalize()), unsafe_allow_javascript=True)


def sidebar() -> Selection:
    roots = catalog.configured_roots(REPO)
    sel = Selection(roots=roots)
    with st.sidebar:
        st.segmented_control(
            "Display",
            ["standard", "presenter"],
            default="standard",
            key=DISPLAY_KEY,
            help="presenter: the sidebar folded away, the explanations hidden, chart text at 16 px or more",
        )
        theme_switch()
        st.markdown("### Data")
        family_files()
        entries = resources.caches(tuple(str(r) for r in roots))
        sel.entries = entries
        if not entries:
            st.warning(
                "No cache found under "
                + ", ".join(str(r) for r in roots)
                + ". Build one with `python -m fca build-cache`."
            )
        if problem := default_cache_problem(entries, roots):
            st.warning(problem)
        if missing := [str(r) for r in roots[1:] if not catalog.is_folder(r)]:  # (roots[0] is this repository's cache/)
            st.warning(
                f"FCA_CACHE_ROOTS names {markdown_text(', '.join(missing))}: no such folder, so no cache is listed from it."
            )
        by_path = {str(e.path): e for e in entries}
        # Caches inside the repository are named from its root (`cache/demo/eval`), so typing the path
        # one would type in a shell filters to the listed cache instead of offering "Add: ...".
        shown = {
            p: str(e.path.relative_to(REPO)) if e.path.is_relative_to(REPO) else e.label for p, e in by_path.items()
        }
        # One widget both picks a found cache and takes a typed path (accept_new_options); a second
        # input widget would cost the first page another ~20 browser chunks before its first chart.
        choice = st.selectbox(
            "Cache",
            list(by_path),
            # The default only for a new session: once the key holds a choice (another page may have set it,
            # as the Study page's Open does), a default beside it makes Streamlit warn and is ignored anyway.
            index=default_cache(entries) if entries and "cache" not in st.session_state else None,
            key="cache",
            accept_new_options=True,
            format_func=lambda p: (
                (
                    f"{shown[p]} (unreadable: {unreadable_reason(by_path[p].error)})"
                    if by_path[p].error
                    else f"{shown[p]} ({by_path[p].split or '?'}, {by_path[p].num_seqs} seq)"
                )
                if p in by_path
                else p
            ),
            placeholder="type a cache directory",
            on_change=_on_cache_typed,
            args=(roots,),
            help="Pick a cache, or type the path of one inside a configured root: "
            + ", ".join(str(r) for r in roots)
            + " (add more with FCA_CACHE_ROOTS)",
        )
        # The catalog is re-scanned at most every 2 s, and only when the page reruns; a cache built
        # while the page sits idle shows up on the next rerun, or at once with this button.
        st.button(
            "Re-scan for new caches",
            key="cache_rescan",
            type="tertiary",
            icon=":material/refresh:",
            help="look again for caches built since this page was opened",
            on_click=resources.caches.clear,
        )
        typed = (choice or "").strip()
        matched = None if choice in by_path else match_typed(typed, roots, list(by_path), REPO)
        if choice in by_path or matched is not None:
            sel.entry = by_path[choice if choice in by_path else matched]
        elif typed and typed_outside(typed, roots, REPO):
            st.error(f"{markdown_text(typed)}: outside the configured roots; set FCA_CACHE_ROOTS to allow it")
        elif typed and (problem := typed_problem(typed, roots, REPO)):
            sel.cache_error = problem  # shown by the page as "This cache cannot be used: ..."
            return sel
        elif typed:
            sel.entry = catalog.read_entry(typed_path(typed, roots, REPO))
        entry = sel.entry
        if entry is None:
            return sel
        if entry.error:
            sel.cache_error = entry.error
        else:
            try:
                sel.cache = resources.open_cache(str(entry.path), entry.manifest_hash)
            except CacheError as err:
                sel.cache_error = str(err)
        named = catalog.find_model_dir(entry.path)
        beside = catalog.model_dirs_beside(entry.path)
        # A Dense twin has no controllers: never the cache's model (the named model's, or, when that is
        # not there, any model's beside it, which was offered first when it came first alphabetically).
        twins = {catalog.find_dense_twin(m) for m in ([named] if named else beside)}
        models = [m for m in beside if m not in twins]
        if models:
            default = models.index(named) if named in models else 0
            chosen = st.selectbox(
                "Model",
                [str(m) for m in models],
                index=default,
                key=f"model::{entry.path}",
                format_func=lambda p: (
                    Path(p).name + ("" if named and Path(p) == named else " (not named by the cache)")
                ),
            )
            sel.model_dir = Path(chosen)
        else:
            recorded = sel.cache.manifest.model.path if sel.cache is not None else None
            st.caption(
                "No model directory beside this cache: replay and execution are unavailable."
                + (
                    f" Its manifest names {markdown_code(Path(recorded).name)}: a model folder of that name (or a link to one) "
                    f"in {markdown_code(entry.path.parent.name + '/')} would be used."
                    if recorded
                    else ""
                )
            )
        sel.device = st.selectbox(
            "Device",
            offered_devices(),
            key="device",
            help="auto: CUDA when available, else CPU (cuda is offered where present)",
        )
        sel.calibration = catalog.find_calibration(entry, entries)
        if sel.calibration is not None:
            try:
                sel.calibration_cache = resources.open_cache(str(sel.calibration.path), sel.calibration.manifest_hash)
            except CacheError as err:
                st.error(f"Calibration cache: {markdown_text(err)}")
        sel.dense_dir = catalog.find_dense_twin(sel.model_dir) if sel.model_dir else None
        sel.report_path = catalog.find_report(entry.path)
        no_calibration = "none: this is a calibration split" if entry.split == "calibration" else "none found"
        st.caption(
            f"Calibration: {markdown_code(sel.calibration.label if sel.calibration else no_calibration)}  \n"
            f"Dense twin: {markdown_code(sel.dense_dir.name if sel.dense_dir else 'none found')}  \n"
            f"Audit report: {markdown_code(sel.report_path.name if sel.report_path else 'none')}"
        )
    return sel


resources.page_ran()
# A Markdown table wider than its column (the Overview's conditions on an 800 px screen) scrolls sideways
# inside it, as a data grid does; Streamlit's own style cut it at the page's edge. (Style only: no space.)
st.html('<style>[data-testid="stMarkdownContainer"] table { display: block; overflow-x: auto; }</style>')
# Keyboard focus in the sidebar's page list as a ring, not the tinted background that marks the current page
# (a link reached with Tab looked like the page shown). currentColor: legible in both themes.
st.html(
    '<style>[data-testid="stSidebarNav"] a:focus-visible { outline: 2px solid currentColor; outline-offset: -2px; '
    "background-color: transparent; }</style>"
)
if st.session_state.get(DISPLAY_KEY) == "presenter":  # the captions too are the speaker's to say
    st.html('<style>[data-testid="stCaptionContainer"] { display: none; }</style>')
page = st.navigation(PAGES)
if page is OVERVIEW_ALIAS:
    st.switch_page(OVERVIEW)
selection = sidebar()
st.session_state[SELECTION_KEY] = selection
if selection.cache_error and page is not STUDY:  # (the Study page reads study files, not the selected cache)
    st.error(f"This cache cannot be used: {markdown_text(selection.cache_error)}")
page.run()
resources.page_ran()  # the warm-up's steps wait for a quiet moment after this one
if selection.cache is not None:  # after the page: fill the caches the next pages will need
    resources.warm_up(
        selection.cache, selection.model_dir, selection.device, selection.calibration_cache, selection.dense_dir
    )
