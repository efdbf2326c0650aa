"""`quantkit train`: training and fine-tuning, with quantization-aware training and data parallelism.

One full model per rank (DDP); the global batch is `train.global_batch_size` sequences whatever the number of
ranks (gradient accumulation adjusts); rank 0 alone logs, evaluates and writes. fp32 master weights, bf16
autocast where the device supports it.

Nothing is written to OUTPUT_DIR until the config, the data and the model have loaded: a run refused for its
inputs leaves no directory behind. A resumed run takes its QAT recipe from the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from quantkit import data
from quantkit.errors import InterruptedRunError, UsageError
from quantkit.export import atomic, metadata
from quantkit.models import loading as models
from quantkit.models import sources
from quantkit.quant.registry import Recipe
from quantkit.runtime import distributed
from quantkit.runtime import environment as runtime
from quantkit.runtime.distributed import Context
from quantkit.runtime.progress import QUIET, Progress
from quantkit.training import checkpoint
from quantkit.training.config import Sources, TrainConfig, accumulation_steps, resolve_sources
from quantkit.training.config import model_config as model_config_of


@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path
    steps: int  # the step the final model is at
    final_loss: float | None  # None: no step was trained (resumed at max_steps)
    eval_perplexity: float | None
    seconds: float
    tokens_per_second: float | None  # None: no step was trained
    history: list[dict[str, Any]] = field(default_factory=list)
    start_step: int = 0  # the checkpoint's step when resumed
    qat_recipe: str | None = None  # as given, or as the resumed checkpoint recorded it


@dataclass
class Run:
    """Everything the loop needs, built once."""

    config: TrainConfig
    ctx: Context
    model: nn.Module  # unwrapped
    trained: nn.Module  # what forward/backward run on (the DDP wrapper when distributed)
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    blocks: torch.Tensor
    eval_ids: torch.Tensor | None
    accum: int
    recipe: Recipe | None
    sources: Sources
    start_step: int = 0


def lr_lambda(config: TrainConfig):
    t = config.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def autocast(config: TrainConfig, device: torch.device):
    precision = config.train.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def build_model(config: TrainConfig, path: Path | None, device: torch.device = torch.device("cpu")) -> nn.Module:
    """fp32 master weights: from a model directory (a checkpoint being resumed, or model.path resolved), or
    model.config (from scratch) when `path` is None."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(config.train.seed)
    if path is not None:
        path = sources.check_model_dir(path)
        models.check_full_precision(path)  # QAT and other Linear transformations do not stack on a quantized model
        return models.load_model(path, dtype="float32").train()
    model_config = model_config_of(config.model)
    check_fits(parameter_count(model_config), device)
    return AutoModelForCausalLM.from_config(model_config, dtype=torch.float32).train()


def parameter_count(model_config) -> int:
    """The parameters model.config gives, counted on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config).parameters())


def check_fits(parameters: int, device: torch.device) -> None:
    """A model from model.config is built in fp32 in RAM; training on the CPU adds its gradients and AdamW's two
    moments (16 bytes a parameter in all). Left-out sizes are transformers' defaults (a 7B Llama): refused here in
    one line, not after minutes of allocating."""
    from quantkit.runtime.memory import physical_bytes

    needed = parameters * (16 if device.type == "cpu" else 4)
    ram = physical_bytes()
    if ram is not None and needed > ram:
        raise UsageError(f"model.config gives a model of {parameters / 1e9:.2f} B parameters, which needs about "
                         f"{needed / 2**30:.0f} GiB of RAM to train here (this machine has {ram / 2**30:.0f} GiB); "
                         "set its sizes in model.config (hidden_size, intermediate_size, num_hidden_layers, ...)")


def load_blocks(config: TrainConfig, tokenizer) -> tuple[torch.Tensor, torch.Tensor | None]:
    d = config.data
    advice = "set data.text_field to the field that holds the text"
    # a datasets spec's train split
    train_texts = data.load_texts(d.train, d.text_field, default_split="train", field_advice=advice)
    blocks = data.pack_blocks(data.tokenize(tokenizer, train_texts), d.seq_len)
    eval_texts = data.load_texts(d.eval, d.text_field, field_advice=advice) if d.eval else None
    return blocks, data.tokenize(tokenizer, eval_texts) if eval_texts else None


def check_token_ids(model: nn.Module, tokenizer, *ids: torch.Tensor | None) -> None:
    """Every token id of the data has a row in the model's embedding (a tokenizer larger than model.config's
    vocab_size failed at the first step with torch's "index out of range in self")."""
    rows = model.get_input_embeddings().num_embeddings
    top = max(int(t.max()) for t in ids if t is not None and t.numel())
    if top >= rows:
        raise UsageError(f"the data's token ids reach {top}, but the model has {rows} token embeddings; the tokenizer "
                         f"has {len(tokenizer)} tokens: set model.config's vocab_size to at least {len(tokenizer)}, or "
                         "use the tokenizer the model was made for")


