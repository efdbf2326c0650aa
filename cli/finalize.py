"""`quantkit finalize SRC DST --quantize R`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantkit.cli.console import human_bytes, json_to_stdout, out, quiet_libraries, write_json
from quantkit.cli import budget
from quantkit.cli.launch import Launch, relaunch
from quantkit.errors import UsageError
from quantkit.export import atomic
from quantkit.finalization.request import Request, check_request
from quantkit.models import sources
from quantkit.quant import registry
from quantkit.runtime import hardware
from quantkit.runtime import environment as runtime
from quantkit.cli.options import (
    CalibDataOpt,
    DeviceOpt,
    JsonOpt,
    NprocOpt,
    DtypeChoice,
    DtypeOpt,
    FormatOpt,
    ModelDirArg,
    NnodesOpt,
    NodeRankOpt,
    NumSamplesOpt,
    TextFieldOpt,
    QuietOpt,
    RdzvBackend,
    RdzvBackendOpt,
    RdzvEndpointOpt,
    RevisionOpt,
    SeqLenOpt,
    ThreadsOpt,
    TrustRemoteCodeOpt,
)


# The end of `quantkit finalize --help` (typer's epilog): lines of at most 78 characters, so 80-column help keeps
# each whole; the recipes and options they name must exist (tests/cli/test_commands_doc.py)
EXAMPLES = """Examples:

quantkit finalize ./my-model ./my-model-int4 -q int4-weight-only

quantkit finalize ./my-model ./my-model-w4a16 -q gptq-w4a16 \\
    --calib-data train.txt --device cuda

