"""Mixture-of-experts layers: transformers 5's fused experts as one nn.Linear per expert projection.

transformers 5 keeps a sparse MoE block's experts as two 3-D parameters, gate and up stacked in one
[experts, 2 * intermediate, hidden] and the down projection in one [experts, hidden, intermediate] (Mixtral,
Qwen2-MoE, Qwen3-MoE, ...), while checkpoints, compressed-tensors and vLLM keep one Linear per expert
projection (`experts.3.w1`, `experts.3.gate_proj`, ...). `linearize` replaces each fused experts module by
`LinearExperts`: one `Expert` of three Linears per expert, named as the checkpoint names them, computing what
the fused module computes. The names come from transformers' own conversion mapping (the table its loader
merges per-expert checkpoint keys with), so the written keys are the ones it loads back. Everything built on
Linear modules (plan, RTN, GPTQ, AWQ, SmoothQuant, static scales, the exporters) then handles experts as is.

Around the experts, an MoE block has modules that stay in full precision (`gates`): the router and, in
Qwen2-MoE, the shared expert's sigmoid gate; vLLM serves them unquantized. AWQ and SmoothQuant fold their
scales into the norm the block reads, so these modules' weights are scaled along (`MoEWiring`).
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, replace
from typing import Iterator

import torch
from torch import nn

from quantkit.errors import UnsupportedModelError
from quantkit.models import compat
from quantkit.models.architectures import LLAMA, WIRINGS, LayerWiring, feeding_modules, has_submodule

GATE_NOTE = "an MoE router or gate (kept in full precision; vLLM serves them unquantized)"
# What `use_experts_implementation` must say of a fused experts class for `LinearExperts` to compute the same:
# gate and up concatenated (not interleaved), [out, in] weights, no bias, the default act(gate) * up.
_FUSED_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                 "has_post_expert_norm": False}


class Expert(nn.Module):
    """One expert's three projections, as Linears under the checkpoint's names (gate, up, down)."""

    def __init__(self, names: tuple[str, str, str], weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        super().__init__()
        self.names = names
        for name, weight in zip(names, weights):
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
            linear.weight = nn.Parameter(weight, requires_grad=False)
            self.add_module(name, linear)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return tuple(self._modules[name] for name in self.names)


class LinearExperts(nn.Module):
    """A fused experts module as one `Expert` per expert (children "0", "1", ...): the same call
    (hidden states [tokens, hidden], top-k expert indices and weights [tokens, k]) and the same output.

    With `all_tokens` set (calibration, `calibration.experts.calibrating`), every expert runs on every token, so
    each Linear's input statistics cover all of them; the output still sums only the routed experts' rows."""

    def __init__(self, names: tuple[str, str, str], gate_up: torch.Tensor, down: torch.Tensor, act_fn: nn.Module):
        super().__init__()
        inter = gate_up.shape[1] // 2
        for index, (stacked, down_weight) in enumerate(zip(gate_up, down)):
            self.add_module(str(index), Expert(names, (stacked[:inter], stacked[inter:], down_weight)))
        self.num_experts = gate_up.shape[0]
        self.names = names
        self.act_fn = act_fn
        self.all_tokens = False

    def expert(self, index: int) -> Expert:
        return self._modules[str(index)]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():  # the fused eager forward's bookkeeping, index for index (so its sums, in its order)
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        for index in range(self.num_experts):
            top_k_pos, token_idx = torch.where(mask[index])
            if self.all_tokens:
                routed = self._run(index, hidden_states)[token_idx]
            elif token_idx.numel():
                routed = self._run(index, hidden_states[token_idx])
            else:
                continue
            routed = routed * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, routed.to(out.dtype))
        return out

    def _run(self, index: int, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.expert(index).projections()
        return down(self.act_fn(gate(x)) * up(x))


def linearize(model: nn.Module) -> nn.Module:
    """Replace (in place) every fused experts module of `model` by the equivalent `LinearExperts`; the experts'
    Linears share the fused tensors' memory. Works on a meta-device skeleton too. UnsupportedModelError for
    fused experts whose layout is not the one `LinearExperts` computes."""
    layouts = None
    for name, module in list(model.named_modules()):
        fused = {n: p for n, p in module.named_parameters(recurse=False) if p.dim() >= 3}
        if not fused:
            continue
        layouts = layouts if layouts is not None else _checkpoint_layouts(model)
        gate_up, down, names = _expert_layout(name, module, fused, layouts)
        experts = LinearExperts(names, gate_up.data, down.data, module.act_fn)
        if gate_up.device.type != "meta":
            _check_equivalent(module, experts, name)
        model.set_submodule(name, experts)
    return model


def _checkpoint_layouts(model: nn.Module) -> list[tuple[str, list[str], list[tuple[str, int]]]]:
    """transformers' conversions that merge per-expert checkpoint weights into a fused parameter, as
    (fused parameter suffix, per-expert projection names in merge order, (operation, dim) list)."""
    layouts = []
    for conversion in filter(compat.is_weight_converter, compat.weight_conversions(model)):
        source_patterns, target_patterns, operations = compat.converter_layout(conversion)
        sources = [re.search(r"\.\*\.(\w+)\.weight$", s) for s in source_patterns]
        if len(target_patterns) == 1 and all(sources):
            layouts.append((target_patterns[0].lstrip("."), [s.group(1) for s in sources], operations))
    return layouts


def _expert_layout(name: str, module: nn.Module, fused: dict[str, nn.Parameter], layouts) -> tuple[nn.Parameter, nn.Parameter, tuple[str, str, str]]:
    """(stacked gate/up, down, the per-expert (gate, up, down) names) of a fused experts module."""
    merged = {}
    for param in fused:
        found = [(sources, ops) for suffix, sources, ops in layouts if f"{name}.{param}".endswith("." + suffix)]
        if found:
            merged[param] = found[0]
    gate_up = [p for p, (sources, ops) in merged.items() if ops == [("MergeModulelist", 0), ("Concatenate", 1)] and len(sources) == 2]
    down = [p for p, (sources, ops) in merged.items() if ops == [("MergeModulelist", 0)] and len(sources) == 1]
    odd = [flag for flag, value in _FUSED_LAYOUT.items() if getattr(module, flag, value) != value]
    if getattr(getattr(type(module), "_apply_gate", None), "__name__", "_default_apply_gate") != "_default_apply_gate":
        odd.append("its own _apply_gate")
    if len(gate_up) != 1 or len(down) != 1 or len(fused) != 2 or odd or not hasattr(module, "act_fn"):
        why = f"layout flags {odd}" if odd else "no per-expert gate/up and down checkpoint layout in transformers' conversion mapping"
        raise UnsupportedModelError(
            f"{name} ({type(module).__name__}) keeps its experts as fused parameters {sorted(fused)} that quantkit cannot "
            f"split into per-expert Linear modules ({why}); quantizing it would leave them in full precision"
        )
    (gate, up), (down_name,) = merged[gate_up[0]][0], merged[down[0]][0]
    return fused[gate_up[0]], fused[down[0]], (gate, up, down_name)


def _check_equivalent(fused: nn.Module, experts: LinearExperts, name: str) -> None:
    """The per-expert module computes what the fused one does, on a few random tokens routed at random."""
    weight = experts.expert(0).projections()[0].weight
    generator = torch.Generator().manual_seed(0)
    tokens, k = 8, min(2, experts.num_experts)
    x = torch.randn(tokens, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    index = torch.stack([torch.randperm(experts.num_experts, generator=generator)[:k] for _ in range(tokens)]).to(weight.device)
    scores = torch.rand(tokens, k, generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        reference, ours = fused(x, index, scores).float(), experts(x, index, scores).float()
    if not (ours - reference).norm() <= 1e-2 * reference.norm():
        raise UnsupportedModelError(f"{name} ({type(fused).__name__}): its experts split into per-expert Linear modules "
                                    "do not compute what the fused module does; quantkit cannot quantize this model's experts")


def checkpoint_names(model: nn.Module, names: list[str]) -> dict[str, str]:
    """Each of `model`'s tensor names (per-expert ones included) as its checkpoint names it: transformers renames
    some while loading (Mixtral's `block_sparse_moe` is `mlp` in the model) and back while saving."""
    rename = checkpoint_renamer(model)
    return {name: rename(name) for name in names}


def checkpoint_renamer(model: nn.Module):
    """`checkpoint_names` for one name at a time, the conversion mapping looked up once (for a writer that names
    every tensor it writes)."""
    return compat.checkpoint_renamer(model)


@contextlib.contextmanager
def real_routing(module: nn.Module) -> Iterator[None]:
    """The experts inside `module` run on their routed tokens only, whatever `all_tokens` says: for runs that
    need the block's output and no statistics (AWQ's candidate scores), which all tokens would make
    experts / top-k times slower."""
    experts = [m for m in module.modules() if isinstance(m, LinearExperts)]
    saved = [m.all_tokens for m in experts]
    for m in experts:
        m.all_tokens = False
    try:
        yield
    finally:
        for m, value in zip(experts, saved):
            m.all_tokens = value


def experts_modules(model: nn.Module) -> dict[str, LinearExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LinearExperts)}


