"""What the pages (README.md, docs/*.md) quote of a line the code prints: a quote in `code` is
the line whole, as printed, where a number, a node list in parentheses and "..." may stand for
what another run printed. A test that has the printed line checks that a page quotes it so,
and fails when the line grows and the quote does not."""

import re

from helpers.processes import ROOT

# A quote's parts that stand for another run's values: "...", a node list "(n1,n2)" or
# "(ftn[1-2])", a number.
VARIABLE = re.compile(r"(\.\.\.|\([\w\[\],-]+\)|\d+)")


def quote_pattern(quote: str) -> re.Pattern:
    """The printed lines a quote stands for."""
    parts = []
    for part in VARIABLE.split(quote):
        if part == "...":
            parts.append(".*")
        elif part.isdigit():
            parts.append(r"\d+")
        elif VARIABLE.fullmatch(part):
            parts.append(r"\([\w\[\],-]+\)")
        else:
            parts.append(re.escape(part))
    return re.compile("".join(parts))


def quotes(page: str, start: str) -> list[str]:
    """The `code` spans of a page (a path under the project) that begin with `start`, each on
    one line as Markdown reads a span that a line break cuts. (A fenced block's ``` would pair
    the backticks after it wrongly: the blocks are left out.)"""
    text = re.sub(r"^```.*?^```[^\n]*$", "", (ROOT / page).read_text(), flags=re.S | re.M)
    spans = re.findall(r"`([^`]+)`", text)
    return [" ".join(span.split()) for span in spans if span.startswith(start)]


def assert_quoted_whole(page: str, line: str) -> None:
    """The page quotes the printed line whole (the quotes that begin with its first word are
    its candidates)."""
    candidates = quotes(page, line.split()[0])
    assert any(quote_pattern(quote).fullmatch(line) for quote in candidates), \
        f"{page} quotes no whole line as printed:\n{line}\nits quotes of that start:\n" + "\n".join(candidates)
