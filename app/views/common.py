"""What every page shares: the sidebar's selection, the error guard, teaching text and downloads."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import streamlit as st

from fca.tables import catalog
from fca.tables.catalog import CacheEntry
from fca.tables.errors import CacheError, ExactnessError, ModelLoadError
from fca.tables.store import Cache
from fca.tables.text import markdown_text

if TYPE_CHECKING:
    import pandas as pd

SELECTION_KEY = "fca_selection"
# Problems with a user's files or settings: shown as st.error with the reason, and the app goes on.
USER_ERRORS = (CacheError, ModelLoadError, ExactnessError, ValueError, KeyError, OSError, RuntimeError)


@dataclass
class Selection:
    """What the sidebar chose; built by app/main.py before a page runs."""

    roots: list[Path]
    entries: list[CacheEntry] = field(default_factory=list)
    entry: CacheEntry | None = None
    cache: Cache | None = None
    cache_error: str | None = None
    model_dir: Path | None = None
    calibration: CacheEntry | None = None
    calibration_cache: Cache | None = None
    dense_dir: Path | None = None
    report_path: Path | None = None
    device: str = "auto"

    @property
    def fingerprint(self) -> str:
        return self.cache.fingerprint if self.cache is not None else ""

    @property
    def is_calibration(self) -> bool:
        """The selected cache is a calibration split: the static profile's source, not what is evaluated."""
        return self.entry is not None and self.entry.split == "calibration"

    @property
    def static_profile_cache(self) -> Cache | None:
        """The cache whose mean is the static profile: the calibration cache found for the selected one, or
        the selected cache itself when it is a calibration split."""
        return self.cache if self.is_calibration else self.calibration_cache

    def evaluated_caches(self) -> list[CacheEntry]:
        """The readable evaluated (non-calibration) caches of the selected cache's model, those beside it
        first."""
        if self.entry is None:
            return []
        found = [
            e
            for e in self.entries
            if e.error is None and e.split != "calibration" and e.model_fingerprint == self.entry.model_fingerprint
        ]
        return sorted(found, key=lambda e: (e.path.parent != self.entry.path.parent, e.label))


def typed_path(typed: str, roots: list[Path], repo: Path) -> Path:
    """A cache path typed in the sidebar as the folder it names: `~` expanded, trailing slashes and
    spaces dropped, and a relative path read from the repository (where `cache/...` lives), else from
    the first root that holds it (so a listed label such as `demo/eval` names its cache too)."""
    text = typed.strip().rstrip("/\\") or typed.strip()
    if "\0" in text:
        raise ValueError("a path cannot hold a NUL character")
    path = Path(text)
    if path.is_absolute() or text.startswith("~"):
        return catalog.user_path(path)
    for base in (repo, *roots):
        if catalog.is_folder(Path(base) / path):  # (a cache is a folder)
            return (Path(base) / path).resolve()
    return (repo / path).resolve()


def match_typed(typed: str, roots: list[Path], listed: list[str], repo: Path) -> str | None:
    """The listed cache (its path, as in `listed`) that a typed path names, if any."""
    try:
        path = str(typed_path(typed, roots, repo)) if typed.strip() else None
    except ValueError:  # not a path at all: `typed_problem` says so
        return None
    return path if path in listed else None


def typed_outside(typed: str, roots: list[Path], repo: Path) -> bool:
    """Whether a typed path names a folder outside the configured roots (False for a folder that does not
    exist, a typo more often than not, and for text that is no path at all: `typed_problem` says which)."""
    try:
        path = typed_path(typed, roots, repo)
    except ValueError:
        return False
    return catalog.is_folder(path) and not catalog.path_allowed(path, roots)


def typed_problem(typed: str, roots: list[Path], repo: Path) -> str | None:
    """Why a typed path (inside the configured roots) cannot be opened as a cache, in one plain sentence
    instead of an OSError's "[Errno 2] ..." (None: it can be tried)."""
    try:
        path = typed_path(typed, roots, repo)
    except ValueError as err:
        return f"{typed.strip()!r} is not a path: {err}."
    if not catalog.is_folder(path):
        relative = not (Path(typed.strip()).is_absolute() or typed.strip().startswith("~"))
        where = (
            f" (relative paths are read from {repo})"  # (said only where it explains which folder was looked for)
            if relative
            else ""
        )
        outside = (
            "; it is also outside the configured roots (set FCA_CACHE_ROOTS to allow it)"
            if not catalog.path_allowed(path, roots)
            else ""
        )
        return f"there is no folder {typed.strip()}{where}{outside}."
    if not (path / "manifest.json").is_file():
        return f"{typed.strip()} is a folder but not a cache: it has no manifest.json."
    return None


