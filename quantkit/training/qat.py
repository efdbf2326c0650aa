"""Quantization-aware training: which recipes QAT takes (`check_recipe`), the recipe it trains under and
`finalize` converts with (`training_recipe`), and the Linears it fake-quantizes (`plan`). The fake quantizers
themselves, exact to the scheme's grid, are `quant.fake_quant`'s; where the format quantizes the token embedding
(a GGUF mixture), QAT trains it on that grid too (`embedding`).

A GGUF recipe is trained on the plan `finalize` writes (`plan`): a mixture's type for each tensor (Q6_K on
lm_head and some attn_v / ffn_down, Q5_0 / Q8_0 where rows are not whole super-blocks). Its GPTQ is not run on a
QAT model: `training_recipe` (the format's `qat_recipe`) rounds to nearest on the K grids, in training and in
`finalize`'s convert step.

A resumed run trains under the recipe its checkpoint recorded (`recorded_recipe`, `resumed_recipe`): leaving
--qat-recipe out on resume keeps QAT on, and another recipe cannot be switched to halfway.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from quantkit.errors import UsageError
from quantkit.export import exporter, for_format
from quantkit.quant.plan import ModulePlan, plan_model
from quantkit.quant.registry import Recipe, parse_recipe, recipe_names, resolve
from quantkit.grids.schemes import WeightObserver, WeightSpec


def training_recipe(recipe: Recipe) -> Recipe:
    """The recipe QAT trains under and `finalize` converts a QAT model with: the format's `qat_recipe` (a GGUF
    recipe on K grids calibrated by GPTQ alone rounds to nearest on the same grids); any other recipe as it is."""
    return exporter(recipe.format).qat_recipe(recipe)


def plan(model: nn.Module, recipe: Recipe) -> list[ModulePlan]:
    """The Linears QAT fake-quantizes, each with the scheme `finalize` writes it in: the recipe's plan as the
    format holds it (`adapt_plan`; GGUF: a mixture's K types, the fallbacks where rows are not whole super-blocks,
    full precision where no GGML block fits)."""
    recipe = for_format(recipe, recipe.format)
    return exporter(recipe.format).adapt_plan(plan_model(model, recipe), recipe, model.config)


def embedding(model: nn.Module, recipe: Recipe) -> WeightSpec | None:
    """The grid QAT fake-quantizes the token embedding on: the format's (`embedding_weights`; a GGUF mixture's
    token_embd type), so training sees the embedding the file holds; None: trained in float."""
    return exporter(recipe.format).embedding_weights(for_format(recipe, recipe.format), model.config)


def qat_ready(recipe: Recipe) -> bool:
    """Round to nearest on min/max weights, with dynamic activations: the weights training sees are the ones
    `finalize` writes. NVFP4's activations qualify: their groups are dynamic, and their global scale, which
    `finalize` calibrates, is each tensor's own during training (as torchao's NVFP4 QAT does). A GGUF K recipe
    qualifies as its `training_recipe`."""
    steps_rtn = all(step.algorithm.qat_ready for step in training_recipe(recipe).steps)
    acts = recipe.scheme.activations
    minmax = recipe.scheme.weights.observer is WeightObserver.MINMAX
    return steps_rtn and minmax and (acts is None or acts.dynamic) and recipe.kv_cache is None and not recipe.online_rotations


def check_recipe(recipe: Recipe) -> None:
    """QAT recipes round to nearest with dynamic activations: what training sees is what `finalize` writes.
    A calibrated recipe (GPTQ, SmoothQuant, static scales) would change the weights after training."""
    if recipe.online_rotations:
        raise UsageError(f"--qat-recipe {recipe.name}: QAT takes fused rotations (R1, R2) only; an online rotation (R4) "
                         "would be lost with the trained checkpoint: leave it out of the QAT recipe")
    if recipe.learned_rotations is not None:
        raise UsageError(f"--qat-recipe {recipe.name}: its rotations are learned by `finalize` on calibration data; in QAT "
                         "the weights themselves train: drop `learn` from the transform")
    if not qat_ready(recipe):
        usable = [n for n in recipe_names() if qat_ready(resolve(n))]
        raise UsageError(f"--qat-recipe {recipe.name}: QAT takes round-to-nearest min/max recipes with dynamic activations "
                         f"({', '.join(usable)})")


def recorded_recipe(info: dict[str, Any]) -> Recipe | None:
    """The training recipe a checkpoint's quantkit.json records (`Recipe.to_dict`), read back without its recipe
    file (a path given then may be gone); None for a checkpoint trained without QAT."""
    recorded = (info.get("qat") or {}).get("recipe")
    if recorded is None:
        return None
    data = {k: v for k, v in recorded.items() if k not in ("name", "source", "steps")}
    steps = [{"name": step["name"], **step["args"]} for step in recorded["steps"]]
    data["algorithm"] = steps[0] if len(steps) == 1 else steps
    return parse_recipe(recorded["name"], data, source=recorded.get("source", ""))


def resumed_recipe(given: Recipe | None, recorded: Recipe | None, checkpoint: Path) -> Recipe | None:
    """The recipe a run resumed from `checkpoint` trains under: the recorded one. `given` (--qat-recipe, as its
    `training_recipe`) must be that recipe, or absent."""
    if given is None or _same(given, recorded):
        return recorded
    fix = "resume without --qat-recipe (the checkpoint's is used), or start a new run in another output_dir"
    if recorded is None:
        raise UsageError(f"--qat-recipe {given.name}: the checkpoint {checkpoint} was trained without QAT; {fix}")
    raise UsageError(f"--qat-recipe {given.name}: the checkpoint {checkpoint} was trained with --qat-recipe "
                     f"{recorded.name}; {fix}")


def _same(a: Recipe, b: Recipe | None) -> bool:
    """The same recipe wherever its file lies."""
    return b is not None and {**a.to_dict(), "source": ""} == {**b.to_dict(), "source": ""}
