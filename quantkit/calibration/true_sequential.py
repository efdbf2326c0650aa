"""One pass per decoder layer for GPTQ: quantize its Linear modules stage by stage, in the order they run.

A decoder layer with a known wiring (`quantkit.models.architectures.LayerWiring`) computes

    h = h + attention(input_norm(h))               attention ends with o(attention core(q, k, v))
    h = h + mlp(post_attention_norm(h))            mlp = down(act(gate(x)) * up(x)), or down(act(up(x)))

`run_stages` walks the calibration batches through the layer in the wiring's four stages: q/k/v (input: the
normed h), o, gate/up (the normed h after attention) and down. Each stage's inputs come from the stages before
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

from quantkit.calibration.hooks import Stop
from quantkit.models.architectures import LayerWiring


def split_call(args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict] | None:
    """(hidden states, the other keyword arguments) of a captured layer call; None if it has other positionals."""
    if len(args) == 1 and "hidden_states" not in kwargs:
        return args[0], kwargs
    if not args and "hidden_states" in kwargs:
        rest = dict(kwargs)
        return rest.pop("hidden_states"), rest
    return None


def run_stages(layer: nn.Module, wiring: LayerWiring, calls: list[tuple[torch.Tensor, dict]],
               quantize: Callable[[tuple[str, ...], list[torch.Tensor]], None]) -> list[torch.Tensor]:
    """The layer's outputs for each (hidden states, kwargs) call, quantizing stage by stage (see the module
    docstring). `quantize(stage, inputs)` gets the stage's module names and their input for every batch."""
    part = layer.get_submodule
    attn, mlp, o, down = part(wiring.attention), part(wiring.mlp), part(wiring.o), part(wiring.down)
    qkv, _, gate_up, _ = wiring.stages
    with torch.no_grad():
        hidden = [h for h, _ in calls]
        normed = [part(wiring.input_norm)(h) for h in hidden]
        quantize(qkv, normed)
        attended = [_input_of(o, lambda x=x, kw=kw: attn(hidden_states=x, **kw)) for x, (_, kw) in zip(normed, calls)]
        del normed
        quantize((wiring.o,), attended)
        hidden = [h + o(a) for h, a in zip(hidden, attended)]
        del attended
        normed = [part(wiring.post_attention_norm)(h) for h in hidden]
        quantize(gate_up, normed)
        activated = [_input_of(down, lambda x=x: mlp(x)) for x in normed]
        del normed
        quantize((wiring.down,), activated)
        return [h + down(a) for h, a in zip(hidden, activated)]


def matches_layer(layer: nn.Module, wiring: LayerWiring, call: tuple[torch.Tensor, dict]) -> bool:
    """Whether the staged computation (nothing quantized) equals the layer's own forward, bit for bit, on the
    first sample of `call`."""
    hidden, kwargs = call
    sample = (hidden[:1], kwargs)
    try:  # a layer whose other arguments do not fit one sample (Gemma2's mask) or the stages: not this shape
        with torch.no_grad():
            out = layer(sample[0], **kwargs)
            reference = out[0] if isinstance(out, tuple) else out
            staged = run_stages(layer, wiring, [sample], lambda stage, inputs: None)[0]
    except Exception:  # noqa: BLE001 - any failure means: not a layer the stages reproduce
        return False
    return staged.shape == reference.shape and torch.equal(staged, reference)


def _input_of(module: nn.Module, run: Callable[[], object]) -> torch.Tensor:
    """The input `module` receives when `run()` runs; `run` stops right there (the module never computes)."""
    captured: list[torch.Tensor] = []

    def hook(_, args):
        captured.append(args[0])
        raise Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        run()
    except Stop:
        pass
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"{type(module).__name__} was never called")
    return captured[0]