quantkit finalize Qwen/Qwen3-0.6B ./qwen3-fp8 -q fp8-block
"""


def finalize(
    src: ModelDirArg,
    dst: Annotated[Path, typer.Argument(help="Output directory (written atomically; refused if it exists).")],
    quantize: Annotated[
        Optional[str], typer.Option("--quantize", "-q", show_default=False,
                                    help="Recipe name (see `quantkit recipes list`) or a path to a recipe .yaml file. "
                                         "With --target-bpw: the algorithm and calibration of the plan (default gguf-q4-k-m's).")
    ] = None,
    format: FormatOpt = None,
    calib_data: CalibDataOpt = None,
    text_field: TextFieldOpt = "text",
    kv_cache: Annotated[
        Optional[str], typer.Option("--kv-cache", metavar="fp8|fp8-head|none", show_default=False,
                                    help="Quantize the KV cache too (vLLM's FP8 cache): key and value scales measured on --calib-data, "
                                         "per tensor (fp8) or per key/value head (fp8-head); none drops a recipe's.")
    ] = None,
    tensor_type: Annotated[
        Optional[list[str]], typer.Option("--tensor-type", metavar="REGEX=TYPE", show_default=False,
                                          help="Give the tensors whose quantkit or GGUF name REGEX matches (ffn_down, "
                                               "blk\\.0\\.attn_v) type TYPE: a GGML type in GGUF (q6_k, q8_0, ...), a recipe's "
                                               "scheme in compressed-tensors (gptq-w8a16) or MLX (mlx-8bit-g64), or float. Repeatable; the last match "
                                               "wins, after the recipe's own.")
    ] = None,
    target_bpw: Annotated[
        Optional[float], typer.Option("--target-bpw", metavar="BITS", show_default=False,
                                      help="Choose a type per tensor (GGUF: GGML types; compressed-tensors, MLX: recipes' schemes) from "
                                           "its sensitivity measured on --calib-data, for an average of BITS bits per weight "
                                           "(scales and float tensors counted).")
    ] = None,
    target_size: Annotated[
        Optional[str], typer.Option("--target-size", metavar="SIZE", show_default=False,
                                    help="As --target-bpw, for tensors of SIZE in all, e.g. 40GB (a GGUF file adds its header: "
                                         "the tokenizer and metadata).")
    ] = None,
    candidates: Annotated[
        Optional[str], typer.Option("--candidates", metavar="TYPES", show_default=False,
                                    help="With --target-bpw: the types to choose from, comma-separated (GGUF default "
                                         "q2_k,q3_k,q4_k,q5_k,q6_k,q8_0; compressed-tensors: gptq-w4a16,gptq-w8a16; MLX: "
                                         "mlx-3bit-g64,...,mlx-8bit-g64, 3/4/5/6/8 bits).")
    ] = None,
    save_plan: Annotated[
        Optional[Path], typer.Option("--save-plan", metavar="FILE.yaml", show_default=False,
                                     help="With --target-bpw: write the chosen plan as a recipe file; -q FILE.yaml repeats it "
                                          "without measuring.")
    ] = None,
    report: Annotated[
        Optional[Path], typer.Option("--report", metavar="FILE.html", show_default=False,
                                     help="With --target-bpw / --target-size: a web page of the plan (each tensor's estimated "
                                          "error per type, the type chosen, the budget), self-contained.")
    ] = None,
    num_samples: NumSamplesOpt = None,
    seq_len: SeqLenOpt = None,
    device: DeviceOpt = "cpu",
    max_gpu_memory: Annotated[
        Optional[str], typer.Option("--max-gpu-memory", metavar="SIZE", show_default=False,
                                    help="GPU memory calibration keeps within, e.g. 22GiB on a 24 GB card (default: what the GPU has free). "
                                         "Hidden states that do not fit wait in CPU memory and move batch by batch; the preflight says which.")
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace DST if it exists.")] = False,
    dtype: DtypeOpt = DtypeChoice.auto,
    threads: ThreadsOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    nproc_per_node: NprocOpt = 1,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    rdzv_endpoint: RdzvEndpointOpt = None,
    rdzv_backend: RdzvBackendOpt = RdzvBackend.static,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan (samples and GPTQ rows per rank, memory per rank) and exit; "
                                         "with --quiet, nothing but errors (--json FILE still gets the plan).")
    ] = False,
    revision: RevisionOpt = None,
    max_shard_size: Annotated[
        Optional[str], typer.Option("--max-shard-size", help="Largest safetensors file, e.g. 5GB or 500MB; several files get an index. Default: transformers' (50GB).", show_default=False)
    ] = None,
    force_recipe: Annotated[
        bool, typer.Option("--force-recipe", help="Quantize a QAT-trained model under a recipe other than its own.")
    ] = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue an interrupted calibrated run from its last checkpoint (saved in DST.partial).")
    ] = False,
    checkpoint_every: Annotated[
        Optional[float], typer.Option("--checkpoint-every", metavar="SECONDS", min=0, show_default=False,
                                      help="Save the resume state (the next layer's inputs) at most every SECONDS (default 600); "
                                           "0 saves it after every layer. A crash or Ctrl-C resumes from the last one saved.")
    ] = None,
    in_memory: Annotated[
        bool, typer.Option("--in-memory", help="Load the whole model instead of streaming it one decoder layer at a time (needs RAM for about twice the model).")
    ] = False,
    json_path: JsonOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Quantize a model into a low-bit artifact that plain transformers (and vLLM) load: post-training
    quantization of a plain model, or the convert step of a QAT-trained one (same recipes).
    """
    launch = Launch(nproc_per_node, nnodes, node_rank, rdzv_endpoint, rdzv_backend)
    ask = budget.Ask(target_bpw, target_size, candidates, save_plan, report)
    recipe = registry.with_tensor_types(registry.with_kv_cache(registry.resolve(budget.base_recipe(quantize, ask, format)), kv_cache),
                                        tensor_type)
    fmt = budget.check(ask, format, recipe)
    hub = sources.is_hub_id(src)
    src = sources.resolve_source(src, revision)  # before torch loads: a wrong SRC or DST is reported at once
    if revision is not None and not hub:  # the local directory would be quantized whatever revision it holds
        raise UsageError(f"--revision applies to hub ids (org/name); {src} is a local directory: drop --revision")
    # the request's refusals, --dry-run too (it says what the run would refuse); the library makes the same check
    check_request(Request(src, recipe, fmt or recipe.format, dst, overwrite, resume, max_shard_size, dtype.value))
    if not dry_run:
        atomic.check_work_dir(dst, resume, None if runtime.under_torchrun() else launch.world_size)
        if not runtime.under_torchrun():
            hardware.check_ranks(device, launch.nproc_per_node)  # CUDA: one GPU per rank, refused before launching
        code = relaunch(launch, threads)  # before torch is imported here: the ranks import it, this process only waits
        if code is not None:
            raise typer.Exit(code)
    quiet_libraries()
    from quantkit.finalization import finalize as library
    from quantkit.finalization.finalize import CalibrationOptions
    from quantkit.runtime.progress import Progress

    every = {} if checkpoint_every is None else {"checkpoint_every": checkpoint_every}
    if max_gpu_memory is not None:
        every["max_device_bytes"] = gpu_budget(max_gpu_memory, device)
    options = CalibrationOptions(data=calib_data, num_samples=num_samples, seq_len=seq_len, device=device, text_field=text_field,
                                 **every)
    from contextlib import ExitStack

    from quantkit.runtime import distributed

    with ExitStack() as group:
        if ask.planned:  # under torchrun: one process group for the plan and the run
            group.enter_context(distributed.process_group(options.device))
        chosen = None
        if ask.planned:
            chosen = budget.plan(src, recipe, fmt, ask, options, dtype.value, trust_remote_code,
                                 quiet or not runtime.is_main_process() or json_to_stdout(json_path), in_memory)
            recipe = chosen.recipe
        if dry_run:  # minutes on a CPU at 8B, where the recipe calibrates: a terminal shows it working
            with Progress(not quiet and not json_to_stdout(json_path)).task("Planning: one decoder layer of this shape timed here"):
                plan = library.dry_run(src, recipe, fmt, options, launch.world_size, trust_remote_code, revision, dst,
                                       dtype.value, in_memory)
            if json_path:
                write_json(json_path, "finalize --dry-run", plan | ({"budget": chosen.to_dict()} if chosen else {}))
            if not quiet and not json_to_stdout(json_path):  # --quiet: errors only; the plan goes to --json FILE if given
                print_plan(plan, recipe, dst)
            return
        main = runtime.is_main_process()
        quiet = quiet or not main or json_to_stdout(json_path)
        threads = threads or runtime.launched_threads()
        result = library.finalize(
            src, dst, recipe, fmt, overwrite=overwrite, dtype=dtype.value, threads=threads,
            trust_remote_code=trust_remote_code, force_recipe=force_recipe, progress=Progress(enabled=not quiet),
            calibration=options, revision=revision, max_shard_size=max_shard_size, resume=resume,
            announce=None if quiet else announce, in_memory=in_memory,
        )
        if not quiet:
            print_summary(result)
        if json_path and main:
            write_json(json_path, "finalize", result_dict(result) | ({"budget": chosen.to_dict()} if chosen else {}))


