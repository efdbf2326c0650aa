"""`quantkit finalize SRC DST --quantize R`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantkit import registry, runtime, sources
from quantkit.cli.console import human_bytes, json_to_stdout, out, quiet_libraries, write_json
from quantkit.export import atomic
from quantkit.cli.options import (
    CalibDataOpt,
    DeviceOpt,
    JsonOpt,
    NprocOpt,
    DtypeChoice,
    DtypeOpt,
    FormatOpt,
    ModelDirArg,
    NumSamplesOpt,
    QuantizeOpt,
    QuietOpt,
    RevisionOpt,
    SeqLenOpt,
    ThreadsOpt,
    TrustRemoteCodeOpt,
)


def finalize(
    src: ModelDirArg,
    dst: Annotated[Path, typer.Argument(help="Output directory (written atomically; refused if it exists).")],
    quantize: QuantizeOpt,
    format: FormatOpt = None,
    calib_data: CalibDataOpt = None,
    num_samples: NumSamplesOpt = None,
    seq_len: SeqLenOpt = None,
    device: DeviceOpt = "cpu",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace DST if it exists.")] = False,
    dtype: DtypeOpt = DtypeChoice.auto,
    threads: ThreadsOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    nproc_per_node: NprocOpt = 1,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan (samples per rank, module owners, memory per rank) and exit.")
    ] = False,
    revision: RevisionOpt = None,
    max_shard_size: Annotated[
        Optional[str], typer.Option("--max-shard-size", help="Largest safetensors file, e.g. 5GB or 500MB; several files get an index. Default: transformers' (50GB).", show_default=False)
    ] = None,
    force_recipe: Annotated[
        bool, typer.Option("--force-recipe", help="Quantize a QAT-trained model under a recipe other than its own.")
    ] = False,
    json_path: JsonOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Quantize a model into a low-bit artifact that plain transformers (and vLLM) load: post-training
    quantization of a plain model, or the convert step of a QAT-trained one (same recipes).

    Examples:

      quantkit finalize ./my-model ./my-model-int4 --quantize int4-weight-only

      quantkit finalize Qwen/Qwen3-0.6B ./qwen3-int4 -q int4-weight-only     (a hub id, from the HF cache)

      quantkit finalize ./my-model ./my-model-fp8 -q float8-dynamic-act-float8-weight --format compressed-tensors

      quantkit finalize ./my-model ./out -q ./my-recipe.yaml --overwrite

      quantkit finalize ./my-model ./out -q int4-weight-only --max-shard-size 5GB

      quantkit finalize ./my-model ./my-model-gptq -q gptq-w4a16 --calib-data train.txt --num-samples 128 --seq-len 512
    """
    recipe = registry.resolve(quantize)
    fmt = registry.Format(format.value) if format else None
    src = sources.resolve_source(src, revision)  # before torch loads: a wrong SRC or DST is reported at once
    if not dry_run:
        atomic.check_destination(dst, overwrite)
    quiet_libraries()
    from quantkit import finalize as library
    from quantkit.finalize import CalibrationOptions
    from quantkit.progress import Progress

    options = CalibrationOptions(data=calib_data, num_samples=num_samples, seq_len=seq_len, device=device)
    if dry_run:
        plan = library.dry_run(src, recipe, fmt, options, nproc_per_node, trust_remote_code, revision)
        if json_path:
            write_json(json_path, "finalize --dry-run", plan)
        else:
            out.print_json(data=plan)
        return
    from quantkit.cli.launch import relaunch

    code = relaunch(nproc_per_node, threads)
    if code is not None:
        raise typer.Exit(code)
    main = runtime.is_main_process()
    quiet = quiet or not main or json_to_stdout(json_path)
    threads = threads or runtime.launched_threads()
    result = library.finalize(
        src, dst, recipe, fmt, overwrite=overwrite, dtype=dtype.value, threads=threads,
        trust_remote_code=trust_remote_code, force_recipe=force_recipe, progress=Progress(enabled=not quiet),
        calibration=options, revision=revision, max_shard_size=max_shard_size,
    )
    if not quiet:
        print_summary(result)
    if json_path and main:
        write_json(json_path, "finalize", result_dict(result))


def result_dict(result) -> dict:
    """The `finalize` JSON document (schema in the README): what was written, how big, how long, and how it went."""
    left_out = [{"module": e.name, "reason": e.note} for e in result.plan if not e.quantized]
    return {
        "dst": str(result.dst), "recipe": result.recipe.name, "format": result.format.value,
        "modules": {"quantized": sum(e.quantized for e in result.plan), "linear": len(result.plan), "left_out": left_out},
        "source_bytes": result.source_bytes, "output_bytes": result.output_bytes, "seconds": round(result.seconds, 3),
        "threads": result.threads, "calibration": result.calibration, "coverage": result.coverage,
    }


def group_by_note(entries) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for entry in entries:
        grouped.setdefault(entry.note, []).append(entry.name)
    return grouped


def coverage_line(coverage: dict) -> str:
    """`plan.coverage` in one line: "97.1% of Linear parameters, 74.0% of all; left in full precision: 1 x <reason>; ..."."""
    share = coverage["quantized_parameters"] / max(1, coverage["linear_parameters"])
    overall = coverage["quantized_parameters"] / max(1, coverage["all_parameters"])
    reasons: dict[str, int] = {}
    for tensor in coverage["full_precision"]:
        reasons[tensor["reason"]] = reasons.get(tensor["reason"], 0) + 1
    kept = "; ".join(f"{count} x {reason}" for reason, count in reasons.items())
    return f"{share:.1%} of Linear parameters, {overall:.1%} of all; left in full precision: {kept or 'nothing'}"


def print_summary(result) -> None:
    from rich.table import Table

    quantized = [e for e in result.plan if e.quantized]
    changed = [e for e in quantized if e.note]
    left_out = [e for e in result.plan if not e.quantized]
    table = Table(title=f"{result.recipe.name} -> {result.dst} ({result.format.value})", show_header=False)
    table.add_row("modules quantized", f"{len(quantized)} of {len(result.plan)} Linear (full list in quantkit.json)")
    for label, entries in (("  group size changed", changed), ("  left in full precision", left_out)):
        for note, names in group_by_note(entries).items():
            table.add_row(label, f"{note}: {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else ""))
    if result.coverage:
        table.add_row("parameters quantized", coverage_line(result.coverage))
    ratio = result.source_bytes / max(1, result.output_bytes)
    table.add_row("weights on disk", f"{human_bytes(result.source_bytes)} -> {human_bytes(result.output_bytes)} ({ratio:.2f}x smaller)")
    if result.calibration:
        calib = result.calibration
        error = calib["relative_error"]
        worst = max(error["per_module"], key=error["per_module"].get)
        table.add_row("calibration", f"{calib['num_samples']} x {calib['seq_len']} tokens on {calib['device']}, {calib['ranks']} rank(s)")
        table.add_row("  relative error", f"mean {error['mean']:.4f}, worst {error['max']:.4f} ({worst})")
        phases = ", ".join(f"{phase} {sec:.1f} s" for phase, sec in calib["seconds"].items())
        table.add_row("  time per phase", phases)
        for what, why in (calib.get("skipped") or {}).items():
            table.add_row("  not applied", f"{what} ({why})")
        if calib.get("owners"):
            table.add_row("  GPTQ modules per rank", " / ".join(map(str, calib["owners"]["modules_per_rank"])))
    table.add_row("time", f"{result.seconds:.1f} s on {result.threads} threads")
    out.print(table)
