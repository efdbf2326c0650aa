"""Which Linear modules a recipe quantizes, and with which group size.

Policy for a Linear whose input size the recipe's group size does not divide (`on_indivisible`):
`smaller-group` halves the group size until it divides (down to 16) and reports the change;
if no such size exists, or the policy is `skip`, the layer stays in full precision and is reported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from quantkit.errors import UnsupportedModelError
from quantkit.registry import IndivisiblePolicy, Recipe
from quantkit.schemes import Granularity, QuantScheme

MIN_GROUP_SIZE = 16


@dataclass(frozen=True)
class ModulePlan:
    name: str
    in_features: int
    out_features: int
    scheme: QuantScheme | None  # None: left in full precision
    note: str = ""  # why it is skipped, or how its group size changed

    @property
    def quantized(self) -> bool:
        return self.scheme is not None


def is_ignored(name: str, patterns: tuple[str, ...]) -> bool:
    """`re:PATTERN` matches by regular expression (re.search); a plain entry matches the name or its tail."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.search(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


def fitting_group_size(in_features: int, group_size: int) -> int | None:
    size = group_size
    while size >= MIN_GROUP_SIZE:
        if in_features % size == 0:
            return size
        size //= 2
    return None


def plan_module(name: str, module: nn.Linear, recipe: Recipe) -> ModulePlan:
    shape = dict(name=name, in_features=module.in_features, out_features=module.out_features)
    if is_ignored(name, recipe.ignore):
        return ModulePlan(**shape, scheme=None, note="ignored by recipe")
    scheme, weights = recipe.scheme, recipe.scheme.weights
    if weights.granularity is not Granularity.GROUP or module.in_features % weights.group_size == 0:
        return ModulePlan(**shape, scheme=scheme)
    smaller = fitting_group_size(module.in_features, weights.group_size)
    if recipe.on_indivisible is IndivisiblePolicy.SMALLER_GROUP and smaller is not None:
        note = f"group size {weights.group_size} -> {smaller} (input size {module.in_features})"
        return ModulePlan(**shape, scheme=scheme.with_group_size(smaller), note=note)
    note = f"left in full precision: group size {weights.group_size} does not divide input size {module.in_features}"
    return ModulePlan(**shape, scheme=None, note=note)


def plan_model(model: nn.Module, recipe: Recipe) -> list[ModulePlan]:
    """One entry per nn.Linear, in module order. Works on a meta-device model (no weights needed).
    A model with weights outside nn.Linear that a recipe should cover (fused MoE experts) is refused: the
    artifact would keep them in full precision and claim to be quantized."""
    check_coverage(model)
    return [plan_module(name, m, recipe) for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def coverage(model: nn.Module, plan: list[ModulePlan]) -> dict:
    """How much of the model the plan quantizes: Linear and all parameters, and every tensor left in full
    precision with the reason. Works on a meta-device model."""
    quantized = {entry.name for entry in plan if entry.quantized}
    notes = {entry.name: entry.note for entry in plan}
    kept, quantized_count = [], 0
    for name, param in model.named_parameters():
        owner, _, kind = name.rpartition(".")
        if owner in quantized and kind == "weight":
            quantized_count += param.numel()
        else:
            kept.append({"tensor": name, "parameters": param.numel(), "reason": _full_precision_reason(owner, kind, param, notes)})
    linear = sum(entry.in_features * entry.out_features for entry in plan)
    total = quantized_count + sum(k["parameters"] for k in kept)
    return {"quantized_parameters": quantized_count, "linear_parameters": linear, "all_parameters": total, "full_precision": kept}


def _full_precision_reason(owner: str, kind: str, param, notes: dict[str, str]) -> str:
    if owner in notes and kind == "weight":
        return notes[owner]  # a Linear the plan leaves out, and why
    if kind == "bias":
        return "a bias (recipes quantize weights)"
    if param.dim() == 1:
        return "a norm or scale vector (not a Linear weight)"
    return "not an nn.Linear weight (e.g. an embedding)"


def fused_parameters(model: nn.Module) -> list[str]:
    """Weight matrices stacked into 3-D (or more) parameters, as transformers 5 stores MoE experts
    (`experts.gate_up_proj` [experts, 2 * intermediate, hidden])."""
    return [name for name, param in model.named_parameters() if param.dim() >= 3]


def check_coverage(model: nn.Module) -> None:
    fused = fused_parameters(model)
    if fused:
        raise UnsupportedModelError(
            f"{type(model).__name__} keeps {len(fused)} weight tensors as fused 3-D parameters ({fused[0]}, ...: MoE "
            "experts), and quantkit quantizes nn.Linear modules only so far; quantizing this model would leave them "
            "in full precision"
        )