def gpu_budget(size: str, device: str) -> int:
    """--max-gpu-memory SIZE in bytes; refused for a run that computes on the CPU."""
    from quantkit.models.sources import parse_size

    if not device.startswith("cuda"):
        raise UsageError("--max-gpu-memory is the budget of a GPU: pass it with --device cuda")
    return parse_size(size, "--max-gpu-memory")


def device_line(report: dict) -> str | None:
    """The preflight's GPU memory: the peak, and where the calibration hidden states live (`preflight.device_plan`)."""
    plan = report.get("device_plan")
    if not plan:
        return None
    where = ("on the GPU" if plan["mode"] == "resident" else
             f"in CPU memory, moved batch by batch (all on the GPU would need {human_bytes(plan['resident_bytes'])})")
    budget = f" of {human_bytes(plan['budget_bytes'])}" if plan["budget_bytes"] else ""
    return f"GPU peak about {human_bytes(plan['peak_bytes'])}{budget}, calibration hidden states {where}"


def announce(report: dict) -> None:
    """The first line of a real run: what it will need, before any weight is loaded."""
    work = f", resume state {human_bytes(report['work_dir_bytes'])}" if report["work_dir_bytes"] else ""
    out.print(f"preflight: peak RAM about {human_bytes(report['peak_ram_bytes'])}, output {human_bytes(report['output_bytes'])}"
              f"{work}, {human_bytes(report['free_disk_bytes'])} free at DST", highlight=False, soft_wrap=True)
    gpu = device_line(report)
    if gpu:
        out.print(f"preflight: {gpu}", highlight=False, soft_wrap=True)
    for note in report.get("notes", []):  # the algorithm's (`Algorithm.report`)
        out.print(f"note: {note}", highlight=False, soft_wrap=True)


