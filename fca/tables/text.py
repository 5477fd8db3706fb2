"""Strings from files (a condition's name, a site's, a device's, a note) shown inside Markdown: as the text
they are, never as markup. Caches, reports and runs come from other people: `[x](https://...)` must not
become a link, `![i](https://...)` must not make the reader's browser fetch anything, and `<a href=...>`
must not reach the page as HTML."""

from __future__ import annotations

import ast
import re

# What makes Markdown markup mid-line (CommonMark and GitHub's; Streamlit's adds $ for LaTeX): escaped with a
# backslash, which CommonMark allows before any ASCII punctuation. `[` opens every link and image (so `]`, `(`
# and `!` need nothing); `_` only where it could open or close emphasis (`static_layer`, `aten._int_mm` stay).
_MARKUP = re.compile(r"[\\`*\[<>~$@&]|(?<![A-Za-z0-9.])_|_(?![A-Za-z0-9])")
# GitHub's and Streamlit's renderers turn URLs and e-mail addresses in text into links after the escapes are
# read (so no escape stops them): a word joiner (U+2060, invisible, no line break) inside `://`, `www.` and
# after `@` leaves nothing they recognise.
_AUTOLINKED = re.compile(r"(?<=:)(?=//)|(?<=www)(?=\.)|(?<=@)", re.IGNORECASE)
WORD_JOINER = "\u2060"
_BLOCK_START = re.compile(r"^(\s*\d*)([#>+=-]|(?<=\d)[.)])")  # what would open a heading, quote, list or rule


def markdown_text(value: object, cell: bool = False) -> str:
    """`value` as one line of Markdown text that renders as exactly its characters; `cell`: in a table's
    cell, where `|` would end it."""
    text = " ".join(str(value).splitlines())
    text = _MARKUP.sub(lambda m: "\\" + m.group(0), text)
    text = _AUTOLINKED.sub(WORD_JOINER, text)
    text = text.replace("|", "\\|") if cell else text
    return _BLOCK_START.sub(lambda m: m.group(1) + "\\" + m.group(2), text, count=1)


def markdown_code(value: object) -> str:
    """`value` as a Markdown code span (what it holds is never markup), safe in a table cell too: a fence
    longer than any run of backticks inside, and `|` escaped (GitHub splits table cells on it even there)."""
    text = " ".join(str(value).splitlines()).replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    padded = f" {text} " if text.startswith("`") or text.endswith("`") else text
    return f"{fence}{padded}{fence}"


def percent(share: float | None, digits: int = 1, missing: str = "n/a") -> str:
    """A share (0.5) as a percent ("50.0%"), `missing` where there is none."""
    return missing if share is None else f"{100 * share:.{digits}f}%"


def mapping_text(value: object) -> str:
    """A (nested) mapping in words, as a reader wants it rather than as Python prints it:
    {'float32': {'nll_mean': 0.0001}, 'float16': {'nll_mean': 0.005}} -> 'float32 (nll_mean 0.0001); float16
    (nll_mean 0.005)'. Numbers as `:g` gives them; anything else as its text."""
    if isinstance(value, dict):
        nested = any(isinstance(v, dict) for v in value.values())
        parts = [
            f"{k} ({mapping_text(v)})" if isinstance(v, dict) else f"{k} {mapping_text(v)}" for k, v in value.items()
        ]
        return ("; " if nested else ", ").join(parts)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# The longest mapping printed inside a sentence that `mappings_as_words` reads back (a definition's
# tolerance tables: about 400 characters).
_MAX_MAPPING_CHARS = 4000


def mappings_as_words(text: str) -> str:
    """`text` with every Python-printed dict inside it (`{'float32': 0.0, ...}`, as older audit reports wrote
    their tolerance tables into a definition) rewritten by `mapping_text`. Read back as a literal only
    (`ast.literal_eval`: no code runs), and only where it parses as a dict; any other brace is left as it is."""
    out, i = [], 0
    while (start := text.find("{", i)) >= 0:
        depth, end = 0, -1
        for j in range(start, min(len(text), start + _MAX_MAPPING_CHARS)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                end = j + 1
                break
        try:
            value = ast.literal_eval(text[start:end]) if end > 0 else None
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            value = None
        if isinstance(value, dict):
            out += [text[i:start], mapping_text(value)]
        else:
            end = start + 1
            out.append(text[i:end])
        i = end
    out.append(text[i:])
    return "".join(out)
