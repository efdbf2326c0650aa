"""Which Linear modules a recipe quantizes, and with which group size.

Policy for a Linear whose input size the recipe's group size does not divide (`on_indivisible`):
`smaller-group` halves the group size until it divides (down to 16) and reports the change;
if no such size exists, or the policy is `skip`, the layer stays in full precision and is reported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from quantkit.errors import UnsupportedModelError, UsageError
from quantkit.models import moe
from quantkit.quant.registry import IndivisiblePolicy, Recipe
from quantkit.grids.schemes import Granularity, QuantScheme

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


def plan_module(name: str, module: nn.Linear, recipe: Recipe, width: int | None = None) -> ModulePlan:
    """`width`: the size the group size must divide, when it is not the module's own input size (MoE experts:
    one group size for all of them, `moe.expert_input_divisor`)."""
    shape = dict(name=name, in_features=module.in_features, out_features=module.out_features)
    if is_ignored(name, recipe.ignore):
        return ModulePlan(**shape, scheme=None, note="ignored by recipe")
    scheme, weights = recipe.scheme, recipe.scheme.weights
    width = width or module.in_features
    acts = scheme.activations
    if acts is not None and acts.granularity is Granularity.GROUP and module.in_features % acts.group_size:
        return ModulePlan(**shape, scheme=None, note=f"left in full precision: activation group size {acts.group_size} does not divide input size {module.in_features}")
    if weights.granularity is Granularity.BLOCK:
        if width % weights.block_shape[1] == 0:
            return ModulePlan(**shape, scheme=scheme)
        return ModulePlan(**shape, scheme=None, note=f"left in full precision: block width {weights.block_shape[1]} does not divide input size {width}")
    if weights.granularity is not Granularity.GROUP or width % weights.group_size == 0:
        return ModulePlan(**shape, scheme=scheme)
    smaller = fitting_group_size(width, weights.group_size) if weights.group_size_adjustable else None
    size = f"input size {module.in_features}" + (f"; one group size for all MoE experts, dividing {width}" if width != module.in_features else "")
    if recipe.on_indivisible is IndivisiblePolicy.SMALLER_GROUP and smaller is not None:
        note = f"group size {weights.group_size} -> {smaller} ({size})"
        return ModulePlan(**shape, scheme=scheme.with_group_size(smaller), note=note)
    note = f"left in full precision: group size {weights.group_size} does not divide {size}"
    return ModulePlan(**shape, scheme=None, note=note)


def with_tensor_type(entry: ModulePlan, recipe: Recipe) -> ModulePlan:
    """The entry under the recipe's per-tensor override that matches it last (`quant.tensor_types`), if any: any
    Linear but an MoE router, `ignore`d ones too; `float` leaves it in full precision. The format's exporter applies
    it (`adapt_plan`), and checks the scheme is one it holds."""
    from dataclasses import replace

    from quantkit.grids.schemes import QuantScheme
    from quantkit.quant import tensor_types
    from quantkit.quant.registry import tensor_type_spec

    kind = tensor_types.type_for(tensor_types.names_of(entry.name), recipe.tensor_types)
    if kind is None or entry.note == moe.GATE_NOTE:
        return entry
    weights = tensor_type_spec(kind)
    if weights is None:
        return replace(entry, scheme=None, note=f"left in full precision by tensor type {kind}")
    return replace(entry, scheme=QuantScheme(weights, recipe.scheme.activations), note="")


def plan_model(model: nn.Module, recipe: Recipe) -> list[ModulePlan]:
    """One entry per nn.Linear, in module order. Works on a meta-device model (no weights needed).
    A model with weights outside nn.Linear that a recipe should cover (fused MoE experts not yet split by
    `moe.linearize`) is refused: the artifact would keep them in full precision and claim to be quantized.
    MoE experts share one scheme, and a recipe leaving any of them in full precision is refused; MoE routers
    and gates stay in full precision."""
    check_coverage(model)
    experts, gates = set(moe.expert_linears(model)), set(moe.gates(model))
    width = moe.expert_input_divisor(model)
    plan = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name in gates:
            plan.append(ModulePlan(name, m.in_features, m.out_features, scheme=None, note=moe.GATE_NOTE))
        elif isinstance(m, nn.Linear):
            plan.append(plan_module(name, m, recipe, width if name in experts else None))
    check_experts(plan, experts, recipe)
    return plan


def check_experts(plan: list[ModulePlan], experts: set[str], recipe: Recipe) -> None:
    """Every MoE expert projection is quantized: a recipe that skips some covers less than it claims."""
    left = [entry for entry in plan if entry.name in experts and not entry.quantized]
    if left:
        raise UsageError(
            f"recipe '{recipe.name}' would leave {len(left)} of {len(experts)} MoE expert projections in full precision "
            f"({left[0].name}: {left[0].note}); experts are quantized all alike: take them out of the recipe's `ignore`, "
            "or use per-channel weights or a group size that divides every expert's input size"
        )


def coverage(model: nn.Module, plan: list[ModulePlan], stored: dict[str, str] | None = None) -> dict:
    """How much of the model the artifact holds quantized: Linear and all parameters, and every tensor left in full
    precision with the reason. `stored`: parameters outside the plan that the format quantizes itself, by name, with
    the type it stores them in (GGUF: a mixture's token embedding, `gguf.quantized_tensors`); they count as
    quantized, and are listed in `quantized_by_format` with their type. Works on a meta-device model."""
    quantized = {entry.name for entry in plan if entry.quantized}
    notes = {entry.name: entry.note for entry in plan}
    stored = stored or {}
    kept, by_format, linear_count = [], [], 0
    notes.update({name: moe.GATE_NOTE for name in moe.gates(model)})
    for name, param in model.named_parameters():
        owner, _, kind = name.rpartition(".")
        if owner in quantized and kind == "weight":
            linear_count += param.numel()
        elif name in stored:
            by_format.append({"tensor": name, "parameters": param.numel(), "type": stored[name]})
        else:
            kept.append({"tensor": name, "parameters": param.numel(), "reason": _full_precision_reason(owner, kind, param, notes)})
    unknown = set(stored) - {t["tensor"] for t in by_format}
    if unknown:
        raise ValueError(f"coverage: {sorted(unknown)} are not parameters of the model, or are planned Linear weights")
    linear = sum(entry.in_features * entry.out_features for entry in plan)
    quantized_count = linear_count + sum(t["parameters"] for t in by_format)
    total = quantized_count + sum(k["parameters"] for k in kept)
    return {"quantized_parameters": quantized_count, "quantized_linear_parameters": linear_count,
            "linear_parameters": linear, "all_parameters": total, "quantized_by_format": by_format, "full_precision": kept}


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
            "experts), and quantkit quantizes nn.Linear modules; `quantkit.models.moe.linearize(model)` splits the experts of "
            "transformers' MoE models into per-expert Linear modules first (finalize does), else this model would keep "
            "them in full precision"
        )
