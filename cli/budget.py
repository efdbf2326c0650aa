"""`finalize --target-bpw`: the options' checks before torch loads, and the plan, measured and shown."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import yaml

from quantkit.cli.console import out
from quantkit.errors import UsageError
from quantkit.quant.registry import Format, Recipe

DEFAULT_RECIPE = "gguf-q4-k-m"  # budget.planner.DEFAULT_RECIPE, named here without importing torch


def base_recipe(quantize: str | None, target_bpw: float | None) -> str:
    """The recipe to resolve: -q's, else with --target-bpw the plan's default; neither is a one-line error."""
    if quantize is not None:
        return quantize
    if target_bpw is not None:
        return DEFAULT_RECIPE
    raise UsageError("pass -q RECIPE (see `quantkit recipes list`), or --target-bpw BITS for a GGUF type per tensor")


def check(target_bpw: float | None, candidates: str | None, save_plan: Path | None, fmt: Format | None,
          recipe: Recipe) -> Format | None:
    """The budget options make sense together (before torch loads); the format to write."""
    if target_bpw is None:
        if candidates is not None or save_plan is not None:
            raise UsageError("--candidates and --save-plan go with --target-bpw BITS")
        return fmt
    from quantkit.budget.planner import check_target, parse_candidates

    check_target(target_bpw)
    parse_candidates(candidates)
    if (fmt or recipe.format) is not Format.GGUF:
        raise UsageError(f"--target-bpw chooses GGML types per tensor, which a GGUF file holds; use --format gguf "
                         f"(the recipe '{recipe.name}' writes {recipe.format.value})")
    if save_plan is not None and save_plan.suffix not in (".yaml", ".yml"):
        raise UsageError(f"--save-plan {save_plan}: a recipe file is named .yaml, e.g. plan.yaml")
    if save_plan is not None and not save_plan.parent.is_dir():
        raise UsageError(f"--save-plan {save_plan}: {save_plan.parent} does not exist; create it or give another path")
    return Format.GGUF


def plan(src: Path, recipe: Recipe, target_bpw: float, candidates: str | None, options, dtype: str,
         trust_remote_code: bool, save_plan: Path | None, quiet: bool):
    """The budget plan (`budget.planner.plan`), shown unless `quiet`, saved to `save_plan` if given."""
    from quantkit.budget import planner
    from quantkit.runtime.progress import Progress

    chosen = planner.plan(src, recipe, target_bpw, options, planner.parse_candidates(candidates), dtype,
                          trust_remote_code, Progress(enabled=not quiet))
    if save_plan is not None:
        text = f"# quantkit's budget plan: {target_bpw} bits per weight over {src}\n"
        save_plan.write_text(text + yaml.safe_dump(chosen.recipe.to_file(), sort_keys=False, width=120))
    if not quiet:
        show(chosen)
    return chosen


def show(chosen) -> None:
    counts = Counter(chosen.types.values())
    mix = ", ".join(f"{n} x {t}" for t, n in sorted(counts.items(), key=lambda item: -item[1]))
    seconds = sum(chosen.measured.seconds.values())
    out.print(f"budget: {chosen.bits_per_weight:.3f} bits per weight planned (target {chosen.target_bpw}), "
              f"{len(chosen.types)} tensors: {mix}; estimated KL {chosen.estimated_kl:.4g}; sensitivity measured in "
              f"{seconds:.1f} s on {chosen.measured.tokens} tokens", highlight=False, soft_wrap=True)
