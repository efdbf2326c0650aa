"""`eval --report FILE.html`: eval's results as HTML, the terminal table's columns made from the `ModelReport`s
`compare` returned (nothing measured again), every string escaped, no script and nothing fetched. A page
`finalize --report` wrote (`budget/report.py`) gets them as its Evaluation section (`<section id="eval">`, before
`</body>`), in place of the one an earlier eval put there; any other FILE becomes a page holding the table alone.
Written all at once (`export.atomic.write_text`). Torch-free at import: the CLI checks FILE before torch loads."""

from __future__ import annotations

import re
from html import escape
from pathlib import Path

from quantkit.budget.report import GENERATOR as BUDGET_GENERATOR
from quantkit.budget.report import STYLE
from quantkit.errors import UsageError
from quantkit.export.atomic import write_text

GENERATOR = "quantkit eval report"
SECTION = re.compile(r'<section id="eval">.*?</section>\n?', re.DOTALL)  # its text escaped: no </section> inside
DIVERGENCE_COLUMNS = ("KLD mean", "KLD median", "KLD p99", "top-1", "ppl ratio")


def check_path(path: Path) -> None:
    """FILE.html names a web page in a directory that exists: refused at once, before any model loads."""
    if path.is_dir():
        raise UsageError(f"--report {path} is a directory; give a file, e.g. {path / 'eval.html'}")
    if path.suffix not in (".html", ".htm"):
        raise UsageError(f"--report {path}: the report is a web page, named .html, e.g. eval.html")
    if not path.parent.is_dir():
        raise UsageError(f"--report {path}: {path.parent} does not exist; create it or give another path")


def write(path: Path, reports: list, baseline: str | None = None, data: str | None = None) -> bool:
    """The results into `path`: as the Evaluation section of the budget page there (True), else as a page of
    their own (False), replacing whatever `path` held."""
    page, found = _read(path), section(reports, baseline, data)
    joined = page is not None and is_budget_page(page)
    write_text(path, with_section(page, found) if joined else standalone(found))
    return joined


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):  # absent, or not a page quantkit wrote: replaced
        return None


def is_budget_page(page: str) -> bool:
    """A page `finalize --report` wrote: its generator, or (a page from before it had one) its two charts; with a
    body to add to."""
    marked = f'<meta name="generator" content="{BUDGET_GENERATOR}">' in page
    charts = page.startswith("<!DOCTYPE html>") and '<svg id="budget"' in page and '<svg id="heatmap"' in page
    return (marked or charts) and "</body>" in page


def with_section(page: str, found: str) -> str:
    """The budget `page` with `found` as its one Evaluation section, at the end of its body."""
    page = SECTION.sub("", page)
    end = page.rindex("</body>")
    return f"{page[:end]}{found}\n{page[end:]}"


def standalone(found: str, title: str = "quantkit eval") -> str:
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f'<meta name="generator" content="{GENERATOR}">',
        f"<title>{escape(title)}</title>", STYLE, "</head><body>", f"<h1>{escape(title)}</h1>", found, "</body></html>", ""])


def section(reports: list, baseline: str | None = None, data: str | None = None) -> str:
    """The table (one row per report, the change relative to `baseline`'s, else the first's), its caption and
    the notes on models scored on other tokens, as `<section id="eval">`."""
    from quantkit.evaluation.evaluate import other_windows

    base = next((r for r in reports if r.label == baseline), reports[0])
    tasks, sharded = list(base.tasks), max(r.tensor_parallel for r in reports) > 1
    divergence = any(r.kl_divergence for r in reports)
    columns = (["model", "size", "perplexity", "change", "tokens/s"] + (["weights / rank", "peak RSS / rank"] if sharded else [])
               + (list(DIVERGENCE_COLUMNS) if divergence else []) + tasks)
    rows, notes = ["<tr>" + "".join(f"<th>{escape(c)}</th>" for c in columns) + "</tr>"], []
    for r in reports:
        other = other_windows(r, base)
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in _cells(r, base, other, tasks, sharded, divergence)) + "</tr>")
        notes += [f"<li>{escape(r.label)}: {escape(note)}</li>" for note in _notes(r, base, other)]
    return "\n".join(['<section id="eval">', "<h2>Evaluation</h2>",
                      f"<p>{escape(_caption(reports, base, data, sharded, divergence))}</p>", "<table>", *rows, "</table>",
                      *(["<ul>", *notes, "</ul>"] if notes else []), "</section>"])


def _cells(r, base, other: bool, tasks: list[str], sharded: bool, divergence: bool) -> list[str]:
    """A row's cells, escaped: the terminal's values, the model by its full label and how it was made; `other`:
    scored on other tokens than `base` (no change to show)."""
    made = f"{r.recipe} / {r.format}" if r.recipe else (r.format or "")
    model = escape(r.label) + (f"<br><small>{escape(made)}</small>" if made else "")
    delta = 100 * (r.perplexity.perplexity / base.perplexity.perplexity - 1)
    change = "baseline" if r is base else "n/a" if other else f"{delta:+.2f}%"
    scored = "n/a" if r.runtime != "transformers" else "-"  # lm-eval scores transformers models only
    memory = (_size(max(r.weight_bytes_per_rank)), _size(max(r.peak_rss_per_rank))) if sharded else ()
    values = (_size(r.size_bytes), f"{r.perplexity.perplexity:.3f}", change, f"{r.perplexity.tokens_per_second:,.0f}", *memory,
              *(divergence_cells(r.kl_divergence) if divergence else ()),
              *(f"{100 * r.tasks[t].value:.1f}" if t in r.tasks else scored for t in tasks))
    return [model] + [escape(v) for v in values]


def divergence_cells(found) -> tuple[str, ...]:
    """A row's --kl-divergence columns (the terminal's and the page's); the reference's (no divergence of its
    own) says so in the first."""
    if found is None:
        return ("reference",) + ("",) * (len(DIVERGENCE_COLUMNS) - 1)
    return (f"{found.mean:.4g}", f"{found.median:.4g}", f"{found.p99:.4g}", f"{100 * found.top1_agreement:.2f}%",
            f"{found.perplexity_ratio:.4f}")


def divergence_caption(reference: str) -> str:
    return f"KL divergence (nats per token), top-1 agreement and perplexity ratio are relative to {reference}"


def _caption(reports: list, base, data: str | None, sharded: bool, divergence: bool) -> str:
    metrics = sorted({score.metric for score in base.tasks.values()})
    parts = [f"Perplexity on {data}" if data else "Perplexity", f"change relative to {base.label}"]
    parts += [f"task scores: {', '.join(metrics)} in %"] if metrics else []
    parts += [f"each model sharded over {reports[0].tensor_parallel} processes (tensor parallel)"] if sharded else []
    parts += [divergence_caption(reports[0].label)] if divergence else []
    return "; ".join(parts)


def _notes(r, base, other: bool) -> list[str]:
    notes = [r.tokens_note] if r.tokens_note else []
    return notes + ([f"scored on other tokens than {base.label}: its perplexity does not compare"] if other else [])


def _size(size: int | None) -> str:
    if size is None:
        return "in memory"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):  # the terminal's human_bytes
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size} B"
