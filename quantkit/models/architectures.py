"""How a decoder layer is wired: the one module that knows module names inside a layer.

Calibration needs facts about a decoder layer that no Linear knows about itself:
- the order its Linears run in, grouped by the input they read (GPTQ's true-sequential stages; Linears that
  read one tensor share one Hessian);
- which op produces each group's input: a norm, or a Linear whose output reaches the group through a
  channel-wise op (SmoothQuant and AWQ fold their scales into it; `scales_fold` runs the layer to check that
  the op in between lets scales through: gate * up does, a non-gated MLP's GELU does not);
- which block's output measures AWQ's error for each group.

Which Linears read the very same tensor is also observed at run time (`calibration.hooks.observe`, by tensor
identity), so the statistics never depend on this table; the table is needed where nothing runs
(`--dry-run`'s plan). Where scales are folded, the names alone are not trusted: `traced_wiring` runs the layer
once and takes as each group's norm the module whose output the group really reads (Gemma2's MLP reads
`pre_feedforward_layernorm`, not the norm the Llama names suggest), and `norm_weight_offset` probes whether a
norm multiplies by its weight or by 1 + weight (Gemma). Known wirings: the layout Llama, Qwen2 and Mistral
layers share; Phi-3's, whose q/k/v and gate/up projections are fused into one Linear each; Starcoder2's, whose
MLP is not gated (c_proj(act(c_fc(x))), LayerNorms with a bias). A new layout is a new `LayerWiring` in `WIRINGS`.
"""

from __future__ import annotations

import re

from dataclasses import dataclass, replace

import torch
from torch import nn

from quantkit.errors import UnsupportedModelError


@dataclass(frozen=True)
class LayerWiring:
    """Module names relative to the decoder layer. The layer computes

        h = h + attention(input_norm(h))              attention ends with o(attention core(q, k, v))
        h = h + mlp(post_attention_norm(h))           mlp = down(act(gate(x)) * up(x)), or down(act(up(x)))
                                                      where there is no gate (a non-gated MLP)

    The norms are where the names say in Llama-style layers; `traced_wiring` replaces them by what the layer
    really feeds its Linears with, or None where no norm does (OLMo2 normalises after attention and MLP, so its
    Linears read the residual stream: nothing to fold scales into)."""

    name: str
    input_norm: str | None
    attention: str
    q: str
    k: str
    v: str
    o: str
    post_attention_norm: str | None
    mlp: str
    gate: str | None
    up: str
    down: str

    @property
    def qkv(self) -> tuple[str, ...]:
        return _unique(self.q, self.k, self.v)  # one name where the projections are fused (Phi-3's qkv_proj)

    @property
    def gate_up(self) -> tuple[str, ...]:
        return _unique(*(name for name in (self.gate, self.up) if name is not None))

    @property
    def stages(self) -> tuple[tuple[str, ...], ...]:
        """The Linears in the order the layer runs them, grouped by shared input."""
        return self.qkv, (self.o,), self.gate_up, (self.down,)

    @property
    def parallel(self) -> bool:
        """Attention and MLP read one norm's output, h + attention(norm(h)) + mlp(norm(h)) (Cohere; traced): one
        scale per channel of that norm serves q/k/v and gate/up alike."""
        return self.input_norm is not None and self.input_norm == self.post_attention_norm

    @property
    def smoothing(self) -> tuple[tuple[str | None, tuple[str, ...]], ...]:
        """(norm, the Linears it feeds): where SmoothQuant folds its scales (no norm: nowhere)."""
        if self.parallel:
            return ((self.input_norm, self.qkv + self.gate_up),)
        return (self.input_norm, self.qkv), (self.post_attention_norm, self.gate_up)

    @property
    def awq_mappings(self) -> tuple[tuple[str | None, tuple[str, ...], str], ...]:
        """(the op feeding the Linears (None: no norm feeds them), the Linears, the block whose output measures the
        error; "" is the whole layer)."""
        v_o = (self.v, (self.o,), self.o)  # skipped by AWQ where v's output is not o's whole input (GQA, fused qkv)
        up_down = (self.up, (self.down,), self.down)  # skipped where up's output reaches down through a non-linear op
        if self.parallel:
            return (self.input_norm, self.qkv + self.gate_up, ""), v_o, up_down
        return (self.input_norm, self.qkv, self.attention), v_o, (self.post_attention_norm, self.gate_up, self.mlp), up_down

    @property
    def parts(self) -> tuple[str, ...]:
        """What a layer must have for this wiring: the blocks and the Linears (the norms are traced)."""
        return (self.attention, self.mlp) + tuple(n for s in self.stages for n in s)

    def missing(self, layer: nn.Module) -> str | None:
        """The first part `layer` lacks, or None if it has them all."""
        for name in self.parts:
            try:
                layer.get_submodule(name)
            except AttributeError:
                return name
        return None


