"""Plain-text tables for command-line reports."""
from collections.abc import Sequence


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _is_numeric(values: Sequence[object]) -> bool:
    present = [v for v in values if v is not None]
    return bool(present) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in present
    )


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]], sep: str = "  ") -> str:
    """Render *rows* under *headers* with a dashed rule below the header.

    Columns are as wide as their widest entry; columns whose values are
    all numbers are right-aligned, others left-aligned. Floats get two
    decimals and None renders as an empty cell.
    """
    for number, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"row {number} has {len(row)} cells, expected {len(headers)}")
    text = [[_cell(v) for v in row] for row in rows]
    widths = [max((len(r[i]) for r in text), default=0) for i in range(len(headers))]
    right = [_is_numeric([row[i] for row in rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return sep.join(parts).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in text])
