"""`finalize --target-bpw / --target-size`: the options' checks before torch loads, and the plan, measured and shown."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

from quantkit.cli.console import human_bytes, out
from quantkit.errors import UsageError
from quantkit.quant.registry import Format, Recipe

DEFAULT_RECIPE = "gguf-q4-k-m"  # budget.planner.DEFAULT_RECIPE, named here without importing torch


@dataclass(frozen=True)
class Ask:
    """The budget options as given."""

    target_bpw: float | None = None
    target_size: str | None = None
    candidates: str | None = None
    save_plan: Path | None = None
    report: Path | None = None

    @property
    def planned(self) -> bool:
        return self.target_bpw is not None or self.target_size is not None

    @property
    def flag(self) -> str:
        return "--target-bpw" if self.target_bpw is not None else "--target-size"


def base_recipe(quantize: str | None, ask: Ask, fmt: Format | None = None) -> str:
    """The recipe to resolve: -q's, else with a budget the plan's default for the format; neither is a one-line error."""
    if quantize is not None:
        return quantize
    if ask.planned:
        from quantkit.export import FORMATS

        return FORMATS[fmt].budget_recipe if fmt is not None else DEFAULT_RECIPE
    raise UsageError("pass -q RECIPE (see `quantkit recipes list`), or --target-bpw BITS / --target-size SIZE for a "
                     "GGUF type per tensor")


def check(ask: Ask, fmt: Format | None, recipe: Recipe) -> Format | None:
    """The budget options make sense together (before torch loads); the format to write."""
    if not ask.planned:
        if ask.candidates is not None or ask.save_plan is not None or ask.report is not None:
            raise UsageError("--candidates, --save-plan and --report go with --target-bpw BITS or --target-size SIZE")
        return fmt
    from quantkit.budget.planner import check_target, parse_candidates
    from quantkit.models.sources import parse_size

    if ask.target_bpw is not None and ask.target_size is not None:
        raise UsageError("give --target-bpw or --target-size, not both")
    if ask.target_bpw is not None:
        check_target(ask.target_bpw)
    else:
        parse_size(ask.target_size, "--target-size")
    from quantkit.export import FORMATS
    from quantkit.finalization.request import per_tensor_formats

    target = fmt or recipe.format
    if FORMATS[target].tensor_types is None:
        raise UsageError(f"{ask.flag} chooses a type per tensor, which --format {per_tensor_formats()} holds; a "
                         f"{target.value} artifact takes one scheme")
    parse_candidates(ask.candidates, target)
    if ask.save_plan is not None and ask.save_plan.suffix not in (".yaml", ".yml"):
        raise UsageError(f"--save-plan {ask.save_plan}: a recipe file is named .yaml, e.g. plan.yaml")
    if ask.report is not None and ask.report.suffix not in (".html", ".htm"):
        raise UsageError(f"--report {ask.report}: the report is a web page, named .html, e.g. budget.html")
    for flag, path in (("--save-plan", ask.save_plan), ("--report", ask.report)):
        if path is not None and not path.parent.is_dir():
            raise UsageError(f"{flag} {path}: {path.parent} does not exist; create it or give another path")
    return target


def plan(src: Path, recipe: Recipe, fmt: Format, ask: Ask, options, dtype: str, trust_remote_code: bool, quiet: bool,
         in_memory: bool = False):
    """The budget plan (`budget.planner.plan`), shown unless `quiet`, saved to `--save-plan` if given."""
    from quantkit.budget import planner
    from quantkit.models.sources import parse_size
    from quantkit.runtime import distributed
    from quantkit.runtime.progress import Progress

    size = None if ask.target_size is None else parse_size(ask.target_size, "--target-size")
    with distributed.process_group(options.device) as ctx:  # under torchrun: the ranks share the measuring
        chosen = planner.plan(src, recipe, ask.target_bpw, options, planner.parse_candidates(ask.candidates, fmt), dtype,
                              trust_remote_code, Progress(enabled=not quiet), target_bytes=size, fmt=fmt,
                              in_memory=in_memory, ctx=ctx)
    if not ctx.is_main:  # every rank has the plan; rank 0 writes what is written
        return chosen
    if ask.save_plan is not None:
        text = f"# quantkit's budget plan: {chosen.target_bpw:.4g} bits per weight over {src}\n"
        ask.save_plan.write_text(text + yaml.safe_dump(chosen.recipe.to_file(), sort_keys=False, width=120))
    if ask.report is not None:
        from quantkit.budget.report import render
        from quantkit.export.atomic import write_text

        write_text(ask.report, render(chosen, f"quantkit budget plan: {src.name}, {chosen.target_bpw:.4g} bits per weight"))
    if not quiet:
        show(chosen)
    return chosen


def show(chosen) -> None:
    counts = Counter(chosen.types.values())
    mix = ", ".join(f"{n} x {t}" for t, n in sorted(counts.items(), key=lambda item: -item[1]))
    seconds = sum(chosen.measured.seconds.values())
    out.print(f"budget: {chosen.bits_per_weight:.3f} bits per weight planned (target {chosen.target_bpw:.4g}), tensors "
              f"{human_bytes(chosen.tensor_bytes)}; {len(chosen.types)} decided: {mix}; estimated KL "
              f"{chosen.estimated_kl:.4g}; sensitivity measured in {seconds:.1f} s on {chosen.measured.tokens} tokens",
              highlight=False, soft_wrap=True)