def selection() -> Selection:
    return st.session_state[SELECTION_KEY]


def require_cache() -> Selection:
    """The selection, or stop the page (main.py has already said why there is no usable cache)."""
    sel = selection()
    if sel.cache is None:
        st.info("Pick a readable cache in the sidebar to see this page.")
        st.stop()
    return sel


@contextmanager
def guard(what: str) -> Iterator[None]:
    """Show a user-facing failure as st.error and carry on with the rest of the page."""
    try:
        yield
    except USER_ERRORS as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        st.error(f"{what}: {markdown_text(message)}")  # (its paths and names come from files)


KEPT_KEY = "fca_kept_widgets"


def keep(key: str, default, valid: Callable[[object], bool] = lambda value: True) -> None:
    """Before the widget `key` is drawn: its value as the user last left it, else `default`. Streamlit
    forgets the value of a widget that a run does not draw (a lazy tab left closed, another page), so
    coming back drew it at its default: a teacher who glanced at another tab lost the view set up. A kept
    value that does not fit this cache (`valid`: a sequence past its end, a site it lacks) gives way to
    `default`. Draw the widget without a default of its own (its value is set here)."""
    state = st.session_state
    kept = state.setdefault(KEPT_KEY, {})
    value = state[key] if key in state else kept.get(key, default)
    if not valid(value):
        value = default
    if key not in state or state[key] != value:
        state[key] = value
    kept[key] = value


def in_range(low: int, high: int) -> Callable[[object], bool]:
    """`valid` for `keep`: a whole number from `low` to `high`."""
    return lambda value: isinstance(value, int) and low <= value <= high


def one_of(options) -> Callable[[object], bool]:
    """`valid` for `keep`: one of `options` (a selectbox's, a radio's)."""
    return lambda value: value in list(options)


DISPLAY_KEY = "fca_display"  # the sidebar's Display choice: "standard" or "presenter"
PRESENTER_FONT = 16  # px: the smallest chart text in presenter view, legible from the back of a room


THEME_KEY = "fca_theme"  # the sidebar's Theme choice: "light" or "dark" (app/main.py)


def presenting() -> bool:
    return st.session_state.get(DISPLAY_KEY) == "presenter"


def page_theme() -> str:
    """The theme the page is drawn in, "light" or "dark": the sidebar's choice, else the browser's own."""
    chosen = st.session_state.get(THEME_KEY) or st.context.theme.type
    return "dark" if chosen == "dark" else "light"


def teach(text: str) -> None:
    """The two or three sentences that open every page: what the plot shows and how to read it (left out in
    presenter view, where the speaker says them)."""
    if not presenting():
        st.markdown(text)


def share_text(share: float | None) -> str:
    """A layer-identity share as the pages show it; None (the coefficients do not vary, so no share is
    defined) as "n/a", never as 0.0%."""
    return "n/a" if share is None else f"{100 * share:.1f}%"


def csv_bytes(table: pd.DataFrame | list[dict]) -> bytes:
    """CSV of a DataFrame, or of a list of row dicts written without pandas (the Overview stays
    pandas-free to draw its first chart sooner); both give the same bytes for the same rows."""
    if not isinstance(table, list):
        return table.to_csv(index=False).encode()
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(table[0]) if table else [], lineterminator="\n")
    writer.writeheader()
    writer.writerows(table)
    return out.getvalue().encode()


def download(table: pd.DataFrame | list[dict], name: str, label: str = "Download CSV", key: str | None = None) -> None:
    """A CSV download of `table`, written only when clicked (deferred: drawing a page serialised and
    sent every table, and the browser fetched each one) and without rerunning the page."""
    st.download_button(
        label, lambda: csv_bytes(table), file_name=name, mime="text/csv", key=key or f"dl-{name}", on_click="ignore"
    )