def check_positions(model: nn.Module, seq_len: int) -> None:
    """Blocks no longer than the model's positions, as eval and finalize refuse longer windows and samples."""
    limit = models.max_positions(model.config)
    if limit is not None and seq_len > limit:
        raise UsageError(f"data.seq_len {seq_len} is beyond the model's {limit} positions (max_position_embeddings); "
                         f"set data.seq_len to {limit} or less")


def make_optimizer(model: nn.Module, config: TrainConfig):
    t = config.train
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))


def setup(config: TrainConfig, ctx: Context, recipe: Recipe | None, resume_from: Path | None) -> Run:
    from quantkit.quant import fake_quant
    from quantkit.training import qat

    found = resolve_sources(config)
    tokenizer = models.load_tokenizer(found.tokenizer, fix="set model.tokenizer to a tokenizer directory or hub id")
    blocks, eval_ids = load_blocks(config, tokenizer)
    t = config.train  # too few blocks for one global batch: refused now, before output_dir is written
    data.micro_batches(len(blocks), t.global_batch_size, t.micro_batch_size, ctx.rank, ctx.world_size, t.seed, 0)
    model = build_model(config, resume_from or found.model, ctx.device)
    check_token_ids(model, tokenizer, blocks, eval_ids)
    check_positions(model, config.data.seq_len)
    if recipe is not None and recipe.fused_rotations and resume_from is None:  # a checkpoint is rotated already
        from quantkit.quant.rotations import Rotator

        rotator = Rotator.of(recipe, model.config)  # train the model finalize will quantize: the rotated one
        rotator.check(model)
        rotator.rotate_model(model)
    if recipe is not None:  # fake quantizers go in before the optimizer is built, on the plan finalize writes
        fake_quant.prepare(model, qat.plan(model, recipe), qat.embedding(model, recipe))
    model.to(ctx.device)
    trained = model
    if ctx.distributed:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        trained = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    optimizer, scheduler = make_optimizer(model, config)
    run = Run(config, ctx, model, trained, tokenizer, optimizer, scheduler, blocks, eval_ids,
              accumulation_steps(config, ctx.world_size), recipe, found)
    if resume_from is not None:
        restore(run, checkpoint.load_state(resume_from))
    return run


def restore(run: Run, state: dict[str, Any]) -> None:
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    checkpoint.set_rng_state(state["rng"])
    run.start_step = int(state["step"])


def train_step(run: Run, step: int) -> float:
    """One optimizer step over the global batch; returns the global batch's mean loss."""
    t, ctx = run.config.train, run.ctx
    batches = data.micro_batches(len(run.blocks), t.global_batch_size, t.micro_batch_size, ctx.rank,
                                 ctx.world_size, t.seed, step)
    total = 0.0
    for k, indices in enumerate(batches):
        ids = run.blocks[indices].to(ctx.device)
        last = k == len(batches) - 1
        sync = contextlib.nullcontext() if last or not ctx.distributed else run.trained.no_sync()
        with sync, autocast(run.config, ctx.device):
            loss = run.trained(input_ids=ids, labels=ids).loss / len(batches)
            loss.backward()
        total += loss.item()
    if t.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), t.grad_clip)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return distributed.all_reduce_mean(total, ctx)


def evaluate(run: Run) -> float | None:
    """Perplexity on the eval data (rank 0 computes; the others wait)."""
    from quantkit.evaluation.evaluate import perplexity

    result = None
    if run.ctx.is_main and run.eval_ids is not None:
        run.model.eval()
        seq_len = run.config.data.seq_len
        result = perplexity(run.model, run.eval_ids, seq_len=seq_len,
                            max_samples=run.config.train.eval_max_samples).perplexity
        run.model.train()
    distributed.barrier(run.ctx)
    return result


