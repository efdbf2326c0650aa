"""Benchmark the cost of quantization-aware training: optimizer-step time with `--qat-recipe` vs without.

Run from the repository root (with the venv active):

    python scripts/bench_qat.py                       # all five recipes, random token ids, 2 threads
    python scripts/bench_qat.py --data text --json bench_qat.json
    python scripts/bench_qat.py --recipes int8-dynamic-act-int4-weight --profile

What it measures, for every recipe QAT accepts (the five round-to-nearest ones; `--recipes` to choose), in ONE
process:

* two models side by side with the same initial weights (`quantkit.training.loop.build_model`, seeded), one plain and
  one with the recipe's fake quantizers installed by `quantkit.training.fake_quant.prepare` (the plan `quantkit train
  --qat-recipe` uses), each with its own AdamW and LR schedule (`quantkit.training.loop.make_optimizer`);
* one optimizer step is `quantkit.training.loop.train_step` itself (forward + backward over the micro-batches, grad
  clipping, optimizer and scheduler step, zero_grad), fed the same batch in both models (the step's batch is
  a function of the step number and the seed); fp32 (`precision: auto` on CPU);
* after `--warmup` unmeasured pairs, `--pairs` measured pairs, interleaved: plain step, QAT step, plain, QAT,
  ...; the ratio QAT / plain is taken pair by pair so slow drift of a noisy machine cancels; the table shows
  the median step time of each and the median of the per-pair ratios (with its min and max); the same ratio
  of process CPU time (all threads) is shown too: it is less sensitive to other processes taking the cores;
* torch's intra-op threads are pinned with `--threads` (default 2).

The default model is a Llama built from a config: hidden 512, 4 layers, intermediate 1536, 8 heads (8 key/value
heads), vocab 4096, untied embeddings (17.8M parameters; the script prints the exact count); seq_len 256,
micro batch 4, one micro-batch per step. Data: random token ids by default (the step time does not depend on
the token values); `--data text` packs `--text` (WikiText-2 valid) tokenized by a BPE tokenizer from
`quantkit.models.tiny.train_tokenizer` instead. `--profile` adds a torch.profiler table of the QAT step's top
operators for each recipe (a few extra steps, not timed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import harness
from harness import median
from quantkit.quant import registry
from quantkit.runtime import environment as runtime
from quantkit.runtime.distributed import process_group
from quantkit.quant import fake_quant
from quantkit.training import qat
from quantkit.training import loop as train
from quantkit.training import config as train_config

DEFAULT_TEXT = harness.WIKITEXT / "valid.txt"
TARGET_RATIO = 1.25  # the target; Forgather measured 1.67x, torchtune reports ~1.3x


@dataclass
class Result:
    recipe: str
    quantized_linears: int
    plain_s: list[float] = field(default_factory=list)  # wall time per step
    qat_s: list[float] = field(default_factory=list)
    plain_cpu_s: list[float] = field(default_factory=list)  # process CPU time per step (all threads)
    qat_cpu_s: list[float] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        return [q / p for p, q in zip(self.plain_s, self.qat_s)]

    @property
    def cpu_ratios(self) -> list[float]:
        return [q / p for p, q in zip(self.plain_cpu_s, self.qat_cpu_s)]

    def summary(self) -> dict:
        return {"recipe": self.recipe, "quantized_linears": self.quantized_linears,
                "plain_median_s": median(self.plain_s), "qat_median_s": median(self.qat_s),
                "ratio_median": median(self.ratios), "ratio_min": min(self.ratios),
                "ratio_max": max(self.ratios), "cpu_ratio_median": median(self.cpu_ratios)}


# ---------------------------------------------------------------- setup


def make_config(args: argparse.Namespace, vocab_size: int) -> train_config.TrainConfig:
    model = {"model_type": "llama", "hidden_size": args.hidden, "num_hidden_layers": args.layers,
             "intermediate_size": args.intermediate, "num_attention_heads": args.heads,
             "num_key_value_heads": args.kv_heads or args.heads, "vocab_size": vocab_size,
             "max_position_embeddings": max(2048, args.seq_len)}
    return train_config.from_dict({
        "model": {"config": model, "tokenizer": "unused"},  # the benchmark feeds token ids directly
        "data": {"train": "unused", "seq_len": args.seq_len},
        "train": {"micro_batch_size": args.micro_batch, "global_batch_size": args.micro_batch * args.accum,
                  "max_steps": 10_000, "warmup_steps": 10, "seed": args.seed},
    })


def make_blocks(args: argparse.Namespace) -> tuple[torch.Tensor, int]:
    """[n, seq_len] token blocks and the vocab size they use."""
    if args.data == "random":
        generator = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, args.vocab, (256, args.seq_len), generator=generator), args.vocab
    from quantkit import data
    from quantkit.models.tiny import train_tokenizer

    text = args.text.read_text(encoding="utf-8")
    tokenizer = train_tokenizer(text, args.vocab)
    return data.pack_blocks(data.tokenize(tokenizer, [text]), args.seq_len), len(tokenizer)


def make_run(config: train_config.TrainConfig, ctx, blocks: torch.Tensor, recipe_name: str | None,
             k_refresh_every: int | None = None) -> train.Run:
    """What `quantkit.training.loop.setup` builds, minus tokenizer and files: same model, plan, optimizer, schedule.
    `k_refresh_every`: K grids searched every this many forward calls (default: fake_quant.K_REFRESH_EVERY)."""
    model = train.build_model(config, None)
    recipe = registry.resolve(recipe_name) if recipe_name else None
    if recipe is not None:
        fake_quant.prepare(model, qat.plan(model, recipe))
    for module in model.modules():
        if k_refresh_every and isinstance(module, fake_quant.BlockGridFakeQuantizer):
            module.config = dataclasses.replace(module.config, refresh_every=k_refresh_every)
    optimizer, scheduler = train.make_optimizer(model, config)
    accum = train_config.accumulation_steps(config, ctx.world_size)
    return train.Run(config, ctx, model, model, None, optimizer, scheduler, blocks, None, accum, recipe, None)


def timed_step(run: train.Run, step: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one optimizer step."""
    wall, cpu = time.perf_counter(), time.process_time()
    train.train_step(run, step)
    return time.perf_counter() - wall, time.process_time() - cpu