LLAMA = LayerWiring(
    name="Llama-style (Llama, Qwen2, Mistral)",
    input_norm="input_layernorm", attention="self_attn",
    q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
    post_attention_norm="post_attention_layernorm", mlp="mlp",
    gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj",
)
PHI3 = replace(  # the Llama layout with q/k/v fused into one Linear, and gate/up into another
    LLAMA, name="Phi-3-style (fused qkv_proj and gate_up_proj)",
    q="self_attn.qkv_proj", k="self_attn.qkv_proj", v="self_attn.qkv_proj", gate="mlp.gate_up_proj", up="mlp.gate_up_proj",
)
STARCODER2 = replace(  # the Llama layout with a non-gated MLP (and LayerNorms with a bias, Linears with biases)
    LLAMA, name="Starcoder2-style (non-gated MLP c_fc, c_proj)", gate=None, up="mlp.c_fc", down="mlp.c_proj",
)
WIRINGS = (LLAMA, PHI3, STARCODER2)


def _unique(*names: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers at model.<base_model_prefix>.layers (Llama-, Qwen2-, Mistral-style models)."""
    prefix = getattr(model, "base_model_prefix", "model")
    layers = getattr(getattr(model, prefix, None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise UnsupportedModelError(
            f"{type(model).__name__}: calibration needs decoder layers at model.{prefix}"
            ".layers (Llama-, Qwen2-, Mistral-style models); this architecture has none there"
        )
    return layers


def module_name(model: nn.Module, module: nn.Module) -> str:
    """The qualified name of `module` inside `model` (e.g. "model.layers" for the decoder layers)."""
    return next(name for name, candidate in model.named_modules() if candidate is module)


def find_wiring(layer: nn.Module) -> LayerWiring | None:
    """The first known wiring whose every part `layer` has."""
    return next((wiring for wiring in WIRINGS if wiring.missing(layer) is None), None)


def wiring_of(layer: nn.Module) -> LayerWiring:
    """`find_wiring`, or UnsupportedModelError naming what the layer lacks."""
    wiring = find_wiring(layer)
    if wiring is None:
        missing = WIRINGS[0].missing(layer)
        supported = ", ".join(w.name for w in WIRINGS)
        raise UnsupportedModelError(
            f"calibration needs {missing} in each decoder layer ({type(layer).__name__} has none); supported: {supported}"
        )
    return wiring


KV_CACHE_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj", "kv_b_proj")
ROTARY_PROJECTIONS = {"q_proj": "query", "k_proj": "key"}  # the Linears whose output rows RoPE rotates
# An MoE expert's projections by their checkpoint names (Qwen-MoE's, Mixtral's), as the MLP's roles
EXPERT_PROJECTIONS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
EXPERT_NAME = re.compile(r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<projection>[^.]+)$")


def expert_projection(name: str) -> tuple[str, int, str] | None:
    """(the experts module's name, the expert's index, 'gate' / 'up' / 'down') of an MoE expert's Linear, else None."""
    found = EXPERT_NAME.match(name)
    if found is None or found["projection"] not in EXPERT_PROJECTIONS:
        return None
    return f"{found['block']}.experts", int(found["expert"]), EXPERT_PROJECTIONS[found["projection"]]


def rotary_projection(name: str) -> str | None:
    """'query' or 'key' for a Linear whose output RoPE rotates (GGUF reorders its rows for llama.cpp), else None."""
    return ROTARY_PROJECTIONS.get(name.rsplit(".", 1)[-1])
"""An attention module with one of these computes keys and values for a cache (compressed-tensors' names)."""


KERNEL_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"), ("q_a_proj", "kv_a_proj_with_mqa"))
"""Sibling Linears an inference kernel runs as one (vLLM's QKV and gate/up merges, an MoE expert's w1/w3): NVFP4
gives them one weight global scale, as vLLM requires and LLM Compressor does (its FUSED_LAYER_NAMES)."""


def kernel_fused_groups(names: list[str]) -> list[list[str]]:
    """Qualified Linear names grouped as `KERNEL_FUSED` siblings under one parent; every other name alone."""
    groups: dict[tuple[str, int], list[str]] = {}
    alone = []
    for name in names:
        parent, _, leaf = name.rpartition(".")
        index = next((i for i, fused in enumerate(KERNEL_FUSED) if leaf in fused), None)
        if index is None:
            alone.append([name])
        else:
            groups.setdefault((parent, index), []).append(name)
    return list(groups.values()) + alone


def shared_input_leaders(names: list[str]) -> dict[str, str]:
    """For planned Linear names (`model.layers.3.self_attn.q_proj`), the first module of its input-sharing group
    (q/k/v; gate/up; the gates and ups of all of a layer's MoE experts, which calibration runs on every token;
    itself otherwise), as `observe` finds them at run time on these layers; `--dry-run` plans with this before
    any weight is loaded."""
    present = set(names)
    leaders = {name: name for name in names}
    for wiring in WIRINGS:
        for layer in {name.rsplit(".", 2)[0] for name in names}:
            for stage in wiring.stages:
                members = [f"{layer}.{n}" for n in stage if f"{layer}.{n}" in present]
                for name in members:
                    leaders[name] = members[0]
    experts: dict[str, str] = {}  # calibrating, every expert reads every token: one input for all gates and ups
    for name in names:
        found = expert_projection(name)
        shared = SHARED_EXPERT_INPUT.match(name)
        if found is not None and found[2] in ("gate", "up"):
            leaders[name] = experts.setdefault(found[0], name)
        elif shared is not None:  # Qwen2-MoE's shared expert reads the routed experts' input
            leaders[name] = experts.setdefault(f"{shared['block']}.experts", name)
    return leaders


SHARED_EXPERT_INPUT = re.compile(r"^(?P<block>.+)\.shared_expert\.(gate_proj|up_proj)$")


class _Reached(Exception):
    pass


def feeding_modules(layer: nn.Module, call: tuple[tuple, dict], linears: tuple[str, ...]) -> dict[str, str | None]:
    """For each named Linear, the submodule whose output tensor it reads, from one run of the layer on a captured
    (args, kwargs) call; None where its input is computed outside any module (e.g. by the attention core).
    The run stops once every named Linear has received its input."""
    produced: dict[int, tuple[torch.Tensor, str]] = {}  # holds the tensors, so no id is reused meanwhile
    found: dict[str, str | None] = {}

    def record(name):
        def hook(module, args, output):
            if isinstance(output, torch.Tensor):
                produced[id(output)] = (output, name)
        return hook

    def reach(name):
        def hook(module, args):
            hit = produced.get(id(args[0]))
            found[name] = hit[1] if hit is not None and hit[0] is args[0] else None
            if len(found) == len(linears):
                raise _Reached
        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in layer.named_modules() if n]
    handles += [layer.get_submodule(name).register_forward_pre_hook(reach(name)) for name in linears]
    args, kwargs = call
    try:
        with torch.no_grad():
            layer(*args, **kwargs)
    except _Reached:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return {name: found.get(name) for name in linears}


