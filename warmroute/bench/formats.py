"""Numbers as the benchmark tables show them; every one writes "-" for an unknown (None) value."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def number(x: float | None, digits: int = 2, unit: str = "") -> str:
    """`x` with thousands separators and `digits` decimals, then `unit` ("1,234.5 req/s")."""
    return "-" if x is None else f"{x:,.{digits}f}{unit}"


def ms(x: float | None, digits: int = 0) -> str:
    """Milliseconds."""
    return number(x, digits, " ms")


def us(x: float | None) -> str:
    """Microseconds, whole."""
    return number(x, 0, " µs")


def pct(x: float | None, digits: int = 1) -> str:
    """A ratio as a percentage."""
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def times(ratio: float | None, mark: str = "×") -> str:
    """A ratio to a reference, to append to a value: " (0.85×)"; "" when there is none."""
    return "" if ratio is None else f" ({ratio:.2f}{mark})"


def markdown_table(header: Sequence[str], align: str, rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table's lines; `align` has one letter per column, l (left) or r (right: numbers)."""
    marks = {"l": "---", "r": "---:"}
    return (["| " + " | ".join(header) + " |", "| " + " | ".join(marks[a] for a in align) + " |"]
            + ["| " + " | ".join(row) + " |" for row in rows])
