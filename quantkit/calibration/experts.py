"""MoE experts during calibration: every expert sees every token, and the tokens really routed are counted.

With real routing an expert sees only the tokens the router sends it, and a rarely chosen expert would be
quantized on a handful of tokens, or none (no Hessian, no activation range). While a decoder layer calibrates,
its experts run on every token, so every Linear's statistics cover the whole calibration set; the layer's
output still sums only the routed experts (`moe.LinearExperts`). How many tokens the router really sends to
each expert (summed over ranks) goes into the calibration summary: an expert that is rarely routed is one whose
quantization the calibration data says little about.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from quantkit.calibration.hooks import Stop
from quantkit.calibration.layer import Layer
from quantkit.models.moe import LinearExperts, experts_modules
from quantkit.grids.observers import Observer, ReduceOp
from quantkit.runtime import distributed


class RoutedTokens(Observer):
    """How many (token, expert) assignments the router made to each expert."""

    REDUCE = {"count": ReduceOp.SUM}

    def __init__(self, num_experts: int, device: torch.device):
        super().__init__()
        self.state["count"] = torch.zeros(num_experts, dtype=torch.int64, device=device)

    def update(self, top_k_index: torch.Tensor) -> None:
        count = self.state["count"]
        # an index equal to the number of experts marks no expert (the fused forward skips it too)
        self.state["count"] += torch.bincount(top_k_index.flatten(), minlength=count.numel() + 1)[: count.numel()].to(count.device)


@contextlib.contextmanager
def calibrating(layer: Layer) -> Iterator[None]:
    """While the block runs, the layer's experts see every token; on entry, the tokens routed to each expert
    are counted into `layer.result.routed_tokens`. Nothing happens for a layer without experts."""
    experts = experts_modules(layer.module)
    if not experts:
        yield
        return
    counts = routed_tokens(layer.module, experts, layer.inputs)
    distributed.all_reduce_observers(list(counts.values()), layer.ctx)
    for name, observer in counts.items():
        layer.result.routed_tokens[f"{layer.prefix}.{name}"] = observer.state["count"].tolist()
    for module in experts.values():
        module.all_tokens = True
    try:
        yield
    finally:
        for module in experts.values():
            module.all_tokens = False


def routed_tokens(layer: torch.nn.Module, experts: dict[str, LinearExperts], inputs: list[tuple]) -> dict[str, RoutedTokens]:
    """The router's choices for this rank's calibration batches, per experts module. Each batch runs only up to
    the experts (attention and router): the experts themselves never compute here."""
    device = next(layer.parameters()).device
    counts = {name: RoutedTokens(module.num_experts, device) for name, module in experts.items()}
    reached: set[str] = set()

    def hook(name):
        def count(module, args):
            counts[name].update(args[1])
            reached.add(name)
            if len(reached) == len(experts):
                raise Stop
        return count

    handles = [module.register_forward_pre_hook(hook(name)) for name, module in experts.items()]
    try:
        with torch.no_grad():
            for args, kwargs in inputs:
                reached.clear()
                try:
                    layer(*args, **kwargs)
                except Stop:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    return counts
