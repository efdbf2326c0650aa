"""Resumable calibration: the state of a calibrated `finalize`, saved as its decoder layers finish.

    DST.partial/
      state.json                          the run's fingerprint, the layers finished, the summary so far
      layer-00003.safetensors             a finished layer: its quantized weights (grid integers, scales, zero
                                          points), every other tensor it holds (norms folded by AWQ/SmoothQuant),
                                          static input scales
      hidden-00004-rank0.safetensors      the next layer's input hidden states for rank 0's calibration batches,
                                          and rank 0's RNG state (one file per rank)
      learned-rotations-rank0.safetensors learned rotations (`finalize._learn_rotations`), one copy per rank

After layer i rank 0 writes layer i. The hidden states are the large part (64 x 2048 tokens of a 2048-wide model:
512 MiB a layer), so they are checkpointed at most every `every` seconds (`finalize --checkpoint-every`), after
the last layer, and when the run is interrupted (Ctrl-C, one process): every rank writes its hidden states for
layer i + 1, and after a barrier rank 0 replaces state.json (so state.json never names a layer whose files are
incomplete) and deletes the older hidden states. A rank on another machine whose DST.partial is its own (no shared
file system) deletes its own copies a checkpoint later, once state.json no longer names them, and the rest when
the run ends. Every file is written to a temporary name and renamed. `--resume` checks the fingerprint field by
field, restores the finished layers into the freshly loaded model, recomputes the first layer's other inputs
(attention mask, rotary embeddings: they are the same for every layer) and goes on with the saved hidden states,
so the artifact is identical to an uninterrupted run's. The work directory is removed when the artifact is
written.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from quantkit.calibration.layer import CalibrationResult
from quantkit.errors import UsageError
from quantkit.export.atomic import STATE
from quantkit.grids import family_of
from quantkit.quant.plan import ModulePlan
from quantkit.grids.qparams import QuantizedWeight
from quantkit.runtime import distributed



LEARNED_ROTATIONS = "learned-rotations-rank{rank}.safetensors"  # one copy per rank (`finalize._learn_rotations`)


def learned_rotations_file(work_dir: Path, rank: int) -> Path:
    return work_dir / LEARNED_ROTATIONS.format(rank=rank)


def source_identity(src: Path) -> str:
    """A cheap identity of the source weights: config.json, and each safetensors file's name, size,
    modification time and header (hashing every byte of a 140 GB model would take minutes per run)."""
    digest = hashlib.sha256((src / "config.json").read_bytes())
    for file in sorted(src.glob("*.safetensors")):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        with open(file, "rb") as fh:
            length = int.from_bytes(fh.read(8), "little")
            digest.update(fh.read(min(length, 100_000_000)))
    return "sha256:" + digest.hexdigest()[:16]


def samples_identity(samples: torch.Tensor) -> str:
    return "sha256:" + hashlib.sha256(samples.contiguous().numpy().tobytes()).hexdigest()[:16]


@dataclass
class Resumable:
    """One calibrated run's work directory. `fingerprint`: what must match for `--resume` (name -> value);
    `every`: the seconds between checkpoints of the hidden states (0: after every layer)."""

    path: Path
    fingerprint: dict[str, str]
    resume: bool
    ctx: distributed.Context | None = None
    completed: int = 0
    every: float = 0.0
    _last: float = field(default_factory=time.monotonic)  # when the last checkpoint was written (or the run began)
    _pending: tuple | None = None  # the last finished layer's checkpoint, not written yet: `_checkpoint`'s arguments

    @property
    def rank(self) -> int:
        return self.ctx.rank if self.ctx is not None else 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def open(self) -> dict | None:
        """The saved state when resuming (fingerprint checked), else None. What a directory without a state file
        holds (a run killed while saving its first layer) is discarded, except the learned rotations this run has
        just written (`finalize._learn_rotations`: they are learned before calibration opens the directory)."""
        state = self._read_state() if self.resume else None
        if state is not None:
            self._check(state["fingerprint"])
            self.completed = state["completed"]
        distributed.barrier(self.ctx)  # every rank has read the state before rank 0 touches the directory
        if state is None and self.is_main:
            self._clear()
        distributed.barrier(self.ctx)
        self._last = time.monotonic()
        return state

    def _clear(self) -> None:
        """Everything in the directory but the learned rotations this run has written."""
        if not self.path.exists():
            return
        kept = set(self.path.glob(LEARNED_ROTATIONS.format(rank="*")))
        for entry in self.path.iterdir():
            if entry not in kept:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    def discard(self) -> None:
        """An interrupted run with no checkpoint written: its finished layers cannot be resumed from (a new run
        would discard them), so rank 0 removes them now, and the directory when nothing else is in it (learned
        rotations stay, for the next run to reuse). No barrier: the other ranks are being interrupted too."""
        if not self.is_main or self.completed:
            return
        self._clear()
        with contextlib.suppress(OSError):  # not empty (learned rotations), or gone
            self.path.rmdir()

    def _read_state(self) -> dict:
        try:
            return json.loads((self.path / STATE).read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"--resume: cannot read {self.path / STATE} ({exc}); delete {self.path} and run without --resume") from None

    def _check(self, saved: dict[str, str]) -> None:
        for name, value in self.fingerprint.items():
            if saved.get(name) != value:
                raise UsageError(
                    f"--resume: the interrupted run in {self.path} had {name} {saved.get(name)}, this one has {value}; "
                    f"rerun with the same settings, or delete {self.path} and run without --resume"
                )

    # ---------------------------------------------------------------- saving

    def save_layer(self, index: int, module: nn.Module, prefix: str, result: CalibrationResult,
                   hidden: list[torch.Tensor], num_layers: int, float_hidden: list[torch.Tensor] | None = None) -> None:
        """Layer `index` is finished: rank 0 writes its tensors; when a checkpoint is due (`every` seconds since the
        last, or the last layer), every rank writes its hidden states for the next layer (and the float model's,
        for a recipe tuned against them), then the state file. Otherwise the checkpoint waits in memory (the
        tensors are the next layer's inputs, held anyway) for the next one due, or for `save_pending`."""
        self.path.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            _save(self.path / f"layer-{index:05d}.safetensors", layer_tensors(module, prefix, result))
        self._pending = (index + 1, num_layers, hidden, float_hidden or [], torch.get_rng_state(),
                         copy.deepcopy(_result_dict(result)))
        if index + 1 == num_layers or self._due():
            self._checkpoint(*self._pending)

    def save_pending(self) -> None:
        """Write the checkpoint of the last finished layer that the interval held back (an interrupted run, one
        process: the other ranks of a distributed run are not there to write theirs)."""
        if self._pending is not None and (self.ctx is None or self.ctx.world_size == 1):
            self._checkpoint(*self._pending)

    def drop_pending(self) -> None:
        """Forget the checkpoint held back: its hidden states (the layer's inputs) are about to be overwritten in
        place or freed (`Layer.take_inputs`). An interrupted run then resumes from the last one written, as a killed
        run does."""
        self._pending = None

    def _due(self) -> bool:
        """Whether `every` seconds have passed since the last checkpoint; rank 0's clock decides for every rank."""
        due = self.every <= 0 or time.monotonic() - self._last >= self.every
        if self.ctx is not None and self.ctx.distributed:
            flag = torch.tensor([float(due)], device=self.ctx.device)
            distributed.broadcast_(flag, 0, self.ctx)
            due = bool(flag.item())
        return due

    def _checkpoint(self, completed: int, num_layers: int, hidden: list[torch.Tensor], float_hidden: list[torch.Tensor],
                    rng: torch.Tensor, result: dict) -> None:
        """Layers before `completed` are finished and on disk: save the inputs of layer `completed` (none after the
        last), then (after every rank has written) the state file naming them; older inputs are removed."""
        if completed < num_layers:
            tensors = {"rng": rng, **{f"h.{b}": h for b, h in enumerate(hidden)},
                       **{f"f.{b}": h for b, h in enumerate(float_hidden)}}
            _save(self._hidden_file(completed, self.rank), tensors)
        distributed.barrier(self.ctx)
        if self.is_main:
            state = {"fingerprint": self.fingerprint, "completed": completed, "layers": num_layers, "result": result}
            _write_atomic(self.path / STATE, json.dumps(state, indent=1).encode())
            stale = self._stale("*", completed)
        else:  # rank 0 may not have replaced the state yet: it names the previous checkpoint's inputs until it does
            stale = self._stale(str(self.rank), self.completed)
        for old in stale:
            old.unlink(missing_ok=True)  # gone already where the directory is shared
        self.completed, self._last, self._pending = completed, time.monotonic(), None

    def _stale(self, rank: str, before: int) -> list[Path]:
        """The hidden-state files of `rank` ("*": every rank) for the layers before `before`."""
        found = self.path.glob(f"hidden-*-rank{rank}.safetensors")
        return [path for path in found if int(path.name.split("-")[1]) < before]

    def _hidden_file(self, layer: int, rank: int) -> Path:
        return self.path / f"hidden-{layer:05d}-rank{rank}.safetensors"

    # ---------------------------------------------------------------- restoring

    def restore(self, state: dict, result: CalibrationResult,
                num_layers: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Put the finished run's summary back; return this rank's hidden states for the first unfinished layer, and
        the float model's where they were saved (the finished layers come back one at a time, `restore_layer`)."""
        _restore_result(state["result"], result)
        if self.completed == num_layers:
            return [], []
        saved = load_file(self._hidden_file(self.completed, self.rank))
        torch.set_rng_state(saved.pop("rng"))
        stream = lambda kind: [saved[f"{kind}.{b}"] for b in range(sum(key.startswith(f"{kind}.") for key in saved))]
        return stream("h"), stream("f")

    def restore_layer(self, index: int, module: nn.Module, prefix: str, plan: dict[str, ModulePlan],
                      result: CalibrationResult) -> None:
        """Finished layer `index` computes again what it did when it was finished, and its qparams are back."""
        restore_layer(module, prefix, plan, result, load_file(self.path / f"layer-{index:05d}.safetensors"))

    def finish(self) -> None:
        """The artifact is written: rank 0 removes the directory, every other rank its own files (and the directory
        when that leaves it empty: its own, on another machine without a shared file system)."""
        if self.is_main:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        with contextlib.suppress(FileNotFoundError):  # rank 0 removed the shared directory first: nothing left
            for leftover in list(self.path.glob(f"*-rank{self.rank}.safetensors")):  # hidden states, learned rotations
                leftover.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty, or already gone: rank 0's to remove
            self.path.rmdir()


def layer_tensors(module: nn.Module, prefix: str, result: CalibrationResult) -> dict[str, torch.Tensor]:
    """A finished layer as flat tensors: grid integers, scales and zero points of its quantized Linears (their
    dequantized weights follow from those exactly), static input scales, KV cache scales (and the ranges they
    came from), and every other tensor as it is."""
    tensors = {}
    quantized = set()
    for name, qweight in result.qweights.items():
        if name.startswith(prefix + "."):
            local = name[len(prefix) + 1:]
            quantized.add(f"{local}.weight")
            tensors[f"qdata.{local}"] = qweight.qdata
            tensors[f"scale.{local}"] = qweight.scale
            if qweight.zero_point is not None:
                tensors[f"zero.{local}"] = qweight.zero_point
            if qweight.k is not None:  # a block grid's scale codes under its super-block scales (GGUF)
                for part, tensor in qweight.k.parts().items():
                    tensors[f"k_{part}.{local}"] = tensor
            if name in result.input_scales:
                tensors[f"input_scale.{local}"] = result.input_scales[name]
    for name in (n for n in result.kv_scales if n.startswith(prefix + ".")):
        local = name[len(prefix) + 1:]
        tensors[f"kv_scale.{local}"] = result.kv_scales[name]
        tensors[f"kv_range.{local}"] = torch.tensor(result.kv_ranges[name])
    for name, tensor in module.state_dict().items():
        if name not in quantized:
            tensors[f"state.{name}"] = tensor
    return tensors


def restore_layer(module: nn.Module, prefix: str, plan: dict[str, ModulePlan], result: CalibrationResult,
                  tensors: dict[str, torch.Tensor]) -> None:
    """The inverse of `layer_tensors`: the layer computes what it did when it was finished."""
    state = {name[len("state."):]: t for name, t in tensors.items() if name.startswith("state.")}
    for key in (k for k in tensors if k.startswith("qdata.")):
        local = key[len("qdata."):]
        name = f"{prefix}.{local}"
        linear = module.get_submodule(local)
        spec = plan[name].scheme.weights
        parts = {key[2:].split(".", 1)[0]: t for key, t in tensors.items()
                 if key.startswith("k_") and key.split(".", 1)[1] == local}  # a block grid's (`BlockParams.parts`)
        k = family_of(spec).block_params(spec, parts)
        qweight = QuantizedWeight(tensors[key], tensors[f"scale.{local}"], tensors.get(f"zero.{local}"), spec, k=k)
        state[f"{local}.weight"] = qweight.dequantize(linear.weight.dtype)
        result.qweights[name] = qweight
        if f"input_scale.{local}" in tensors:
            result.input_scales[name] = tensors[f"input_scale.{local}"]
    for key in (k for k in tensors if k.startswith("kv_scale.")):
        local = key[len("kv_scale."):]
        result.kv_scales[f"{prefix}.{local}"] = tensors[key]
        result.kv_ranges[f"{prefix}.{local}"] = tensors[f"kv_range.{local}"].item()
    module.load_state_dict(state, strict=True, assign=True)  # assign: a streamed layer may be on the meta device


def _result_dict(result: CalibrationResult) -> dict:
    return {"errors": result.errors, "seconds": dict(result.seconds), "peak_device_bytes": result.peak_device_bytes,
            "gptq_rows": result.gptq_rows, "skipped": result.skipped, "true_sequential": result.true_sequential,
            "stage_inputs_held": result.stage_inputs_held, "routed_tokens": result.routed_tokens, "tuning": result.tuning}


def _restore_result(saved: dict, result: CalibrationResult) -> None:
    result.errors.update(saved["errors"])
    result.seconds.update(saved["seconds"])
    result.peak_device_bytes = saved["peak_device_bytes"]
    result.gptq_rows = saved.get("gptq_rows")
    result.skipped.update(saved["skipped"])
    result.true_sequential = saved["true_sequential"]
    result.stage_inputs_held = saved.get("stage_inputs_held")
    result.routed_tokens.update(saved.get("routed_tokens", {}))
    result.tuning.update(saved.get("tuning", {}))


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp))
    _sync_and_rename(tmp, path)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    _sync_and_rename(tmp, path)


def _sync_and_rename(tmp: Path, path: Path) -> None:
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
