"""Plain-text tables for the CLI and the benchmark: aligned columns or a GitHub markdown table.

Numbers are right-aligned, everything else left-aligned; floats get three decimals so a column of
times lines up on the decimal point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_GAP = "  "


def format_cell(value: object) -> str:
    """Text of one table cell: floats with 3 decimals, None as '-', anything else via str()."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.3f}"
    return str(value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _numeric_columns(rows: Sequence[Sequence[object]], num_cols: int) -> list[bool]:
    """A column is numeric (right-aligned) when it has a number and only numbers or None."""
    numeric = []
    for c in range(num_cols):
        cells = [row[c] for row in rows if row[c] is not None]
        numeric.append(bool(cells) and all(_is_number(v) for v in cells))
    return numeric


def _check_shape(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"rows[{i}]: has {len(row)} cells but there are {len(headers)} headers")


def render_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    markdown: bool = False,
    align: str | None = None,
) -> str:
    """Render `rows` under `headers` as aligned plain-text columns, or as a GitHub markdown table.

    Takes any sequences (lists of lists, tuples, ...). Plain text: a header line, a line of dashes
    under each column, then one line per row; columns are separated by two spaces and trailing
    spaces are stripped. `align`: one "l" or "r" per column (e.g. "lrrr" for preformatted numbers);
    default: numbers right, the rest left. Raises ValueError when a row's length differs from the
    number of headers, or `align` from the number of columns.
    """
    _check_shape(headers, rows)
    numeric = _numeric_columns(rows, len(headers))
    if align is not None:
        if len(align) != len(headers) or set(align) - {"l", "r"}:
            raise ValueError(f"align {align!r}: expected one 'l' or 'r' per column ({len(headers)})")
        numeric = [a == "r" for a in align]
    cells = [[format_cell(v) for v in row] for row in rows]
    if markdown:
        return _render_markdown(list(headers), cells, numeric)
    widths = [max([len(h)] + [len(r[c]) for r in cells]) for c, h in enumerate(headers)]

    def line(texts: Sequence[str]) -> str:
        parts = [t.rjust(w) if num else t.ljust(w) for t, w, num in zip(texts, widths, numeric, strict=True)]
        return _GAP.join(parts).rstrip()

    out = [line(headers), _GAP.join("-" * w for w in widths)]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def _escape_markdown(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _render_markdown(headers: list[str], cells: list[list[str]], numeric: list[bool]) -> str:
    head = [_escape_markdown(h) for h in headers]
    body = [[_escape_markdown(t) for t in r] for r in cells]
    widths = [max([len(h), 3] + [len(r[c]) for r in body]) for c, h in enumerate(head)]

    def line(texts: Sequence[str]) -> str:
        parts = [t.rjust(w) if num else t.ljust(w) for t, w, num in zip(texts, widths, numeric, strict=True)]
        return "| " + " | ".join(parts) + " |"

    sep = ["-" * (w - 1) + ":" if num else "-" * w for w, num in zip(widths, numeric, strict=True)]
    out = [line(head), "| " + " | ".join(sep) + " |"]
    out.extend(line(r) for r in body)
    return "\n".join(out)


def render_key_values(pairs: Sequence[tuple[str, object]]) -> str:
    """Render (key, value) pairs as two aligned columns, 'key   value', one pair per line.

    Continuation lines of a multi-line value are indented under the value column.
    """
    if not pairs:
        return ""
    width = max(len(k) for k, _ in pairs)
    indent = " " * (width + len(_GAP))
    out = []
    for key, value in pairs:
        first, *rest = format_cell(value).split("\n") or [""]
        out.append(f"{key.ljust(width)}{_GAP}{first}".rstrip())
        out.extend(f"{indent}{more}".rstrip() for more in rest)
    return "\n".join(out)
