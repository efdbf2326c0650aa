"""Calibration activations kept in CPU memory while a GPU computes: what lets a model whose calibration hidden
states do not fit the GPU's memory budget (`--max-gpu-memory`) calibrate anyway.

In the resident mode the pipeline keeps every batch's hidden states on the compute device, as plain lists. In the
offloaded mode (chosen by the preflight, `finalization.preflight.device_plan`) they live in pinned CPU memory:

- `HostBatches`: one tensor per calibration batch. Appending copies a device tensor to the host; reading one copies
  it back; iterating copies batch i + 1 on a side stream while batch i computes, so the transfers overlap compute.
- `HostCalls`: a layer's (args, kwargs) calls whose hidden states are a `HostBatches` (the other arguments,
  rotary embeddings and masks, are small and stay on the device).

Both are read-only sequences of device values, so every layer step that iterates `layer.inputs` works unchanged;
the code that makes new per-batch hidden states (`collector`) keeps them wherever the inputs are kept. On the CPU
(the tests) the same classes run without streams, so the offloaded path is tested bit for bit against the resident
one there.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Sequence

import torch


class HostBatches(Sequence):
    """Per-batch tensors held in (pinned) CPU memory, read back onto `device`."""

    offloaded = True

    def __init__(self, device: torch.device, host: list[torch.Tensor] | None = None):
        self.device = device
        self.host: list[torch.Tensor] = list(host or [])
        self._stream = _side_stream(device) if device.type == "cuda" else None
        self._done: list[Any] = [None] * len(self.host)  # per batch: the event after which its host copy is complete

    def __len__(self) -> int:
        return len(self.host)

    def append(self, tensor: torch.Tensor) -> None:
        """Copy `tensor` (on the device) to pinned host memory, without waiting on a GPU."""
        if self._stream is None:
            self.host.append(tensor.detach().to("cpu", copy=tensor.device.type == "cpu"))
            self._done.append(None)
            return
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # `tensor` is computed
        with torch.cuda.stream(self._stream):
            pinned.copy_(tensor, non_blocking=True)
            tensor.record_stream(self._stream)  # not reused by the allocator before the copy is done
            done = torch.cuda.Event()
            done.record(self._stream)
        self.host.append(pinned)
        self._done.append(done)

    def _fetch(self, i: int) -> tuple[torch.Tensor, Any]:
        if self._stream is None:
            return self.host[i].clone() if self.device.type == "cpu" else self.host[i].to(self.device), None
        with torch.cuda.stream(self._stream):
            on_device = self.host[i].to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        on_device.record_stream(torch.cuda.current_stream(self.device))
        return on_device, ready

    @staticmethod
    def _wait(fetched: tuple[torch.Tensor, Any]) -> torch.Tensor:
        tensor, ready = fetched
        if ready is not None:
            torch.cuda.current_stream(tensor.device).wait_event(ready)
        return tensor

    def __getitem__(self, i):  # noqa: ANN001 - an int (a slice gives a list)
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._wait(self._fetch(i if i >= 0 else len(self) + i))

    def __iter__(self) -> Iterator[torch.Tensor]:
        if not self.host:
            return
        ahead = self._fetch(0)
        consumed: deque = deque()  # the compute stream's position after each batch handed out
        for i in range(len(self.host)):
            current = ahead
            if i + 1 < len(self.host):
                ahead = self._fetch(i + 1)  # copied while batch i computes
            yield self._wait(current)
            if self._stream is not None:
                _pace(consumed, self.device)

    def on_host(self) -> list[torch.Tensor]:
        """The host tensors, every copy to them complete (for the resume file)."""
        for done in self._done:
            if done is not None:
                done.synchronize()
        return self.host


RUN_AHEAD_BATCHES = 2  # batches the CPU may queue ahead of the GPU when it reads offloaded ones


def _pace(consumed: deque, device: torch.device) -> None:
    """Wait for the GPU to finish the batch RUN_AHEAD_BATCHES back. Unpaced, the CPU can queue work for dozens of
    batches ahead of the GPU, and each batch's copy then takes fresh memory: a freed block that another stream used
    stays reserved until the GPU passes it (torch's allocator waits on its stream events). Measured unpaced on an
    H200 (GPTQ, 8B shape, 512 x 2048 tokens offloaded): 19.8 GB of GPU memory in use (NVML) for 4.4 GB allocated;
    that this is the cause is likely, not yet measured."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    consumed.append(done)
    if len(consumed) > RUN_AHEAD_BATCHES:
        consumed.popleft().synchronize()


_STREAMS: dict[torch.device, Any] = {}


def _side_stream(device: torch.device):
    """One copy stream per device, shared by every `HostBatches` (copies queue behind each other on it, in order)."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def hidden_of(call: tuple) -> torch.Tensor:
    """The hidden states of one (args, kwargs) layer call."""
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def _with(call: tuple, hidden: torch.Tensor | None) -> tuple:
    args, kwargs = call
    return ((hidden, *args[1:]), kwargs) if args else ((), {**kwargs, "hidden_states": hidden})


class HostCalls(Sequence):
    """A layer's calls, (args, kwargs) per batch, with the hidden states in a `HostBatches`."""

    offloaded = True

    def __init__(self, device: torch.device, templates: list[tuple] | None = None, hidden: HostBatches | None = None):
        self.templates = list(templates or [])  # each call with its hidden states left out (None)
        self.hidden = hidden if hidden is not None else HostBatches(device)

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def append(self, call: tuple) -> None:
        self.hidden.append(hidden_of(call))
        self.templates.append(_with(call, None))

    def __len__(self) -> int:
        return len(self.templates)

    def __getitem__(self, i):  # noqa: ANN001
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return _with(self.templates[i], self.hidden[i])

    def __iter__(self) -> Iterator[tuple]:
        return (_with(template, hidden) for template, hidden in zip(self.templates, self.hidden))


def batch_shapes(calls: Sequence) -> list[torch.Size]:
    """The hidden states' shape of each call, read without copying offloaded ones to the device."""
    if isinstance(calls, HostCalls):
        return [hidden.shape for hidden in calls.hidden.host]
    return [hidden_of(call).shape for call in calls]


def is_offloaded(values: Any) -> bool:
    """Whether `values` (per-batch tensors or calls, or a view of them) are kept in CPU memory."""
    return bool(getattr(values, "offloaded", False))


def collector(like: Any) -> list | HostBatches:
    """An empty list for per-batch tensors kept where `like`'s are: a `HostBatches` on `like`'s device when `like`
    is offloaded, else a plain list (on the device, as computed)."""
    return HostBatches(like.device) if is_offloaded(like) else []


def calls_collector(like: Any) -> list | HostCalls:
    """`collector` for (args, kwargs) calls."""
    return HostCalls(like.device) if is_offloaded(like) else []


def with_hidden(calls: Sequence, hidden: Sequence) -> list[tuple] | HostCalls:
    """`calls` with their hidden states replaced by `hidden` (the next layer's inputs): a `HostCalls` when `hidden`
    is offloaded."""
    if isinstance(hidden, HostBatches):
        templates = calls.templates if isinstance(calls, HostCalls) else [_with(call, None) for call in calls]
        return HostCalls(hidden.device, templates, hidden)
    templates = calls.templates if isinstance(calls, HostCalls) else calls
    return [_with(call, h) for call, h in zip(templates, hidden)]


def hidden_states(calls: Sequence) -> Sequence:
    """The hidden states of each call: the `HostBatches` itself for offloaded calls."""
    if isinstance(calls, HostCalls):
        return calls.hidden
    return [hidden_of(call) for call in calls]


GROUP_BYTES = 2 << 30  # offloaded calls a step holds on the device at once (`resident_groups`), with as much again


def resident_groups(calls: Sequence) -> list[range]:
    """The batches a step that reads `calls` many times over (AWQ's grid) holds on the device together: every batch
    for resident calls; for offloaded ones, as many as GROUP_BYTES of hidden states, so that each batch is copied
    once per group rather than once per reading."""
    if not is_offloaded(calls) or not len(calls):
        return [range(len(calls))]
    hidden = calls.hidden.host[0]
    per_group = max(1, GROUP_BYTES // max(1, hidden.numel() * hidden.element_size()))
    return [range(start, min(start + per_group, len(calls))) for start in range(0, len(calls), per_group)]


def on_host(values: Sequence) -> Sequence:
    """Offloaded batches as their host tensors (copies complete); other values as they are."""
    return values.on_host() if isinstance(values, HostBatches) else values


def offload(calls: list[tuple], device: torch.device) -> HostCalls:
    """Resident calls moved into a `HostCalls` (their device hidden states can then be freed)."""
    moved = HostCalls(device)
    for call in calls:
        moved.append(call)
    return moved
