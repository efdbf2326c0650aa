"""`finalize --target-bpw ... --report FILE.html`: the budget plan as one self-contained page (inline SVG and CSS,
no script, nothing fetched): a heat map of each tensor's estimated error in each candidate type (log scale, darker
is worse) with the chosen type outlined, the budget line (the plan's bits per weight against the target, and each
candidate's share of the tensors), and the table of tensors with their types, sizes and errors.
`eval --report` adds its results table to the page (`evaluation/report.py`), which it knows by its generator."""

from __future__ import annotations

import math
from html import escape

from quantkit.quant import gguf_types

CELL_W, CELL_H, LABEL_W, TOP = 64, 16, 260, 40
GENERATOR = "quantkit budget report"  # the page's <meta name="generator">: how `eval --report` knows it
STYLE = ("<style>body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;font-size:13px}"
         "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}td:first-child{text-align:left}</style>")


def render(plan, title: str = "quantkit budget plan") -> str:
    """The page of a `planner.BudgetPlan`."""
    errors = plan.measured.errors
    names = list(plan.types)
    kinds = sorted({t for by_type in errors.values() for t in by_type}, key=gguf_types.bits_per_weight)
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f'<meta name="generator" content="{GENERATOR}">',
        f"<title>{escape(title)}</title>", STYLE, "</head><body>", f"<h1>{escape(title)}</h1>",
        f"<p>{plan.bits_per_weight:.3f} bits per weight planned for a target of {plan.target_bpw:.4g} "
        f"({plan.tensor_bytes:,} bytes of tensors, {plan.parameters:,} parameters); estimated KL divergence "
        f"{plan.estimated_kl:.4g} nats per token; sensitivity measured on {plan.measured.tokens:,} tokens.</p>",
        _budget_line(plan), "<h2>Estimated error per tensor and type</h2>",
        "<p>Each cell: the KL divergence the tensor is estimated to add in that type (log scale, darker is more); "
        "the outlined cell is the type chosen.</p>", _heat_map(names, kinds, errors, plan.types),
        "<h2>Tensors</h2>", _table(names, errors, plan.types), "</body></html>", ""])


def _budget_line(plan) -> str:
    width = 640
    scale = width / max(plan.target_bpw, plan.bits_per_weight) / 1.1
    target_x, planned_x = plan.target_bpw * scale, plan.bits_per_weight * scale
    return (f'<svg id="budget" xmlns="http://www.w3.org/2000/svg" width="{width + 20}" height="50" role="img" '
            f'aria-label="bits per weight against the target">'
            f'<rect x="0" y="10" width="{planned_x:.1f}" height="20" fill="#4a7fb5"/>'
            f'<line x1="{target_x:.1f}" y1="2" x2="{target_x:.1f}" y2="38" stroke="#c0392b" stroke-width="3"/>'
            f'<text x="4" y="46" font-size="11">planned {plan.bits_per_weight:.3f} bpw; target (red) '
            f'{plan.target_bpw:.4g}</text></svg>')


def _heat_map(names: list[str], kinds: list[str], errors: dict, chosen: dict) -> str:
    values = [e for by_type in errors.values() for e in by_type.values() if e > 0]
    low, high = (math.log10(min(values)), math.log10(max(values))) if values else (0.0, 1.0)
    width, height = LABEL_W + CELL_W * len(kinds) + 10, TOP + CELL_H * len(names) + 10
    parts = [f'<svg id="heatmap" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="11" '
             'role="img" aria-label="estimated error per tensor and type">']
    for j, kind in enumerate(kinds):
        parts.append(f'<text x="{LABEL_W + CELL_W * j + CELL_W / 2}" y="{TOP - 8}" text-anchor="middle">{kind}</text>')
    for i, name in enumerate(names):
        y = TOP + CELL_H * i
        parts.append(f'<text x="{LABEL_W - 6}" y="{y + CELL_H - 4}" text-anchor="end">{escape(name)}</text>')
        for j, kind in enumerate(kinds):
            error = errors[name].get(kind)
            if error is None:
                continue
            share = 0.0 if error <= 0 or high == low else (math.log10(error) - low) / (high - low)
            shade = int(245 - 200 * min(1.0, max(0.0, share)))
            stroke = ' stroke="black" stroke-width="2.5"' if chosen[name] == kind else ' stroke="white"'
            parts.append(f'<rect x="{LABEL_W + CELL_W * j}" y="{y}" width="{CELL_W}" height="{CELL_H}" '
                         f'fill="rgb({shade},{shade},255)"{stroke}><title>{escape(name)} {kind}: {error:.3g}</title></rect>')
    return "\n".join(parts + ["</svg>"])


def _table(names: list[str], errors: dict, chosen: dict) -> str:
    rows = ["<table><tr><th>tensor</th><th>type</th><th>bits per weight</th><th>estimated error</th></tr>"]
    for name in names:
        kind = chosen[name]
        rows.append(f"<tr><td>{escape(name)}</td><td>{kind}</td><td>{gguf_types.bits_per_weight(kind):.4g}</td>"
                    f"<td>{errors[name][kind]:.3g}</td></tr>")
    return "\n".join(rows + ["</table>"])