def model_info(run: Run, step: int) -> dict[str, Any]:
    info: dict[str, Any] = {"kind": "training-checkpoint", "step": step, "world_size": run.ctx.world_size,
                            "accumulation_steps": run.accum, "versions": metadata.versions(),
                            "train_config": run.config.to_dict(),
                            "sources": {"model": str(run.sources.model) if run.sources.model else None,
                                        "tokenizer": str(run.sources.tokenizer)}}
    if run.recipe is not None:
        info["qat"] = {"recipe": run.recipe.to_dict(), "scheme": run.recipe.scheme.describe()}
    return info


def save_checkpoint(run: Run, step: int) -> None:
    if run.ctx.is_main:
        state = {"optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
                 "rng": checkpoint.rng_state(), "step": step, "world_size": run.ctx.world_size}
        root = Path(run.config.output_dir)
        checkpoint.save(root, step, run.model, run.tokenizer, state, model_info(run, step), run.config.train.keep_last)
    distributed.barrier(run.ctx)


def save_final(run: Run, step: int) -> Path:
    final = Path(run.config.output_dir) / "final"
    if run.ctx.is_main:
        with atomic.atomic_directory(final, overwrite=True) as tmp:
            checkpoint.save_model_dir(run.model, run.tokenizer, tmp, model_info(run, step) | {"kind": "trained-model"})
    distributed.barrier(run.ctx)
    return final


class Logger:
    """Rank 0: JSON lines in OUTPUT_DIR/log.jsonl (for CI) and the live progress line."""

    def __init__(self, run: Run, update):
        self.run, self.update = run, update
        self.path = Path(run.config.output_dir) / "log.jsonl"
        self.history: list[dict[str, Any]] = []

    def log(self, record: dict[str, Any]) -> None:
        if not self.run.ctx.is_main:
            return
        self.history.append(record)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        self.update(record)


def loop(run: Run, logger: Logger) -> tuple[int, float | None, float | None, float | None]:
    """Steps start_step..max_steps; returns the last step, its loss, the last eval perplexity and tokens/s (loss and
    tokens/s None where no step was left to train)."""
    t = run.config.train
    tokens_per_step = t.global_batch_size * run.config.data.seq_len
    loss, ppl, start = None, None, time.perf_counter()
    for step in range(run.start_step, t.max_steps):
        began = time.perf_counter()
        loss = train_step(run, step)
        done = step + 1
        record = {"step": done, "loss": loss, "lr": run.scheduler.get_last_lr()[0],
                  "tokens_per_second": tokens_per_step / (time.perf_counter() - began)}
        if t.eval_interval and done % t.eval_interval == 0 and done < t.max_steps:
            record["eval_perplexity"] = ppl = evaluate(run)
        if done % t.log_interval == 0 or done == t.max_steps or "eval_perplexity" in record or done == run.start_step + 1:
            logger.log(record)
        if t.save_interval and done % t.save_interval == 0:
            save_checkpoint(run, done)
    trained_steps = t.max_steps - run.start_step
    tps = tokens_per_step * trained_steps / max(1e-9, time.perf_counter() - start) if trained_steps else None
    return t.max_steps, loss, ppl, tps


def prepare_output(config: TrainConfig, resume: str | None, overwrite: bool) -> Path | None:
    """The checkpoint to resume from, or None for a new run; refuses an output_dir that a new run would mix with.
    Reads only: nothing is written before the inputs have loaded (`start_output`)."""
    root = Path(config.output_dir)
    if root.exists() and not root.is_dir():
        raise UsageError(f"output_dir {root} is a file; pass a directory (it is created) with --output-dir "
                         "or output_dir")
    if resume:
        return checkpoint.resolve_resume(root, resume)
    if overwrite and root.exists():
        check_inputs_outside(config, root)
    held = [p for p in root.iterdir() if p.name != "config.json"] if root.exists() else []
    if held and not overwrite:  # a config.json alone is what a run refused before its first step would have left
        step = checkpoint.latest(root)
        if step is not None:
            raise UsageError(f"{root} already holds a run (checkpoint {step.name}); pass --resume latest to "
                             "continue it, --overwrite to start over, or another output_dir")
        raise UsageError(f"{root} is not empty and holds no checkpoint to resume; pass --overwrite to start over in it "
                         "(its contents are deleted), or another output_dir")
    return None