def expert_linears(model: nn.Module) -> list[str]:
    """The qualified names of every expert projection (Linear) of `model`, in module order."""
    return [f"{name}.{local}" for name, experts in experts_modules(model).items()
            for local, m in experts.named_modules() if isinstance(m, nn.Linear)]


def expert_input_divisor(model: nn.Module) -> int | None:
    """The largest size dividing every expert projection's input size (hidden and intermediate): the experts
    get one group size, which must divide it (transformers dequantizes all experts with one scheme, and vLLM
    runs each MoE block's experts with one kernel)."""
    sizes = [model.get_submodule(name).in_features for name in expert_linears(model)]
    return math.gcd(*sizes) if sizes else None


def gates(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of each MoE block, besides the experts, that read the block's input with one weight of their
    own (the router; Qwen2-MoE's shared-expert gate), by qualified name. A shared expert (a module of Linears)
    is not one of them: it is an MLP and is quantized like one."""
    found = {}
    for name in experts_modules(model):
        block_name = name.rpartition(".")[0]
        for child, module in model.get_submodule(block_name).named_children():
            if not isinstance(module, LinearExperts) and isinstance(getattr(module, "weight", None), torch.Tensor):
                found[f"{block_name}.{child}" if block_name else child] = module
    return found


def expert_pattern(model: nn.Module) -> str | None:
    """A compressed-tensors `re:` target matching every expert projection, in this model and in its checkpoint
    (where Mixtral's block is `block_sparse_moe`, not `mlp`); its `experts` word is how transformers finds the
    experts' scheme in a mixed config."""
    modules = experts_modules(model)
    if not modules:
        return None
    local = sorted({name.rpartition(".")[2] for name in modules})
    names = sorted({n for m in modules.values() for n in m.names})
    return rf"re:.*\.({'|'.join(map(re.escape, local))})\.\d+\.({'|'.join(map(re.escape, names))})$"


@dataclass(frozen=True)
class MoEWiring:
    """How a decoder layer whose MLP is a sparse MoE block is wired, as `LayerWiring` says it for dense layers
    (module names relative to the layer):

        h = h + attention(input_norm(h))           as in the dense wiring (`attention`)
        x = norm(h)                                read by the router, every expert's gate and up, a shared
        h = h + block(x)                           expert's gate and up, and the shared-expert gate
        expert(x) = down(act(gate(x)) * up(x))     for each expert, and for a shared expert

    `smoothing` and `awq_mappings` have LayerWiring's shape; the modules in `gates` are listed with the Linears
    that share their input, after them: they stay in full precision, their weights only take the folded scales."""

    attention: LayerWiring  # its attention half (input norm traced) is this layer's; its MLP names are not used
    norm: str | None  # the module whose output the block reads, if it is a norm
    block: str
    inputs: tuple[str, ...]  # the quantized Linears reading the block's input
    gates: tuple[str, ...]
    pairs: tuple[tuple[str, str], ...]  # (up, down) of every expert and of a shared expert

    @property
    def smoothing(self) -> tuple[tuple[str | None, tuple[str, ...]], ...]:
        return self.attention.smoothing[0], (self.norm, self.inputs + self.gates)

    @property
    def awq_mappings(self) -> tuple[tuple[str | None, tuple[str, ...], str], ...]:
        first, second = self.attention.awq_mappings[:2]
        return (first, second, (self.norm, self.inputs + self.gates, self.block),
                *((up, (down,), down) for up, down in self.pairs))


def is_moe_layer(layer: nn.Module) -> bool:
    return any(isinstance(m, LinearExperts) for m in layer.modules())


def traced_moe_wiring(layer: nn.Module, call: tuple[tuple, dict]) -> MoEWiring:
    """The MoE layer's wiring, with the norms its attention and its MoE block really read (from one run of the
    layer on a captured call, as `architectures.traced_wiring` finds them for dense layers)."""
    attention = next((w for w in WIRINGS if all(has_submodule(layer, n) for n in (w.attention, *w.qkv, w.o))), None)
    (experts_name, experts), *more = experts_modules(layer).items()
    if attention is None or more:
        raise UnsupportedModelError(f"{type(layer).__name__}: calibration knows MoE layers with Llama-style attention "
                                    "and one MoE block")
    block = experts_name.rpartition(".")[0]
    fed = feeding_modules(layer, call, (attention.q, block))
    norms = {user: name if name is not None and _is_norm(layer.get_submodule(name), layer.get_submodule(user)) else None
             for user, name in fed.items()}
    inputs, pairs = [], []
    for index in range(experts.num_experts):
        gate, up, down = (f"{experts_name}.{index}.{n}" for n in experts.names)
        inputs += [gate, up]
        pairs.append((up, down))
    for gate, up, down in _shared_experts(layer, block):
        inputs += [gate, up]
        pairs.append((up, down))
    gate_names = tuple(f"{block}.{name}" for name in gates(layer.get_submodule(block)))
    return MoEWiring(attention=replace(attention, input_norm=norms[attention.q]), norm=norms[block], block=block,
                     inputs=tuple(inputs), gates=gate_names, pairs=tuple(pairs))


def _shared_experts(layer: nn.Module, block: str) -> list[tuple[str, str, str]]:
    """(gate, up, down) of each child of the block that is an MLP named like the dense wiring's (Qwen2-MoE's
    shared expert)."""
    relative = [name.removeprefix(LLAMA.mlp + ".") for name in (LLAMA.gate, LLAMA.up, LLAMA.down)]
    found = []
    for child, module in layer.get_submodule(block).named_children():
        if not isinstance(module, LinearExperts) and all(isinstance(getattr(module, n, None), nn.Linear) for n in relative):
            found.append(tuple(f"{block}.{child}.{n}" for n in relative))
    return found


def _is_norm(module: nn.Module, reader: nn.Module) -> bool:
    """A module with one weight per input channel of what reads it (a norm's scale): scales can fold into it."""
    weight = getattr(module, "weight", None)
    width = reader.in_features if isinstance(reader, nn.Linear) else None
    if width is None:  # the MoE block: its experts' input width
        width = next(m.in_features for m in reader.modules() if isinstance(m, nn.Linear))
    return isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.shape[0] == width
