"""Render a ``cells.Table`` as Markdown, LaTeX (booktabs) or CSV."""

from __future__ import annotations

import csv
import io
import re

from analysis.cells import Table

FORMATS = ("md", "latex", "csv")

LATEX_CHARS = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
    "±": r"$\pm$", "—": "---", "↓": r"$\downarrow$", "↑": r"$\uparrow$", "≥": r"$\geq$",
    "×": r"$\times$", "†": r"\textdagger{}", "‡": r"\textdaggerdbl{}", "·": r"$\cdot$",
    "<": r"$<$", ">": r"$>$",
}


def render(table: Table, fmt: str) -> str:
    """The table in ``fmt`` (one of FORMATS), ending with a newline."""
    if fmt == "md":
        return to_markdown(table)
    if fmt == "latex":
        return to_latex(table)
    if fmt == "csv":
        return to_csv(table)
    raise ValueError(f"unknown format {fmt!r} (expected one of {', '.join(FORMATS)})")


def to_markdown(table: Table) -> str:
    """A padded GitHub-flavoured Markdown table, numbers right-aligned, then the notes as a list."""
    headers = [c.header for c in table.columns]
    body = [[cell.text.replace("|", "\\|") for cell in row] for row in table.rows]
    widths = [max(len(h), *(len(r[i]) for r in body), 3) for i, h in enumerate(headers)]
    right = [c.kind != "text" for c in table.columns]

    def line(cells: list[str]) -> str:
        padded = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if r else (":" + "-" * (w + 1))
                          for w, r in zip(widths, right)) + "|"
    lines = [line(headers), rule, *(line(r) for r in body)]
    if table.notes:
        lines.append("")
        lines.extend(f"- {note}" for note in table.notes)
    return "\n".join(lines) + "\n"


def latex_escape(text: str) -> str:
    """Escape LaTeX specials, map the table's Unicode symbols, and `code` -> \\texttt{code}."""
    parts = text.split("`")
    out = []
    for i, part in enumerate(parts):
        escaped = "".join(LATEX_CHARS.get(ch, ch) for ch in part)
        out.append(r"\texttt{" + escaped + "}" if i % 2 and i < len(parts) - 1 else escaped)
    return "".join(out)


def to_latex(table: Table) -> str:
    """A booktabs ``tabular`` (a \\midrule between groups), then the notes in \\footnotesize."""
    spec = "".join("l" if c.kind == "text" else "r" for c in table.columns)
    lines = [rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(latex_escape(c.header) for c in table.columns) + r" \\", r"\midrule"]
    previous = None
    for row in table.rows:
        group = row[table.group_column].text if table.group_column is not None else None
        if previous is not None and group != previous:
            lines.append(r"\midrule")
        previous = group
        lines.append(" & ".join(latex_escape(cell.text) for cell in row) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    if table.notes:
        lines.append(r"\begin{flushleft}\footnotesize")
        lines.append(" \\\\\n".join(latex_escape(n) for n in table.notes))
        lines.append(r"\end{flushleft}")
    return "\n".join(lines) + "\n"


def _csv_number(x: float | None) -> str:
    return "" if x is None else f"{x:.6g}"


def to_csv(table: Table) -> str:
    """CSV with one header row; each stat column becomes three: mean (or marker), std, n.

    Notes are not part of the CSV (the CLI prints them on stderr).
    """
    header: list[str] = []
    for column in table.columns:
        name = re.sub(r"\s*[↓↑]$", "", column.header)
        header += [name, f"{name} std", f"{name} n"] if column.kind == "stat" else [name]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for row in table.rows:
        out: list[str] = []
        for column, cell in zip(table.columns, row):
            if column.kind != "stat":
                out.append(cell.text)
            elif cell.mean is None:
                out += [cell.text, "", ""]
            else:
                out += [_csv_number(cell.mean), _csv_number(cell.std), str(cell.n)]
        writer.writerow(out)
    return buffer.getvalue()
