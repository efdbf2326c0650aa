"""Where tensors live: the one rule, in one place.

The model stays in CPU memory (or on disk, streamed); a decoder layer, its calibration activations and its
statistics move to the compute device for their turn; everything handed to an exporter, a resume file or disk is
on the CPU (`HOST`). The calibration pipeline calls `offload_layer` when a layer's turn ends, and the exporters call
`check_on_host` on what they are given, so a tensor left on a GPU is an error naming it, not a device mismatch
deep inside a library.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from quantkit.runtime import memory

HOST = torch.device("cpu")


class PlacementError(RuntimeError):
    """A tensor reached a place that takes CPU tensors only (a bug in quantkit, not a user mistake)."""


def compute_device(name: str, ctx=None) -> torch.device:
    """The device `--device NAME` computes on, with its index: `cuda` under torchrun is this rank's own GPU
    (`ctx.device`), else the current one (tensors on it report `cuda:0`, which `cuda` does not equal)."""
    device = torch.device(name)
    if device.type != "cuda" or device.index is not None:
        return device
    if ctx is not None and ctx.distributed:
        return ctx.device
    return torch.device("cuda", torch.cuda.current_device())


HELD_STAGE_INPUTS_SHARE = 1 / 3  # of the machine's memory


def holds_stage_inputs(device: torch.device, held_bytes: int = 0) -> bool:
    """Whether GPTQ's staged pass (`calibration.true_sequential.run_stages`) holds a stage's inputs for every batch
    at once (computed once) or computes them batch by batch, twice. `held_bytes`: the largest of them for every
    batch (the down projection's). Held on the CPU, where compute is scarce, when they take at most
    HELD_STAGE_INPUTS_SHARE of the machine's memory; recomputed on a GPU, where they would be the largest
    allocation (the down projection's inputs for 64 x 2048 tokens of a 2048-wide model: 1.4 GiB) and attention
    and the gate/up projections run again in a fraction of the solve's time, and on a CPU where they would crowd
    out the rest of the run (about as much again: Llama-3.1-8B with 128 x 2048 tokens holds 7 GiB of them beside
    9 GiB of hidden states, layer, Hessians and activations). Recomputing them cost 1.3x the staged pass's forward
    and Hessian sums on one Llama-3.1-8B layer (2 CPU threads), about a quarter of a layer's time at 128 x 2048."""
    if device.type != "cpu":
        return False
    machine = memory.physical_bytes()
    return machine is None or held_bytes <= HELD_STAGE_INPUTS_SHARE * machine


def overlaps_io(device: torch.device) -> bool:
    """Whether a streamed calibrated finalize overlaps its disk work with the GPU's: the next decoder layer is read
    (into pinned memory, copied to the GPU without blocking at its turn) and the finished one packed and written,
    each in a worker thread, while a layer calibrates. On a GPU, whose work leaves the CPU idle (the 0.84B GPTQ
    benchmark spent 2.6 s of an H100 run packing and writing); not on the CPU, where both would compete for the
    same cores. `QUANTKIT_OVERLAP_IO=0` turns it off."""
    return device.type == "cuda" and os.environ.get("QUANTKIT_OVERLAP_IO", "1") != "0"


CUDA_CONTEXT_BYTES = 600 << 20  # the CUDA context and the libraries' kernels: on the GPU, outside torch's allocator


def cap_device_memory(device: torch.device, budget: int) -> None:
    """Hold torch's allocator on `device` to `budget` bytes (`--max-gpu-memory`), less the CUDA context outside it: a
    run that would need more fails there, as it would on a GPU of that size."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, max(budget - CUDA_CONTEXT_BYTES, 1) / total), device)


def to_host(value: Any) -> Any:
    """`value` with every tensor inside it (tensors, lists, tuples, dicts, dataclasses such as `QuantizedWeight`)
    on the CPU; tensors already there are returned as they are."""
    if isinstance(value, torch.Tensor):
        return value if value.device == HOST else value.to(HOST)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: to_host(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    return value


def offload_layer(module: nn.Module, prefix: str, result) -> None:
    """A decoder layer's turn is over: the layer goes back to the CPU, and so do the qparams, input scales and KV
    cache scales its steps added to `result` (a `CalibrationResult`), ready for the exporter and the resume file."""
    module.to(HOST)
    for table in (result.qweights, result.input_scales, result.kv_scales):
        for name in [n for n in table if n.startswith(f"{prefix}.")]:
            table[name] = to_host(table[name])


def check_on_host(where: str, **groups: Any) -> None:
    """Raise PlacementError naming the first tensor in `groups` (name -> tensors, modules, qparams, ...) that is not
    on the CPU: what an exporter or a file writer is handed must be."""
    for group, value in groups.items():
        for name, tensor in _tensors(value, group):
            if tensor.device != HOST:
                raise PlacementError(f"{where} was handed {name} on {tensor.device}; everything written must be on the "
                                     "CPU (quantkit.runtime.placement): please report this as a bug")


def _tensors(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, nn.Module):
        for key, tensor in value.state_dict(keep_vars=True).items():
            yield f"{name}.{key}", tensor
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _tensors(getattr(value, f.name), f"{name}.{f.name}")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensors(item, f"{name}[{key}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{name}[{i}]")
