"""`quantkit eval MODEL [MODEL ...] --data D [--tasks T1,T2]`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantkit.cli.console import human_bytes, json_to_stdout, out, quiet_libraries, write_json
from quantkit.cli.launch import Launch, relaunch
from quantkit.cli.options import (
    CalibDataOpt, EvalDeviceOpt, JsonOpt, NumSamplesOpt, QuietOpt, TextFieldOpt, ThreadsOpt, TrustRemoteCodeOpt,
)
from quantkit.errors import GateFailedError, UsageError
from quantkit.evaluation import artifacts
from quantkit.evaluation import report as page
from quantkit.evaluation.report import DIVERGENCE_COLUMNS, divergence_caption, divergence_cells
from quantkit.export import reader_for, reader_named, readers
from quantkit.models import sources
from quantkit.runtime import environment as runtime


# The end of `quantkit eval --help` (typer's epilog): lines of at most 78 characters, so 80-column help keeps
# each whole; the recipes and options they name must exist (tests/cli/test_commands_doc.py)
EXAMPLES = """Examples:

quantkit eval ./my-model ./my-model-int4 --data wiki.test.txt

quantkit eval ./my-model --data test.txt -q int4-weight-only -q gptq-w4a16 \\
    --calib-data train.txt

quantkit eval ./base ./base-int4 --data test.txt \\
    --baseline ./base --max-ppl-increase 5 --json results.json

quantkit eval ./base ./base-Q4_0.gguf --data test.txt

quantkit eval ./base ./base-int4 ./base-Q4_0.gguf --data test.txt \\
    --kl-divergence --max-kld 0.05