def study_retention_frames(study: dict) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A study's gap retention as `figures.study_retention` draws it: (points: condition, seed, retention;
    summary: condition, mean, lo, hi), for the conditions whose retention the study summarises."""
    import pandas as pd  # (here: the Overview and the sidebar draw without pandas)

    conditions = study["summary"]["conditions"]
    retained = [c for c, s in conditions.items() if "gap_retention" in s]
    points = pd.DataFrame(
        [
            {
                "condition": c,
                "seed": str(r["seed"]) if r["seed"] is not None else r["name"],
                "retention": r["gap_retention"].get(c),
            }
            for r in study["seeds"]
            for c in retained
        ],
        columns=["condition", "seed", "retention"],
    )
    summary = pd.DataFrame(
        [
            {
                "condition": c,
                "mean": conditions[c]["gap_retention"]["mean"],
                "lo": (conditions[c]["gap_retention"]["ci95"] or [None, None])[0],
                "hi": (conditions[c]["gap_retention"]["ci95"] or [None, None])[1],
            }
            for c in retained
        ],
        columns=["condition", "mean", "lo", "hi"],
    )
    return points, summary


def figure_caption(sel: Selection, conditions=None, sites=None, seed=None, sequences: int | None = None) -> str:
    """The line an exported figure carries: model, cache, sequences, seed, conditions, sites. `conditions`
    and `sites`: what the figure's run or report covered (None: the figure is of the cache itself, or of
    every site); `seed`: the run's (None: the model's training seed, where its config records one)."""
    cache = sel.cache
    if cache is None:
        return ""
    model = cache.manifest.model
    seed = seed if seed is not None else (model.config or {}).get("init_seed")
    every = cache.sites
    if sites is None and conditions and all("@" in str(c) for c in conditions):  # a run that froze some sites
        sites = list(dict.fromkeys(s for c in conditions for s in str(c).partition("@")[2].split(",")))
    shown_sites = (
        f"all {len(every)} sites" if sites is None or list(sites) == every else "sites " + ", ".join(map(str, sites))
    )
    parts = [
        f"model {Path(str(model.path)).name or model.model_type} ({model.model_type}, {model.fingerprint[:12]})",
        f"cache {sel.entry.label if sel.entry is not None else cache.path.name}",
        f"{cache.num_seqs if sequences is None else sequences} sequences x {cache.seq_len} tokens",
        f"seed {'n/a' if seed is None else seed}",
        "conditions " + (", ".join(map(str, conditions)) if conditions else "none (coefficients as cached)"),
        shown_sites,
    ]
    return " | ".join(parts)


CHART_CONFIG = {"displaylogo": False}


def _shown(fig, theme: str, presenter: bool):
    """`fig` as the page draws it: for the presenter's text sizes, then in the page's own theme (Streamlit's
    chart theme draws grey 12 px text, 3.7:1 on white, and keeps dark marks dark on a dark page). Kept on
    the figure, so that a figure a page caches (`st.cache_resource`) is themed once per theme and display."""
    from app import figures

    kept = fig.__dict__.setdefault("_fca_shown", {})
    if (theme, presenter) not in kept:
        drawn = figures.for_presenter(fig, PRESENTER_FONT) if presenter else fig
        kept[(theme, presenter)] = figures.themed(drawn, theme)
    return kept[(theme, presenter)]


def chart(fig, key: str, caption: str | None = None, where=None, **kwargs):
    """A plotly chart and, beside it, its downloads for slides: SVG, PNG at 2x and 3x, each with `caption`
    at its foot (`figures.for_slides`; None: the selected cache's own), rendered on this machine only when
    clicked. `where`: the container
    to draw in (default: the page); `kwargs` go to st.plotly_chart (selection events)."""
    import html

    from app import export, figures

    where = where or st
    caption = figure_caption(selection()) if caption is None else caption
    shown = _shown(fig, page_theme(), presenting())
    event = where.plotly_chart(shown, key=key, config=CHART_CONFIG, theme=None, **kwargs)
    # Escaped: the caption holds names from files (a cache's folder, a model's), and plotly reads markup.
    slide = lambda: figures.for_slides(fig, html.escape(caption, quote=False))  # noqa: E731
    with where.popover("Figure for slides", icon=":material/download:", type="tertiary"):
        for label, (fmt, scale) in export.FORMATS.items():
            st.download_button(
                label,
                lambda fmt=fmt, scale=scale: export.image_bytes(slide(), fmt, scale),
                file_name=f"{key}{'' if scale == 1 else f'@{scale}x'}.{fmt}",
                mime=export.MIME[fmt],
                key=f"fig-{key}-{fmt}{scale}",
                on_click="ignore",
            )
    return event
