"""One pass per decoder layer for GPTQ: quantize its Linear modules stage by stage, in the order they run.

A Llama-, Qwen2- or Mistral-style decoder layer computes

    h = h + self_attn(input_layernorm(h))          self_attn ends with o_proj(attention(q, k, v))
    h = h + mlp(post_attention_layernorm(h))       mlp = down_proj(act(gate_proj(x)) * up_proj(x))

`run_stages` walks the calibration batches through the layer in four stages: q/k/v (input: the normed h),
o_proj, gate/up (the normed h after attention) and down_proj. Each stage's inputs come from the stages before
it, already quantized, and `quantize(stage, inputs)` quantizes the stage's modules before the next one runs.
Every Linear thus runs once, on its quantized weights, and the layer's output is the quantized layer's
output: one forward pass per layer where observing the float layer and then propagating through the quantized
one takes two. This is GPTQ's "true sequential" order (the GPTQ reference code and AutoGPTQ default to it):
each module's Hessian sees the quantization error of the modules upstream in its own layer.

`matches_layer` checks on one sample that the staged computation with the layer's own weights reproduces
the layer's forward bit for bit; the pipeline uses stages only when it does.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

STAGES = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp") + tuple(n for s in STAGES for n in s)


class _Stop(Exception):
    pass


def has_stages(layer: nn.Module) -> bool:
    """The layer has every part `run_stages` uses (the names Llama, Qwen2 and Mistral layers share)."""
    try:
        return all(isinstance(layer.get_submodule(name), nn.Module) for name in _PARTS)
    except AttributeError:
        return False


def split_call(args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict] | None:
    """(hidden states, the other keyword arguments) of a captured layer call; None if it has other positionals."""
    if len(args) == 1 and "hidden_states" not in kwargs:
        return args[0], kwargs
    if not args and "hidden_states" in kwargs:
        rest = dict(kwargs)
        return rest.pop("hidden_states"), rest
    return None


def run_stages(layer: nn.Module, calls: list[tuple[torch.Tensor, dict]],
               quantize: Callable[[tuple[str, ...], list[torch.Tensor]], None]) -> list[torch.Tensor]:
    """The layer's outputs for each (hidden states, kwargs) call, quantizing stage by stage (see the module
    docstring). `quantize(stage, inputs)` gets the stage's module names and their input for every batch."""
    attn, mlp = layer.self_attn, layer.mlp
    with torch.no_grad():
        hidden = [h for h, _ in calls]
        normed = [layer.input_layernorm(h) for h in hidden]
        quantize(STAGES[0], normed)
        attended = [_input_of(attn.o_proj, lambda x=x, kw=kw: attn(hidden_states=x, **kw)) for x, (_, kw) in zip(normed, calls)]
        del normed
        quantize(STAGES[1], attended)
        hidden = [h + attn.o_proj(a) for h, a in zip(hidden, attended)]
        del attended
        normed = [layer.post_attention_layernorm(h) for h in hidden]
        quantize(STAGES[2], normed)
        activated = [_input_of(mlp.down_proj, lambda x=x: mlp(x)) for x in normed]
        del normed
        quantize(STAGES[3], activated)
        return [h + mlp.down_proj(a) for h, a in zip(hidden, activated)]


def matches_layer(layer: nn.Module, call: tuple[torch.Tensor, dict]) -> bool:
    """Whether the staged computation (nothing quantized) equals the layer's own forward, bit for bit, on the
    first sample of `call`."""
    hidden, kwargs = call
    sample = (hidden[:1], kwargs)
    with torch.no_grad():
        out = layer(sample[0], **kwargs)
        reference = out[0] if isinstance(out, tuple) else out
        try:
            staged = run_stages(layer, [sample], lambda stage, inputs: None)[0]
        except Exception:  # noqa: BLE001 - any mismatch in structure means: not this layer shape
            return False
    return staged.shape == reference.shape and torch.equal(staged, reference)


def _input_of(module: nn.Module, run: Callable[[], object]) -> torch.Tensor:
    """The input `module` receives when `run()` runs; `run` stops right there (the module never computes)."""
    captured: list[torch.Tensor] = []

    def hook(_, args):
        captured.append(args[0])
        raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        run()
    except _Stop:
        pass
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"{type(module).__name__} was never called")
    return captured[0]