"""


def evaluate(
    models: Annotated[list[str], typer.Argument(help="Model directories: plain or quantized (detected from config.json / quantkit.json); "
                                                     ".gguf files run in llama.cpp (needs `pip install 'quantkit-llm\\[gguf]'`).")],
    data: Annotated[str, typer.Option("--data", help="A .txt/.jsonl/.parquet file or a datasets spec like wikitext:wikitext-2-raw-v1:test.")],
    text_field: TextFieldOpt = "text",
    quantize: Annotated[
        Optional[list[str]], typer.Option("--quantize", "-q", help="Also evaluate each model under this recipe, in memory (repeatable).")
    ] = None,
    seq_len: Annotated[
        Optional[int], typer.Option("--seq-len", min=2, help="Tokens per window, at most each model's positions (max_position_embeddings); "
                                                             "default: 512, or a model's positions where fewer.", show_default=False)
    ] = None,
    stride: Annotated[Optional[int], typer.Option("--stride", min=1, help="Window stride; default: --seq-len (no overlap).")] = None,
    max_samples: Annotated[Optional[int], typer.Option("--max-samples", min=1, help="Evaluate at most this many windows.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Windows per forward pass.")] = 1,
    tokenizer: Annotated[Optional[Path], typer.Option("--tokenizer", help="Tokenizer directory, for models saved without one.")] = None,
    json_path: JsonOpt = None,
    report: Annotated[
        Optional[Path], typer.Option("--report", metavar="FILE.html", show_default=False,
                                     help="Also write the table as a web page, self-contained; a page `finalize --report` "
                                          "wrote gets it as its Evaluation section (replacing an earlier one).")
    ] = None,
    baseline: Annotated[
        Optional[str], typer.Option("--baseline", help="The model the gate compares against: one of MODEL (the same directory or file, however its path is written).")
    ] = None,
    max_ppl_increase: Annotated[
        Optional[float], typer.Option("--max-ppl-increase", min=0, help="Gate: exit 3 if any model's perplexity exceeds the baseline's by more than this percent.")
    ] = None,
    tasks: Annotated[
        Optional[str], typer.Option("--tasks", help="lm-evaluation-harness tasks, groups or tags, comma-separated (e.g. arc_easy,hellaswag); "
                                                     "needs `pip install 'quantkit-llm\\[tasks]'`.", show_default=False)
    ] = None,
    tasks_dir: Annotated[
        Optional[list[Path]], typer.Option("--tasks-dir", help="A folder of lm-eval task YAML files whose tasks --tasks may name "
                                                               "(local data files work offline; repeatable).", show_default=False)
    ] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Documents per task; default: all.", show_default=False)] = None,
    max_acc_drop: Annotated[
        Optional[float], typer.Option("--max-acc-drop", min=0, help="Gate: exit 3 if any model's score on any --tasks task is more than "
                                                                    "this many points (percentage points) below the baseline's.")
    ] = None,
    kl_divergence: Annotated[
        bool, typer.Option("--kl-divergence", help="Also compare each model's next-token distributions with the first MODEL's on the "
                                                   "perplexity's tokens: KL divergence (mean, median, 99th percentile), top-1 agreement "
                                                   "and perplexity ratio. The first MODEL's logits are kept in TMPDIR meanwhile "
                                                   "(4 bytes x tokens x vocabulary; --max-samples bounds it).")
    ] = False,
    max_kld: Annotated[
        Optional[float], typer.Option("--max-kld", min=0, help="Gate: exit 3 if any model's mean KL divergence from the first MODEL "
                                                               "(nats per token) is over this; needs --kl-divergence.", show_default=False)
    ] = None,
    calib_data: CalibDataOpt = None,
    num_samples: NumSamplesOpt = None,
    calib_seq_len: Annotated[
        Optional[int], typer.Option("--calib-seq-len", min=2, help="Tokens per calibration sample (finalize's --seq-len); "
                                                                   "default: the recipe's.", show_default=False)
    ] = None,
    tp: Annotated[
        int, typer.Option("--tp", min=1, help="Shard each model over N processes (tensor parallel, transformers' tp_plan): "
                                              "one per GPU on CUDA, else N CPU processes; launches torchrun itself.")
    ] = 1,
    device: EvalDeviceOpt = "auto",
    threads: ThreadsOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Perplexity, tokens/s and size on disk of one or more models, side by side."""
    for model in models:  # before torch loads: a wrong MODEL is reported at once (a one-file artifact by its engine)
        if not reader_for(model).single_file:
            sources.resolve_source(model)
    check_gate_options(baseline, max_ppl_increase, max_acc_drop, tasks, max_kld)
    if report is not None:
        page.check_path(report)
    if max_kld is not None and not kl_divergence:
        raise UsageError("--max-kld gates the KL divergence from the first MODEL; pass --kl-divergence too")
    baseline = baseline_model(models, baseline) if baseline else None
    artifacts.check_engines(models, tp, max_acc_drop, device)
    main = runtime.is_main_process()
    quiet = quiet or not main or json_to_stdout(json_path)  # stdout holds the JSON alone; the table would follow it
    quiet_libraries()
    if tasks is None and (tasks_dir or limit is not None):
        raise UsageError("--tasks-dir and --limit apply to --tasks; pass --tasks NAMES too")
    if tp > 1:
        check_tensor_parallel(models, tp, quantize, tasks, trust_remote_code, seq_len)
        if not runtime.under_torchrun():
            device = tensor_parallel_device(device, tp)
        code = relaunch(Launch(nproc_per_node=tp), threads, explained=(GateFailedError.exit_code,))
        if code is not None:
            raise typer.Exit(code)
        threads = threads or runtime.launched_threads()
    from quantkit.evaluation import evaluate as library
    from quantkit.evaluation.tasks import TaskOptions, parse_names
    from quantkit.finalization.finalize import CalibrationOptions
    from quantkit.runtime import hardware
    from quantkit.runtime.progress import Progress

    task_options = None
    if tasks is not None:
        task_options = TaskOptions(parse_names(tasks), tuple(tasks_dir or ()), limit, trust_remote_code=trust_remote_code)
    device = hardware.eval_device(device) if tp == 1 else device
    calibrated = any(x is not None for x in (calib_data, num_samples, calib_seq_len))
    calibration = CalibrationOptions(data=calib_data, num_samples=num_samples, seq_len=calib_seq_len, device=device,
                                     text_field=text_field, seq_len_flag="--calib-seq-len") if calibrated else None
    reports = library.compare(
        models, data, recipes=quantize or [], seq_len=seq_len, stride=stride, max_samples=max_samples,
        batch_size=batch_size, tokenizer=tokenizer, threads=threads, trust_remote_code=trust_remote_code,
        text_field=text_field, progress=Progress(enabled=not quiet), calibration=calibration, tasks=task_options,
        tensor_parallel=tp, device=device, kl_divergence=kl_divergence,
    )
    if not main:  # every rank measured the same numbers; rank 0 reports them
        return
    gated = baseline is not None or max_kld is not None
    failures = library.gate(reports, baseline, max_ppl_increase, max_acc_drop, max_kld) if gated else []
    if json_path:
        gate = gate_dict(baseline, max_ppl_increase, max_acc_drop, failures, max_kld)
        write_json(json_path, "eval", {"data": data, "device": device, "results": [r.to_dict() for r in reports], "gate": gate})
    written = None
    if report is not None:
        written = "the Evaluation section of its budget page" if page.write(report, reports, baseline, data) else "a page"
    if not quiet:
        print_table(reports, baseline)
        if written:
            out.print(f"report: {report} ({written})", highlight=False, soft_wrap=True)
    if failures:
        raise GateFailedError("; ".join(failures))