# ---------------------------------------------------------------- measuring


def bench_recipe(config, ctx, blocks, recipe_name: str, args: argparse.Namespace) -> Result:
    plain, fake = make_run(config, ctx, blocks, None), make_run(config, ctx, blocks, recipe_name, args.k_refresh_every)
    result = Result(recipe_name, len(fake_quant.prepared_schemes(fake.model)))
    for step in range(args.warmup + args.pairs):
        (p, p_cpu), (q, q_cpu) = timed_step(plain, step), timed_step(fake, step)
        if step >= args.warmup:
            result.plain_s.append(p)
            result.qat_s.append(q)
            result.plain_cpu_s.append(p_cpu)
            result.qat_cpu_s.append(q_cpu)
    if args.profile:
        profile(fake, args.warmup + args.pairs, recipe_name)
    return result


def profile(run: train.Run, step: int, recipe_name: str, steps: int = 3) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(steps):
            train.train_step(run, step + k)
    print(f"\n### profile: {recipe_name}, {steps} QAT steps (self CPU time, top 25)\n", file=sys.stderr)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)


# ---------------------------------------------------------------- reporting


TABLE_HEADER = ["recipe", "quantized Linears", "plain step (median)", "QAT step (median)",
                "QAT / plain (median of pairs)", "min - max", "CPU-time ratio (median)"]


def table_row(result: Result) -> list[str]:
    s = result.summary()
    flag = "" if s["ratio_median"] <= TARGET_RATIO else " (above 1.25)"
    return [result.recipe, str(result.quantized_linears), f"{s['plain_median_s'] * 1e3:.0f} ms",
            f"{s['qat_median_s'] * 1e3:.0f} ms", f"{s['ratio_median']:.3f}x{flag}",
            f"{s['ratio_min']:.3f} - {s['ratio_max']:.3f}", f"{s['cpu_ratio_median']:.3f}x"]


def markdown(results: list[Result]) -> str:
    return harness.markdown_table(TABLE_HEADER, [table_row(result) for result in results], align="lrrrrlr")


def describe(args: argparse.Namespace, config, blocks: torch.Tensor, params: int) -> dict:
    return {"model": config.model.config, "parameters": params, "seq_len": args.seq_len,
            "micro_batch": args.micro_batch, "micro_batches_per_step": args.accum, "data": args.data,
            "train_blocks": len(blocks), "threads": torch.get_num_threads(), "warmup_pairs": args.warmup,
            "measured_pairs": args.pairs, "precision": "fp32", "torch": torch.__version__,
            **harness.versions("torchao", "transformers"), "python": platform.python_version()}


def qat_recipes() -> list[str]:
    """The shipped recipes `quantkit train --qat-recipe` accepts (`qat.qat_ready`)."""
    return [name for name in registry.recipe_names() if qat.qat_ready(registry.resolve(name))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=qat_recipes(), help="default: every shipped recipe QAT can train for")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=0, help="default: --heads")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured pairs per recipe")
    p.add_argument("--pairs", type=int, default=15, help="measured pairs per recipe")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", choices=("random", "text"), default="random")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="with --data text")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k-refresh-every", type=int, default=0,
                   help="K grids (gguf-q*-k*): searched every N training forward calls (default: fake_quant.K_REFRESH_EVERY)")
    p.add_argument("--profile", action="store_true", help="also profile 3 QAT steps per recipe (to stderr)")
    p.add_argument("--json", type=Path, help="write the settings and every measurement here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runtime.set_threads(args.threads)
    blocks, vocab = make_blocks(args)
    config = make_config(args, vocab)
    params = sum(p.numel() for p in train.build_model(config, None).parameters())
    settings = None
    results = []
    with process_group() as ctx:
        settings = describe(args, config, blocks, params)
        print(f"model: Llama {params / 1e6:.1f}M parameters ({params:,}); {json.dumps(settings)}", file=sys.stderr)
        for name in args.recipes:
            results.append(bench_recipe(config, ctx, blocks, name, args))
            print(f"{name}: {json.dumps(results[-1].summary())}", file=sys.stderr)
    print(markdown(results))
    if args.json:
        payload = {"settings": settings, "results": [asdict(r) | r.summary() for r in results]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
