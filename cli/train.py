"""`quantkit train CONFIG.yaml`: the config, its model.config and the QAT recipe are checked before any process
is launched; the loop (`quantkit.training.loop.train`) runs in each rank."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantkit.cli.console import json_to_stdout, out, quiet_libraries, write_json
from quantkit.cli.launch import Launch, relaunch
from quantkit.runtime import environment as runtime
from quantkit.cli.options import (
    JsonOpt,
    NnodesOpt,
    NodeRankOpt,
    NprocOpt,
    QuietOpt,
    RdzvBackend,
    RdzvBackendOpt,
    RdzvEndpointOpt,
    ThreadsOpt,
)


# The end of `quantkit train --help` (typer's epilog): lines of at most 78 characters, so 80-column help keeps
# each whole; the recipes and options they name must exist (tests/cli/test_commands_doc.py)
EXAMPLES = """Examples:

quantkit train config.yaml --nproc-per-node 2

quantkit train config.yaml --qat-recipe int8-dynamic-act-int4-weight

quantkit train config.yaml --resume latest --set train.max_steps=2000
"""


def train(
    config: Annotated[Path, typer.Argument(help="Training config (YAML): model, data, train, output_dir.")],
    qat_recipe: Annotated[
        Optional[str], typer.Option("--qat-recipe", help="Quantization-aware training for this recipe (name or .yaml).")
    ] = None,
    nproc_per_node: NprocOpt = 1,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    rdzv_endpoint: RdzvEndpointOpt = None,
    rdzv_backend: RdzvBackendOpt = RdzvBackend.static,
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="Override a config key: --set train.lr=1e-4 (repeatable).")
    ] = None,
    output_dir: Annotated[Optional[Path], typer.Option("--output-dir", help="Overrides output_dir.")] = None,
    max_steps: Annotated[Optional[int], typer.Option("--max-steps", min=1, help="Overrides train.max_steps.")] = None,
    resume: Annotated[
        Optional[str], typer.Option("--resume", help="Continue from 'latest' (in output_dir) or a checkpoint directory.")
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start over in an output_dir that holds a run.")] = False,
    threads: ThreadsOpt = None,
    json_path: JsonOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Train or fine-tune a causal LM; with --qat-recipe, quantization-aware training.

    The trained model lands in OUTPUT_DIR/final; convert a QAT model with
    `quantkit finalize OUTPUT_DIR/final DST --quantize RECIPE`.
    """
    launch = Launch(nproc_per_node, nnodes, node_rank, rdzv_endpoint, rdzv_backend)
    quiet_libraries()
    from quantkit.quant import registry
    from quantkit.runtime import hardware
    from quantkit.training import config as train_config
    overrides = list(set_ or [])
    overrides += [f"output_dir={output_dir}"] if output_dir else []
    overrides += [f"train.max_steps={max_steps}"] if max_steps else []
    overrides += [f"qat_recipe={qat_recipe}"] if qat_recipe else []
    cfg = train_config.load(config, overrides)  # validated before launching any process
    if cfg.model.config is not None:
        train_config.model_config(cfg.model)  # an unknown key or model_type, before any rank builds it
    train_config.resolve_sources(cfg)  # a missing directory or hub id too, before torch loads
    if cfg.qat_recipe:
        from quantkit.training import qat
        qat.check_recipe(registry.resolve(cfg.qat_recipe))
    if not runtime.under_torchrun():
        hardware.check_ranks(None, launch.nproc_per_node)  # on a GPU machine each rank takes a GPU
    code = relaunch(launch, threads)
    if code is not None:
        raise typer.Exit(code)
    from quantkit.runtime.progress import Progress
    from quantkit.training.loop import train as run

    main_rank = runtime.is_main_process()
    quiet = quiet or json_to_stdout(json_path)
    threads = threads or runtime.launched_threads()
    speak = not quiet and main_rank
    note = (lambda line: out.print(line, highlight=False, soft_wrap=True)) if speak else (lambda line: None)
    result = run(cfg, resume=resume, overwrite=overwrite, threads=threads, progress=Progress(enabled=speak), note=note)
    if json_path and main_rank:
        write_json(json_path, "train", {
            "output_dir": str(result.output_dir), "final_dir": str(result.final_dir), "steps": result.steps,
            "start_step": result.start_step, "final_loss": result.final_loss, "eval_perplexity": result.eval_perplexity,
            "seconds": round(result.seconds, 3), "tokens_per_second": result.tokens_per_second,
            "qat_recipe": result.qat_recipe,
        })
    if speak:
        out.print(summary(result), highlight=False)


def summary(result) -> str:
    """The closing line: what was trained (from where a resumed run began), the final loss and perplexity."""
    ppl = f"eval perplexity {result.eval_perplexity:.3f}" if result.eval_perplexity is not None else ""
    where = f"model: {result.final_dir}; log: {result.output_dir / 'log.jsonl'}"
    if result.final_loss is None:  # resumed at max_steps
        measured = f" ({ppl})" if ppl else ""
        return (f"nothing to train: the checkpoint is at step {result.steps}, which is max_steps; its weights are the "
                f"final model{measured}; {where}")
    trained = result.steps - result.start_step
    began = ""
    if result.start_step:
        began = f" (steps {result.start_step + 1}-{result.steps}, resumed at step {result.start_step})"
    ppl = f", {ppl}" if ppl else ""
    loss = f"final loss {result.final_loss:.4f}{ppl}"
    return f"trained {trained} steps{began} in {result.seconds:.1f} s ({loss}); {where}"
