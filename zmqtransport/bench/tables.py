"""Plain-text tables of the benchmark's reports: first column left-aligned, the others right, a rule under the head."""

from __future__ import annotations


def table(rows: list[list[str]]) -> list[str]:
    """``rows`` (the first is the head) as lines of aligned columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for number, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
        if number == 0:
            lines.append("  ".join("-" * width for width in widths))
    return lines
