"""Running decoder layers on calibration batches: capture the first layer's inputs, run a layer, observe what
its modules receive."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from quantkit.calibration import offload
from quantkit.grids.observers import Observer


class Stop(Exception):
    """Raised from a hook once it has what it came for: the rest of the forward pass never runs."""


def capture_inputs(model: nn.Module, layers: nn.ModuleList, batches: list[torch.Tensor], device: torch.device,
                   offloaded: bool = False) -> list[tuple] | offload.HostCalls:
    """(args, kwargs) of the first decoder layer for each batch. Only the modules before the layers
    (embeddings, rotary embedding) visit `device`; the layers stay where they are. `offloaded`: the hidden states
    go to CPU memory batch by batch (`offload.HostCalls`)."""
    captured = offload.HostCalls(device) if offloaded else []

    def hook(module, args, kwargs):
        captured.append((args, kwargs))
        raise Stop

    base = getattr(model, model.base_model_prefix)
    front = [m for m in base.children() if m is not layers]
    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for module in front:
            module.to(device)
        for ids in batches:
            try:
                model(input_ids=ids.to(device), use_cache=False)
            except Stop:
                pass
    finally:
        handle.remove()
        for module in front:
            module.to("cpu")
    return captured


def run_layer(layer: nn.Module, inputs: list[tuple]) -> list[torch.Tensor]:
    """The layer's hidden-state output for each captured call, kept where the inputs are (`offload.collector`)."""
    outputs = offload.collector(inputs)
    with torch.no_grad():
        for args, kwargs in inputs:
            out = layer(*args, **kwargs)
            outputs.append(out[0] if isinstance(out, tuple) else out)
    return outputs


def run_layer_consuming(layer: nn.Module, inputs: list[tuple]) -> list[torch.Tensor]:
    """`run_layer` on resident calls the caller gives up (`Layer.take_inputs`): each entry of `inputs` becomes the
    next layer's call (its hidden states the output) as soon as its output is made, so that its own hidden states
    are freed. One copy of the hidden states and a batch, where `run_layer` holds two copies."""
    outputs = []
    with torch.no_grad():
        for b in range(len(inputs)):
            args, kwargs = inputs[b]
            out = layer(*args, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            inputs[b] = offload.with_hidden(inputs[b : b + 1], [out])[0]
            outputs.append(out)
            del args, kwargs
    return outputs


def run_layer_last(layer) -> list[torch.Tensor]:
    """A `calibration.layer.Layer`'s outputs on its inputs, read for the last time (the propagation after the steps,
    or the KV cache step that makes them): consumed batch by batch (`run_layer_consuming`) where the layer can give
    them up (`Layer.take_inputs`), else as `run_layer`."""
    consumed = not offload.is_offloaded(layer.inputs) and layer.take_inputs(last=True)
    return (run_layer_consuming if consumed else run_layer)(layer.module, layer.inputs)


def hidden_state(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states of one captured call."""
    return offload.hidden_of((args, kwargs))


def cut_rows(call: tuple, start: int, stop: int, copy: bool = False) -> tuple[tuple, dict]:
    """Samples [start, stop) of a batched layer call: every tensor with the batch's leading size (and 2 dims or more)
    cut to those rows; the rest (1-D cache positions, broadcast rotary tables, None masks) as it is. `copy`: the
    cut tensors are copies (a view would keep the whole batch's memory)."""
    args, kwargs = call
    size = hidden_state(args, kwargs).shape[0]

    def cut(value):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == size:
            return value[start:stop].detach().clone() if copy else value[start:stop].detach()
        if isinstance(value, tuple):
            return tuple(cut(v) for v in value)
        return value

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def hidden_states(inputs: list[tuple]) -> list[torch.Tensor]:
    """The hidden states of each captured call (`offload.hidden_states`)."""
    return offload.hidden_states(inputs)


def with_hidden(inputs: list[tuple], hidden: list[torch.Tensor]) -> list[tuple]:
    """The captured calls with their hidden states replaced (the next layer's inputs; `offload.with_hidden`)."""
    return offload.with_hidden(inputs, hidden)


def observe(modules: dict[str, nn.Module], make: Callable[[], Observer], layer: nn.Module, inputs: list[tuple]) -> dict[str, Observer]:
    """Run the layer with an observer on each module's input; each batch stops as soon as every module has
    seen its input (in a decoder layer: before the last Linear's matmul and the rest of the layer).

    Modules fed the very same tensor (e.g. the attention projections after the input norm) share one observer,
    updated once per batch: their statistics are identical, so one computation (and, across ranks, one
    reduction) serves them all. `observer_groups` lists the modules of each observer."""
    observers: dict[str, Observer] = {}
    seen: dict[int, tuple[torch.Tensor, Observer]] = {}  # this batch's module inputs, by tensor identity
    done: set[str] = set()  # modules that have seen this batch

    def hook(module, args, name):
        x = args[0]
        hit = seen.get(id(x))
        shared = hit is not None and hit[0] is x
        if name not in observers:
            observers[name] = hit[1] if shared else make()
        if not (shared and hit[1] is observers[name]):  # else: this batch's input is already counted
            seen[id(x)] = (x, observers[name])
            observers[name].update(x)
        done.add(name)
        if len(done) == len(modules):
            raise Stop  # nothing left to observe in this batch

    def new_batch(*_):
        seen.clear()
        done.clear()

    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: hook(mod, args, name)) for name, m in modules.items()]
    handles.append(layer.register_forward_pre_hook(new_batch))
    try:
        with torch.no_grad():
            for args, kwargs in inputs:
                try:
                    layer(*args, **kwargs)
                except Stop:
                    pass
    finally:
        new_batch()
        for handle in handles:
            handle.remove()
    return {name: observers.get(name) or make() for name in modules}


def observer_groups(observers: dict[str, Observer]) -> list[list[str]]:
    """Module names grouped by shared observer, in order; the first name of a group leads it."""
    groups: dict[int, list[str]] = {}
    for name, observer in observers.items():
        groups.setdefault(id(observer), []).append(name)
    return list(groups.values())


class Tail(nn.Module):
    """The final norm, then the Linears outside the decoder layers that read its output (lm_head), each under its
    qualified name: a "layer" whose Linears a step or `observe` finds by name and reaches by a call (`observe`
    stops at their inputs: no logits are computed). Called with the last decoder layer's outputs."""

    def __init__(self, norm: nn.Module, linears: dict[str, nn.Module]):
        super().__init__()
        self.final_norm, self.reading = norm, list(linears.values())
        for name, linear in linears.items():
            parent = self
            *path, last = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(last, linear)

    def forward(self, hidden: torch.Tensor) -> None:
        x = self.final_norm(hidden.to(self.final_norm.weight.device))
        for linear in self.reading:
            linear(x)


def tail_calls(calls: list[tuple]) -> list[tuple]:
    """`Tail`'s calls: the hidden states of the last decoder layer's captured calls."""
    return [((hidden,), {}) for hidden in hidden_states(calls)]