def check_tensor_parallel(models: list[str], tp: int, quantize: list[str] | None, tasks: str | None,
                          trust_remote_code: bool, seq_len: int | None = None) -> None:
    """What `--tp` cannot combine with, models transformers cannot shard over `tp` ranks, and a --seq-len beyond a
    model's positions: refused before anything is launched (not once by every rank)."""
    from quantkit.evaluation import tensor_parallel
    tensor_parallel.check_options(quantize, tasks)
    for model in models:
        tensor_parallel.check(sources.resolve_source(model), tp, trust_remote_code)
    if seq_len is not None:
        from quantkit.evaluation.evaluate import check_seq_len
        check_seq_len(models, seq_len, trust_remote_code)


def tensor_parallel_device(device: str, tp: int) -> str:
    """`--tp N` runs one rank per GPU where there are GPUs (transformers places the shards); `--device cpu` keeps
    the ranks off them. Checked before anything is launched."""
    from quantkit.runtime import hardware
    if device == "cpu":
        runtime.hide_gpus()  # the ranks see no GPU: transformers shards over CPU processes (gloo)
        return device
    hardware.check_ranks(None if device == "auto" else device, tp)
    return device


def check_gate_options(baseline: str | None, max_ppl_increase: float | None, max_acc_drop: float | None, tasks: str | None,
                       max_kld: float | None = None) -> None:
    limits = (max_ppl_increase, max_acc_drop)
    if baseline is None and any(x is not None for x in limits):
        raise UsageError("--max-ppl-increase and --max-acc-drop compare against --baseline MODEL; pass it too")
    if baseline is not None and all(x is None for x in limits):
        kld = " (--max-kld needs no --baseline: it compares with the first MODEL)" if max_kld is not None else ""
        raise UsageError(f"--baseline needs a limit to gate on: --max-ppl-increase PCT and/or --max-acc-drop POINTS{kld}")
    if max_acc_drop is not None and tasks is None:
        raise UsageError("--max-acc-drop gates the scores of --tasks; pass --tasks NAMES too")


def baseline_model(models: list[str], baseline: str) -> str:
    """The MODEL that --baseline names: the same path however spelled (./run/final/ is run/final), else the same
    hub id (or text)."""
    for model in models:
        if model == baseline or same_path(model, baseline):
            return model
    raise UsageError(f"--baseline {baseline} is not one of the models; pass it as a MODEL too")


def same_path(a: str, b: str) -> bool:
    return Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve()


def gate_dict(baseline: str | None, max_increase: float | None, max_drop: float | None, failures: list[str],
              max_kld: float | None = None) -> dict | None:
    if baseline is None and max_kld is None:
        return None
    return {"baseline": baseline, "max_ppl_increase_pct": max_increase, "max_acc_drop_points": max_drop,
            "max_kld": max_kld, "passed": not failures, "failures": failures}


def print_table(reports, baseline: str | None) -> None:
    """One line per model under a short name (its directory's, or M1..Mn when two collide or the table would not
    fit the terminal), then a legend with each name's full path and how the model was made. --kl-divergence's
    columns are the table's last, or a table of their own under it where the terminal cannot hold them all."""
    from rich.text import Text

    base = next((r for r in reports if r.label == baseline), reports[0])
    short, numbered = [short_name(r) for r in reports], [f"M{i}" for i in range(1, len(reports) + 1)]
    divergence = any(r.kl_divergence for r in reports)
    layouts = [(names, beside) for names in ([short, numbered] if len(set(short)) == len(short) else [numbered])
               for beside in ((True, False) if divergence else (False,))]  # the first that fits, else the last
    names, beside = next((layout for layout in layouts if not too_wide(results_table(reports, base, *layout))), layouts[-1])
    out.print(results_table(reports, base, names, beside))
    if divergence and not beside:
        out.print(divergence_table(reports, names))
    for name, r in zip(names, reports):
        note = window_note(r, base)
        if note:
            out.print(Text(f"* {name}: {note}"))
    entries = [(name, origin(r)) for name, r in zip(names, reports)]
    if any(name != text for name, text in entries):  # `quantkit eval m` needs no "m  m" under its table
        out.print(legend(entries))


def too_wide(table) -> bool:
    return out.measure(table, options=out.options.update_width(10_000)).maximum > out.width