def check_inputs_outside(config: TrainConfig, root: Path) -> None:
    """--overwrite empties output_dir: refuse it when the model, tokenizer or data the run reads is in there."""
    for what, given in [("model.path", config.model.path), ("model.tokenizer", config.model.tokenizer),
                        ("data.train", config.data.train), ("data.eval", config.data.eval)]:
        if given and Path(given).exists() and atomic.holds(root, given):
            raise UsageError(f"--overwrite would delete {what} {given}: it is in output_dir {root}; choose another "
                             "output_dir, or move it out first")


def resumed(config: TrainConfig, recipe: Recipe | None, resume_from: Path,
            note: Callable[[str], None]) -> tuple[TrainConfig, Recipe | None]:
    """The config and QAT recipe a resumed run goes on with: the checkpoint's recipe (a different --qat-recipe, or
    one for a checkpoint trained without QAT, is refused), and a max_steps no lower than the checkpoint's step."""
    from quantkit.training import qat

    info = metadata.read(resume_from) or {}
    step = checkpoint.step_of(resume_from)
    if config.train.max_steps < step:
        raise UsageError(f"--max-steps {config.train.max_steps} is below the checkpoint's step {step} "
                         f"({resume_from}); pass a larger --max-steps (train.max_steps), or --max-steps {step} "
                         "to write its model as final")
    recorded = qat.recorded_recipe(info)
    kept = qat.resumed_recipe(recipe, recorded, resume_from)
    if kept is not None and recipe is None:
        name = (info.get("train_config") or {}).get("qat_recipe") or kept.name
        config = replace(config, qat_recipe=name)
        note(f"resuming QAT with --qat-recipe {name}, as the checkpoint {resume_from} was trained")
    return config, kept


def train(config: TrainConfig, resume: str | None = None, overwrite: bool = False, threads: int | None = None,
          progress: Progress = QUIET, note: Callable[[str], None] = lambda line: None) -> TrainResult:
    """Train as `config` says; `note` is told, in one line, what the run takes from a resumed checkpoint."""
    from quantkit.quant import registry
    from quantkit.training import qat
    recipe = registry.resolve(config.qat_recipe) if config.qat_recipe else None
    if recipe is not None:
        qat.check_recipe(recipe)
        recipe = qat.training_recipe(recipe)  # recorded in quantkit.json: what finalize converts with
    began = time.perf_counter()
    root = Path(config.output_dir)
    with distributed.process_group() as ctx:
        accumulation_steps(config, ctx.world_size)  # a config error before any loading
        resume_from = prepare_output(config, resume, overwrite)
        if resume_from is not None:
            config, recipe = resumed(config, recipe, resume_from, note if ctx.is_main else lambda line: None)
        runtime.set_threads(threads)
        run = setup(config, ctx, recipe, resume_from)
        distributed.barrier(ctx)  # every rank loaded: only now is output_dir written
        if ctx.is_main:
            start_output(root, config, fresh=overwrite and not resume)
        distributed.barrier(ctx)
        try:
            with progress.training(config.train.max_steps, run.start_step, enabled=ctx.is_main) as update:
                logger = Logger(run, update)
                steps, loss, _, tps = loop(run, logger)
            ppl = evaluate(run)
            if ctx.is_main and ppl is not None:
                logger.log({"step": steps, "final_eval_perplexity": ppl})
            final = save_final(run, steps)
        except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (`errors.Terminated`): output_dir is written
            raise InterruptedRunError(interrupted(root, config.train.save_interval), interrupt) from None
    return TrainResult(root, final, steps, loss, ppl, time.perf_counter() - began, tps, logger.history,
                       run.start_step, config.qat_recipe)


def interrupted(root: Path, save_interval: int) -> str:
    """What an interrupted run left in `root`, and the command that goes on from it."""
    newest = checkpoint.latest(root)
    if newest is not None:
        return (f"interrupted; the newest checkpoint, {newest}, is kept: run the same command with --resume latest to "
                "continue from it")
    every = f"every {save_interval} steps" if save_interval else "save_interval is 0: only the final model is saved"
    return (f"interrupted before the first checkpoint ({every}); {root} holds only the run's config and log: run the "
            "same command with --overwrite to start again")


def start_output(root: Path, config: TrainConfig, fresh: bool) -> None:
    """Rank 0: an output directory holding the resolved config (emptied first with --overwrite)."""
    import shutil

    if fresh and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