def traced_wiring(layer: nn.Module, call: tuple[tuple, dict]) -> LayerWiring:
    """The layer's wiring with each norm replaced by the module whose output the attention and MLP inputs
    really are (see the module docstring), or None where that is no norm."""
    wiring = wiring_of(layer)
    attention_in, mlp_in = wiring.qkv[0], wiring.gate_up[0]
    fed = feeding_modules(layer, call, (attention_in, mlp_in))
    norms = {linear: name if name is not None and _is_norm(layer.get_submodule(name), layer.get_submodule(linear)) else None
             for linear, name in fed.items()}
    return replace(wiring, input_norm=norms[attention_in], post_attention_norm=norms[mlp_in])


def _is_norm(module: nn.Module, linear: nn.Linear) -> bool:
    """A module with one weight per input channel of `linear` (a norm's scale), so scales can fold into it."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.shape[0] == linear.in_features


def norm_weight_offset(norm: nn.Module) -> float:
    """0 for a norm computing x_hat * weight (+ bias), 1 for one computing x_hat * (1 + weight) (Gemma's RMSNorm):
    scales fold into the first as weight / s (and bias / s), into the second as (1 + weight) / s - 1. Probed with
    weights 0 and -1, the bias (LayerNorm's) held at 0."""
    weight, bias = norm.weight, getattr(norm, "bias", None)
    params = [weight] if bias is None else [weight, bias]
    x = torch.randn(2, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    saved = [p.data.clone() for p in params]
    try:
        with torch.no_grad():
            if bias is not None:
                bias.data.zero_()
            outputs = {}
            for value in (0.0, -1.0):
                weight.data.fill_(value)
                outputs[value] = norm(x)
    finally:
        for param, data in zip(params, saved):
            param.data.copy_(data)
    for offset, value in ((0.0, 0.0), (1.0, -1.0)):
        if not outputs[value].abs().max():
            return offset
    raise UnsupportedModelError(f"{type(norm).__name__}: scales cannot be folded into this norm's weight")


def scales_fold(layer: nn.Module, call: tuple[tuple, dict], prev: str, linears: tuple[str, ...]) -> bool:
    """Whether scales fold between the Linear `prev` and the Linears it feeds: with prev's output channels
    divided by s and their input columns multiplied by s, the layer's output on a captured (args, kwargs) call is
    unchanged bit for bit. s are powers of two, so a channel-wise op in between (gate * up, attention's weighted
    sum of v, a ReLU) gives the very same floats; a non-linear one (a non-gated MLP's GELU) does not."""
    source, fed = layer.get_submodule(prev), [layer.get_submodule(name) for name in linears]
    params = [p for p in (source.weight, source.bias, *(m.weight for m in fed)) if p is not None]
    saved = [p.data.clone() for p in params]
    exponents = torch.randint(-1, 2, (source.out_features,), generator=torch.Generator().manual_seed(0))
    scales = torch.pow(2.0, exponents.double()).to(source.weight.device, source.weight.dtype)
    args, kwargs = call
    try:
        with torch.no_grad():
            reference = _hidden(layer(*args, **kwargs))
            source.weight.div_(scales.reshape(-1, 1))
            if source.bias is not None:
                source.bias.div_(scales)
            for module in fed:
                module.weight.mul_(scales)
            return torch.equal(_hidden(layer(*args, **kwargs)), reference)
    finally:
        for param, data in zip(params, saved):
            param.data.copy_(data)


def _hidden(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


# ---------------------------------------------------------------- the residual stream (fused rotations)


DOWN_LEAVES = ("down_proj", "w2", "c_proj")  # an MLP's (or an expert's) Linear writing to the residual stream
FINAL_NORM = "norm"  # on the module holding the decoder layers: the norm before lm_head


@dataclass(frozen=True)
class ResidualModules:
    """Where a pre-norm decoder layer reads and writes the residual stream, h + attention(norm(h)) +
    mlp(norm'(h)), by names relative to the layer: what a rotation of the stream (R1) and of each head's values
    (R2) touch (`quant.rotations`). `value_rows` is the first row of the values in `values` (fused qkv: after the
    queries and keys)."""

    attention_norm: str
    attention_readers: tuple[str, ...]
    attention_writer: str
    mlp_norm: str
    mlp_readers: tuple[str, ...]  # every weight reading the norm's output: gate/up, an MoE router, experts' w1/w3
    mlp_writers: tuple[str, ...]  # down, every expert's down
    values: str
    value_rows: int


def residual_modules(layer: nn.Module, hidden: int, value_rows: int = 0) -> ResidualModules:
    """The layer's `ResidualModules`, or UnsupportedModelError saying why a rotation cannot keep its function:
    a norm inside a block (Gemma2's and OLMo2's post-norms), a LayerNorm (its mean does not commute with a
    rotation), a weight of the MLP whose role in the stream is unknown."""
    wiring = next((w for w in WIRINGS if all(has_submodule(layer, n) for n in (w.attention, w.q, w.k, w.v, w.o))), None)
    what = type(layer).__name__
    if wiring is None or not has_submodule(layer, LLAMA.mlp):
        raise UnsupportedModelError(f"rotations need Llama-style decoder layers (self_attn with q/k/v/o projections, an mlp); "
                                    f"{what} has another layout")
    norms = [name for name, module in layer.named_modules() if name and _hidden_vector(module, hidden)]
    expected = [n for n in (wiring.input_norm, wiring.post_attention_norm) if n]
    extra = [n for n in norms if n not in expected]
    if extra or any(n not in norms for n in expected):
        where = extra[0] if extra else next(n for n in expected if n not in norms)
        raise UnsupportedModelError(f"rotations need pre-norm decoder layers (a norm before attention and one before the MLP, "
                                    f"nothing else): {what} {'has ' + where if extra else 'lacks ' + where}")
    for name in expected:
        norm = layer.get_submodule(name)
        if getattr(norm, "bias", None) is not None or isinstance(norm, nn.LayerNorm):
            raise UnsupportedModelError(f"rotations need RMS norms; {what}.{name} is a {type(norm).__name__}, whose mean "
                                        "subtraction a rotation does not commute with")
    mlp = layer.get_submodule(LLAMA.mlp)
    readers, writers = [], []
    for name, param in mlp.named_parameters():
        if param.dim() > 2:
            raise UnsupportedModelError(f"rotations: {what}.{LLAMA.mlp}.{name} holds experts fused ({tuple(param.shape)}); "
                                        "split them first (`moe.linearize`)")
    for name, module in mlp.named_modules():
        weight = module._parameters.get("weight") if name else None
        if weight is None or weight.dim() != 2:
            continue
        qualified = f"{LLAMA.mlp}.{name}"
        if name.rsplit(".", 1)[-1] in DOWN_LEAVES and weight.shape[0] == hidden:
            writers.append(qualified)
        elif weight.shape[1] == hidden:
            readers.append(qualified)
        else:
            raise UnsupportedModelError(f"rotations: {what}.{qualified} ({tuple(weight.shape)}) neither reads nor writes the "
                                        "residual stream as quantkit knows the MLP's modules")
    if not readers or not writers:
        raise UnsupportedModelError(f"rotations: {what}'s MLP has no Linear reading or writing the residual stream")
    return ResidualModules(wiring.input_norm, wiring.qkv, wiring.o, wiring.post_attention_norm, tuple(readers),
                           tuple(writers), wiring.v, value_rows if wiring.v == wiring.q else 0)


def has_submodule(layer: nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name)
    except AttributeError:
        return False
    return True


def _hidden_vector(module: nn.Module, hidden: int) -> bool:
    """A norm-like module of the stream: its own 1-D weight of the hidden size."""
    weight = module._parameters.get("weight")
    return weight is not None and weight.dim() == 1 and weight.shape[0] == hidden


def final_norm(layers_parent: nn.Module) -> nn.Module:
    """The norm between the last decoder layer and lm_head (Llama-style models: `model.norm`)."""
    norm = getattr(layers_parent, FINAL_NORM, None)
    if not isinstance(norm, nn.Module) or norm._parameters.get("weight") is None:
        raise UnsupportedModelError(f"rotations: {type(layers_parent).__name__} has no final norm at .{FINAL_NORM}")
    return norm