def results_table(reports, base, names: list[str], divergence: bool = False):
    from rich.table import Table
    from rich.text import Text

    from quantkit.evaluation.evaluate import other_windows

    tasks = list(base.tasks)
    metrics = sorted({score.metric for score in base.tasks.values()})
    scores = f"; task scores: {', '.join(metrics)} in %" if tasks else ""
    formats = "".join(f"; {note}" for note in format_notes(reports, bool(tasks)))
    table = Table(title="quantkit eval", caption=f"perplexity change is relative to {names[reports.index(base)]}{scores}{formats}")
    sharded = max(r.tensor_parallel for r in reports) > 1
    if sharded:
        table.caption += f"; each model sharded over {reports[0].tensor_parallel} processes (tensor parallel)"
    if divergence:
        table.caption += f"; {divergence_caption(names[0])}"
    table.add_column("model", no_wrap=True)
    for column in (("size", "perplexity", "change", "tokens/s") + (("weights / rank", "peak RSS / rank") if sharded else ())
                   + (DIVERGENCE_COLUMNS if divergence else ())):
        table.add_column(column, justify="right", no_wrap=True)
    for task in tasks:  # a long task name folds in the header; the scores themselves stay on one line
        table.add_column(task, justify="right", overflow="fold")
    for name, r in zip(names, reports):
        delta = 100 * (r.perplexity.perplexity / base.perplexity.perplexity - 1)
        size = human_bytes(r.size_bytes) if r.size_bytes is not None else "in memory"
        change = "baseline" if r is base else "n/a" if other_windows(r, base) else f"{delta:+.2f}%"
        scored = "n/a" if r.runtime != "transformers" else "-"  # lm-eval scores transformers models only
        task_cells = [f"{100 * r.tasks[t].value:.1f}" if t in r.tasks else scored for t in tasks]
        memory = (human_bytes(max(r.weight_bytes_per_rank)), human_bytes(max(r.peak_rss_per_rank))) if sharded else ()
        marker = "*" if window_note(r, base) else ""
        kld = divergence_cells(r.kl_divergence) if divergence else ()
        table.add_row(Text(name), size, f"{r.perplexity.perplexity:.3f}{marker}", change, f"{r.perplexity.tokens_per_second:,.0f}",
                      *memory, *kld, *task_cells)
    return table


def divergence_table(reports, names: list[str]):
    """--kl-divergence's columns alone, for a terminal too narrow to hold them beside the others."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title="KL divergence", caption=divergence_caption(names[0]))
    table.add_column("model", no_wrap=True)
    for column in DIVERGENCE_COLUMNS:
        table.add_column(column, justify="right", no_wrap=True)
    for name, r in zip(names, reports):
        table.add_row(Text(name), *divergence_cells(r.kl_divergence))
    return table


def format_notes(reports, tasks: bool) -> list[str]:
    """What each format's reader says of its rows under the table (how they computed, where they ran: `legend`), in
    the registry's order."""
    runtimes: dict = {}
    for r in reports:
        runtimes.setdefault(reader_named(r.format), set()).add(r.runtime)
    notes = [reader.legend(sorted(runtimes[reader]), tasks) for reader in readers() if reader in runtimes]
    return [note for note in notes if note]


def window_note(report, base) -> str | None:
    """What the table says under it about the tokens a model was scored on: how few, where the data is shorter than
    one window; a .gguf's tokenization where it is not simply the Hugging Face rows'; and any model scored on other
    windows than the baseline (its change is n/a)."""
    from quantkit.evaluation.evaluate import other_windows

    notes = [report.tokens_note] if report.tokens_note else []
    if other_windows(report, base):
        notes.append(f"its perplexity does not compare with {base.label}'s" if notes else
                     f"scored on other tokens than {base.label} (another tokenizer, or a shorter context): its perplexity does not compare")
    few = few_tokens_note(report.perplexity)
    return "; ".join(([few] if few else []) + notes) or None


def few_tokens_note(result) -> str | None:
    """Where the data is shorter than one window (`result.seq_len`): how many tokens the perplexity is of."""
    if result.tokens >= result.seq_len - 1:
        return None
    tokens = "1 token" if result.tokens == 1 else f"{result.tokens} tokens"
    return (f"scored on {tokens} only, as the data is shorter than one {result.seq_len}-token window: "
            "a perplexity of so few tokens says little; pass more text")


def origin(report) -> str:
    """The model as given (a path, a hub id, PATH+RECIPE for a preview) and how it was made."""
    made = f"{report.recipe} / {report.format}" if report.recipe else (report.format or "")
    return f"{report.label} ({made})" if made else report.label


def legend(entries: list[tuple[str, str]]):
    """Short names and their origins; a long path folds under its own column."""
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    for name, text in entries:
        grid.add_row(Text(name), Text(text))
    return grid


def short_name(report) -> str:
    """The model directory's (or hub id's) last part (a training run's OUTPUT_DIR/final: OUTPUT_DIR's); an
    in-memory preview keeps its +RECIPE."""
    preview = report.size_bytes is None and report.recipe and report.label.endswith(f"+{report.recipe}")
    source = report.label.removesuffix(f"+{report.recipe}") if preview else report.label
    path = Path(source)
    name = (path.parent.name if path.name == "final" and path.parent.name else path.name) or source
    return f"{name}+{report.recipe}" if preview else name
