"""One pass per decoder layer for GPTQ: quantize its Linear modules stage by stage, in the order they run.

A decoder layer with a known wiring (`quantkit.models.architectures.LayerWiring`) computes

    h = h + attention(input_norm(h))               attention ends with o(attention core(q, k, v))
    h = h + mlp(post_attention_norm(h))            mlp = down(act(gate(x)) * up(x)), or down(act(up(x)))

`run_stages` walks the calibration batches through the layer in the wiring's four stages: q/k/v (input: the
normed h), o, gate/up (the normed h after attention) and down. Each stage's inputs come from the stages before
it, already quantized, and `quantize(stage, inputs)` quantizes the stage's modules before the next one runs.
Every Linear thus runs on its quantized weights, and the layer's output is the quantized layer's output: one
staged pass per layer (attention and the gate/up projections run twice in it, `run_stages` says why) where
observing the float layer and then propagating through the quantized one takes two. This is GPTQ's "true sequential" order (the GPTQ reference code and AutoGPTQ default to it):
each module's Hessian sees the quantization error of the modules upstream in its own layer.

`matches_layer` checks on one sample that the staged computation with the layer's own weights reproduces
the layer's forward bit for bit; the pipeline uses stages only when it does.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from quantkit.calibration import offload
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
               quantize: Callable[[tuple[str, ...], Iterable[torch.Tensor]], None], hold: bool = True,
               in_place: bool = False) -> list[torch.Tensor]:
    """The layer's outputs for each (hidden states, kwargs) call, quantizing stage by stage (see the module
    docstring). `quantize(stage, inputs)` gets the stage's module names and its input for every batch, which the
    next stage then runs through the stage's quantized modules. With `hold` (`runtime.placement.holds_stage_inputs`)
    the o and down projections' inputs are computed once and held for all batches; without it each batch's is
    computed when it is reached, twice (attention and the gate/up projections run again), so that they are never
    all in memory at once: the down projection's, 2.75x the hidden states, are the layer's largest tensors. The
    norms' outputs are always computed batch by batch. Either way the residual stream after attention (which
    becomes the layer's output, in place) is held across the stages, and the layer's inputs beside it unless
    `in_place` (resident calls only: the caller gives the inputs up), where the stream is built in them."""
    part = layer.get_submodule
    attn, mlp, o, down = part(wiring.attention), part(wiring.mlp), part(wiring.o), part(wiring.down)
    input_norm, post_attention_norm = part(wiring.input_norm), part(wiring.post_attention_norm)
    qkv, _, gate_up, _ = wiring.stages

    def attended(call: tuple[torch.Tensor, dict]) -> torch.Tensor:  # o's input
        h, kwargs = call
        return _input_of(o, lambda: attn(hidden_states=input_norm(h), **kwargs))

    def activated(h: torch.Tensor) -> torch.Tensor:  # down's input
        return _input_of(down, lambda: mlp(post_attention_norm(h)))

    with torch.no_grad():
        quantize(qkv, StageInputs(lambda call: input_norm(call[0]), calls))
        o_inputs = StageInputs(attended, calls, hold)
        quantize((wiring.o,), o_inputs)
        residual = offload.collector(calls)  # kept where the layer's inputs are (`calibration.offload`)
        if offload.is_offloaded(calls):  # each call read once (o's input computed from it here), not twice
            for call in calls:
                residual.append(call[0] + o.forward(attended(call)))
        else:
            for (h, _), a in zip(calls, o_inputs):  # `a` has been through o's pre-hooks
                residual.append(h.add_(o.forward(a)) if in_place else h + o.forward(a))
        del o_inputs
        quantize(gate_up, StageInputs(post_attention_norm, residual))
        width = down.in_features
        down_inputs = StageInputs(activated, RowChunks(residual, width), hold)
        quantize((wiring.down,), down_inputs)
        if offload.is_offloaded(residual):  # each batch read once: its down input is computed from it here
            outputs = offload.collector(residual)
            for h in residual:
                out = torch.empty_like(h)
                for part, into in zip(RowChunks([h], width), RowChunks([out], width)):
                    torch.add(part, down.forward(activated(part)), out=into)
                outputs.append(out)
            return outputs
        for h, a in zip(RowChunks(residual, width), down_inputs):  # in place (views of the residual stream, this
            h += down.forward(a)  # function's own); not down(a): `a` is down's input after its pre-hooks (R4)
        return residual


class Calls:
    """`split_call` of each of a layer's calls, made as each is read (offloaded calls are read from CPU memory)."""

    def __init__(self, inputs):
        self.inputs = inputs
        self.offloaded = offload.is_offloaded(inputs)

    @property
    def device(self) -> torch.device:
        return self.inputs.device

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int):
        return split_call(*self.inputs[i])

    def __iter__(self):
        return (split_call(a, k) for a, k in self.inputs)


class RowChunks:
    """The rows of each batch, a few at a time (views), every time it is iterated: the MLP's pass up to the down
    projection's input runs on ROW_CHUNK_BYTES of that input at once, not on a batch. Its gate and up outputs, their
    activation and product are the largest temporaries of a staged layer (a Llama-3.1-8B batch of 8 x 2048 tokens:
    448 MiB each, about 1.3 GiB at once, on a GPU the staged pass's peak beside the hidden states); the Hessian
    sums tokens, so the rows' grouping changes none of its terms, and each row's values are the batch's (a Linear's
    rows do not mix)."""

    def __init__(self, batches, width: int):
        self.batches, self.width = batches, width

    def __iter__(self) -> Iterator[torch.Tensor]:
        for h in self.batches:  # hidden states [rows, tokens..., hidden]
            yield from h.split(chunk_rows(h[0, ..., 0].numel(), self.width, h.element_size()))


def chunk_rows(tokens_per_row: int, width: int, element: int) -> int:
    """The rows of a batch whose `width`-wide activations take at most ROW_CHUNK_BYTES (one row at least)."""
    return max(1, ROW_CHUNK_BYTES // max(1, tokens_per_row * width * element))


ROW_CHUNK_BYTES = 128 << 20  # 2 rows of 2048 tokens of Llama-3.1-8B's 14336-wide MLP (112 MiB)


class StageInputs:
    """A stage's input for each batch, `compute(item)` for each of `items`: with `hold`, computed once and held;
    otherwise computed again each time it is iterated, one batch at a time."""

    def __init__(self, compute: Callable[[object], torch.Tensor], items: list, hold: bool = False):
        self.compute, self.items = compute, items
        self.held = [compute(item) for item in items] if hold else None

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.held is not None:
            return iter(self.held)
        return (self.compute(item) for item in self.items)


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
    """The input `module`'s forward receives when `run()` runs, after the module's own pre-hooks (an online
    rotation: `quant.rotations.OnlineRotation`); `run` stops right there (the module never computes)."""
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