def learned_line(learned: dict) -> str:
    """The summary's line for learned rotations (quantkit.json's `transforms.learned`)."""
    if learned.get("restored"):
        return f"{learned['steps']} steps, restored from the interrupted run (its layers were quantized with them)"
    line = (f"{learned['steps']} Cayley SGD steps of {learned['samples_per_step']} samples: quantized loss "
            f"{learned['loss_first_steps']:.4f} -> {learned['loss_last_steps']:.4f} (first and last steps), "
            f"{learned['seconds']:.1f} s")
    passes = learned.get("passes_over_samples", 1)
    if passes > 1:  # the rotation fits the samples it sees again and again (benchmarks.md: 64 samples seen 12 times)
        line += (f"; each calibration sample was seen {passes:g} times: pass at least steps x batch samples "
                 "(--num-samples) so that it is seen once")
    return line


def print_plan(plan: dict, recipe, dst) -> None:
    """`--dry-run` for people: the preflight, then the ranks' shares (the whole plan: --json)."""
    from rich.table import Table

    report = plan["preflight"]
    table = Table(title=f"{recipe.name} -> {dst}: preflight (nothing loaded)", show_header=False)
    table.add_row("peak RAM", f"about {human_bytes(report['peak_ram_bytes'])} per rank")
    if report.get("memory_shortfall"):
        table.add_row("", f"DOES NOT FIT: {report['memory_shortfall']}")
    table.add_row("", "the model streamed, one decoder layer at a time" if report["streamed"] else "the whole model loaded (see `--in-memory`)")
    for part, size in report["peak_ram_breakdown"].items():
        table.add_row("", f"{human_bytes(size)}  {part}")
    if report["peak_device_bytes"]:
        table.add_row("peak device memory", f"about {human_bytes(report['peak_device_bytes'])} per rank")
        if device_line(report):
            table.add_row("", device_line(report))
    table.add_row("output", f"{human_bytes(report['output_bytes'])} (model {human_bytes(report['model_bytes'])})")
    if report["work_dir_bytes"]:
        table.add_row("resume state", f"{human_bytes(report['work_dir_bytes'])} at most, beside DST while it runs")
    fits = "fits" if report["fits_on_disk"] else "DOES NOT FIT: free some space or choose another DST"
    table.add_row("disk at DST", f"{human_bytes(report['free_disk_bytes'])} free; needs {human_bytes(report['disk_needed_bytes'])}: {fits}")
    timing = report.get("time")
    if timing:
        rotations = f", and {timing['rotations_seconds']:.1f} s of rotations" if "rotations_seconds" in timing else ""
        table.add_row("time", f"about {timing['seconds']:.0f} s: one layer {timing['one_layer_seconds']:.2f} s here x {timing['layers']} layers"
                      f"{rotations} ({timing['note']})")
    if plan["samples_per_rank"]:
        table.add_row("ranks", f"{plan['ranks']}: samples per rank {' / '.join(map(str, plan['samples_per_rank']))} of {plan['seq_len']} tokens")
    for label, text in recipe.quantizer.algorithm.plan_lines(plan):
        table.add_row(label, text)
    out.print(table)


def result_dict(result) -> dict:
    """The `finalize` JSON document (schema in the README): what was written, how big, how long, and how it went."""
    left_out = [{"module": e.name, "reason": e.note} for e in result.plan if not e.quantized]
    return {
        "dst": str(result.dst), "recipe": result.recipe.name, "format": result.format.value,
        "modules": {"quantized": sum(e.quantized for e in result.plan), "linear": len(result.plan), "left_out": left_out},
        "source_bytes": result.source_bytes, "output_bytes": result.output_bytes, "seconds": round(result.seconds, 3),
        "threads": result.threads, "calibration": result.calibration, "coverage": result.coverage,
        "peak_ram_bytes": result.peak_ram_bytes, "preflight": result.preflight, "loading": result.loading,
    }


