"""The Markdown tables the benchmark scripts print: a header, an alignment line, a line a row."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(
    head: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None
) -> str:
    """``head`` and one line per row (each cell's ``str``). ``align``: one letter a column, ``l``
    (left) or ``r`` (right); default every column right-aligned (numbers)."""
    align = "r" * len(head) if align is None else align
    if len(align) != len(head) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r}: one 'l' or 'r' for each of the {len(head)} columns")
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "".join("---|" if a == "l" else "---:|" for a in align),
    ]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(head):
            raise ValueError(f"a row of {len(cells)} cells under {len(head)} columns: {cells}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
