"""`quantkit eval MODEL [MODEL ...] --data D`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantkit import sources
from quantkit.cli.console import human_bytes, json_to_stdout, out, quiet_libraries, write_json
from quantkit.cli.options import CalibDataOpt, JsonOpt, QuietOpt, ThreadsOpt, TrustRemoteCodeOpt
from quantkit.errors import GateFailedError, UsageError


def evaluate(
    models: Annotated[list[str], typer.Argument(help="Model directories: plain or quantized (detected from config.json / quantkit.json).")],
    data: Annotated[str, typer.Option("--data", help="A .txt/.jsonl/.parquet file or a datasets spec like wikitext:wikitext-2-raw-v1:test.")],
    quantize: Annotated[
        Optional[list[str]], typer.Option("--quantize", "-q", help="Also evaluate each model under this recipe, in memory (repeatable).")
    ] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", min=2, help="Tokens per window.")] = 512,
    stride: Annotated[Optional[int], typer.Option("--stride", min=1, help="Window stride; default: --seq-len (no overlap).")] = None,
    max_samples: Annotated[Optional[int], typer.Option("--max-samples", min=1, help="Evaluate at most this many windows.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Windows per forward pass.")] = 1,
    tokenizer: Annotated[Optional[Path], typer.Option("--tokenizer", help="Tokenizer directory, for models saved without one.")] = None,
    json_path: JsonOpt = None,
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="The model the gate compares against (one of MODEL).")] = None,
    max_ppl_increase: Annotated[
        Optional[float], typer.Option("--max-ppl-increase", min=0, help="Gate: exit 3 if any model's perplexity exceeds the baseline's by more than this percent.")
    ] = None,
    calib_data: CalibDataOpt = None,
    threads: ThreadsOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Perplexity, tokens/s and size on disk of one or more models, side by side.

    Examples:

      quantkit eval ./my-model ./my-model-int4 --data wiki.test.txt

      quantkit eval ./my-model --data test.txt -q int4-weight-only -q int8-weight-only

      quantkit eval ./base ./base-int4 --data test.txt --baseline ./base --max-ppl-increase 5 --json results.json
    """
    for model in models:  # before torch loads: a wrong MODEL is reported at once
        sources.resolve_source(model)
    quiet = quiet or json_to_stdout(json_path)  # stdout holds the JSON alone; the table would follow it
    quiet_libraries()
    from quantkit import evaluate as library
    from quantkit.finalize import CalibrationOptions
    from quantkit.progress import Progress

    if (baseline is None) != (max_ppl_increase is None):
        raise UsageError("--baseline and --max-ppl-increase go together; pass both to gate on accuracy")
    models = list(models) + ([baseline] if baseline and baseline not in models else [])
    reports = library.compare(
        models, data, recipes=quantize or [], seq_len=seq_len, stride=stride, max_samples=max_samples,
        batch_size=batch_size, tokenizer=tokenizer, threads=threads, trust_remote_code=trust_remote_code,
        progress=Progress(enabled=not quiet),
        calibration=CalibrationOptions(data=calib_data) if calib_data else None,
    )
    failures = library.gate(reports, baseline, max_ppl_increase) if baseline else []
    if json_path:
        payload = {"data": data, "results": [r.to_dict() for r in reports], "gate": gate_dict(baseline, max_ppl_increase, failures)}
        write_json(json_path, "eval", payload)
    if not quiet:
        print_table(reports, baseline)
    if failures:
        raise GateFailedError("; ".join(failures))


def gate_dict(baseline: str | None, max_increase: float | None, failures: list[str]) -> dict | None:
    if baseline is None:
        return None
    return {"baseline": baseline, "max_ppl_increase_pct": max_increase, "passed": not failures, "failures": failures}


def print_table(reports, baseline: str | None) -> None:
    from rich.table import Table

    base = next((r for r in reports if r.label == baseline), reports[0])
    table = Table(title="quantkit eval", caption=f"perplexity change is relative to {base.label}")
    for column in ("model", "recipe / format"):
        table.add_column(column, overflow="fold")
    for column in ("size", "perplexity", "change", "tokens/s"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in reports:
        delta = 100 * (r.perplexity.perplexity / base.perplexity.perplexity - 1)
        made = f"{r.recipe} / {r.format}" if r.recipe else (r.format or "-")
        size = human_bytes(r.size_bytes) if r.size_bytes is not None else "in memory"
        change = "baseline" if r is base else f"{delta:+.2f}%"
        table.add_row(r.label, made, size, f"{r.perplexity.perplexity:.3f}", change, f"{r.perplexity.tokens_per_second:,.0f}")
    out.print(table)