def group_by_note(entries) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for entry in entries:
        grouped.setdefault(entry.note, []).append(entry.name)
    return grouped


def coverage_line(coverage: dict) -> str:
    """`plan.coverage` in one line: "97.1% of Linear parameters, 74.0% of all; left in full precision: 1 x <reason>; ..."."""
    share = coverage.get("quantized_linear_parameters", coverage["quantized_parameters"]) / max(1, coverage["linear_parameters"])
    overall = coverage["quantized_parameters"] / max(1, coverage["all_parameters"])
    reasons: dict[str, int] = {}
    for tensor in coverage["full_precision"]:
        reasons[tensor["reason"]] = reasons.get(tensor["reason"], 0) + 1
    kept = "; ".join(f"{count} x {reason}" for reason, count in reasons.items())
    also = "".join(f", {t['tensor']} as {t['type']}" for t in coverage.get("quantized_by_format", []))
    return f"{share:.1%} of Linear parameters{also}, {overall:.1%} of all; left in full precision: {kept or 'nothing'}"


def experts_line(routed: dict[str, list[int]]) -> str:
    """The calibration tokens the router sent to each MoE expert, in one line (every expert was calibrated on all)."""
    counts = [(count, f"{name}.{index}") for name, per_expert in routed.items() for index, count in enumerate(per_expert)]
    (low, quietest), (high, busiest) = min(counts), max(counts)
    never = sum(1 for count, _ in counts if count == 0)
    return (f"min {low} ({quietest}), max {high} ({busiest}) over {len(counts)} experts; {never} never routed "
            "(every expert is calibrated on every token)")


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
        for note in result.coverage.get("notes") or []:
            table.add_row("  note", note)
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
        if calib.get("peak_device_bytes") and calib["device"] != "cpu":
            estimated = (result.preflight or {}).get("peak_device_bytes")
            table.add_row("  GPU peak", f"{human_bytes(calib['peak_device_bytes'])} allocated by torch"
                          + (f" (estimated {human_bytes(estimated)} with the CUDA context)" if estimated else "")
                          + f"; hidden states {calib.get('hidden_states', 'on the device')}")
        for what, why in (calib.get("skipped") or {}).items():
            table.add_row("  not applied", f"{what} ({why})")
        if calib.get("routed_tokens"):
            table.add_row("  tokens per expert", experts_line(calib["routed_tokens"]))
        if calib.get("kv_cache"):
            kv = calib["kv_cache"]
            table.add_row("  KV cache", f"{kv['scheme']} in {kv['attention_modules']} attention modules; largest |key| {kv['max_abs_key']:.3g}, "
                          f"|value| {kv['max_abs_value']:.3g} (scale = that / 448); serve with vLLM's --kv-cache-dtype fp8")
        if calib.get("ranks", 1) > 1 and calib.get("peak_rss_per_rank"):
            table.add_row("  peak RAM per rank", " / ".join(human_bytes(b) for b in calib["peak_rss_per_rank"]))
        for label, text in result.recipe.quantizer.algorithm.summary_lines(calib):
            table.add_row(label, text)
    learned = (result.transforms or {}).get("learned")
    if learned:
        table.add_row("rotations learned", learned_line(learned))
    if result.recipe.online_rotations:
        from quantkit.quant.rotations import ONLINE_RUNTIMES
        table.add_row("online rotation", ONLINE_RUNTIMES)
    table.add_row("time", f"{result.seconds:.1f} s on {result.threads} thread{'' if result.threads == 1 else 's'}")
    if result.loading:
        table.add_row("model held", result.loading)
    if result.peak_ram_bytes and result.preflight:
        table.add_row("peak RAM", f"{human_bytes(result.peak_ram_bytes)} (estimated {human_bytes(result.preflight['peak_ram_bytes'])})")
    out.print(table)
