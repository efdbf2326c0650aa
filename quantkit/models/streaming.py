"""A model whose decoder layers stay on disk until their turn: finalize streams instead of loading it whole.

`StreamedModel.open` builds the model's module tree with every parameter on the meta device (buffers computed
as usual: rotary frequencies). `load(module)` reads one module's tensors from the safetensors files when its
turn comes and `release(module)` gives their memory back. The modules outside the decoder layers (embeddings,
final norm, lm_head: `rest`) are read only while they are needed (`load_rest` / `release_rest`): to compute the
first layer's calibration inputs, and to be written at the end. A finalize holds one decoder layer and the
calibration activations, or the rest, whatever the number of layers.

Reads go through safetensors' own lazy reader (`safe_open`), one file handle per load and closed right after:
the handle's memory map would otherwise keep every page read so far counted in the process's resident size.

MoE models stream too: the skeleton's fused experts are split into per-expert Linears (`moe.linearize`, on the
meta device), which is how checkpoints store them, and a tensor the checkpoint names otherwise (Mixtral's
`block_sparse_moe` is the model's `mlp`) is read under the name transformers' conversion mapping gives it
(`moe.checkpoint_names`). A checkpoint whose tensors still do not match (a layout transformers converts in
other ways while loading, e.g. experts stored fused) cannot be read this way: `open` raises `NotStreamable`
with the reason, and finalize loads the model whole instead.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from quantkit.models import loading as models
from quantkit.models import moe, sources
from quantkit.runtime.memory import return_freed_memory


class NotStreamable(Exception):
    """The checkpoint cannot be read layer by layer (the message says why)."""


@contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device and their buffers on the CPU (as
    accelerate's `init_empty_weights(include_buffers=False)`): nothing is allocated for the weights, and
    buffers computed at construction (rotary frequencies) keep their values."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":  # a tied weight is registered again: keep it
            kind = type(module._parameters[name])
            module._parameters[name] = kind(module._parameters[name].to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def model_dtype(src: Path, config, dtype: str) -> torch.dtype:
    """The dtype `from_pretrained(dtype=...)` gives: the named one, else config.dtype, else the checkpoint's
    first floating-point tensor's."""
    if dtype != "auto":
        return models.DTYPES[dtype]
    configured = getattr(config, "dtype", None)
    if isinstance(configured, torch.dtype):
        return configured
    if isinstance(configured, str) and hasattr(torch, configured):
        return getattr(torch, configured)
    floating = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    stored = next((floating[d] for d, _ in sources.tensor_headers(src).values() if d in floating), torch.float32)
    return stored


class StreamedModel:
    """The model tree (`model`), its decoder layers (`layers`, at `prefix`), and where each tensor is stored."""

    def __init__(self, model: nn.Module, files: dict[str, Path], layers: nn.ModuleList, prefix: str,
                 stored: dict[str, str] | None = None):
        self.model, self.files, self.layers, self.prefix = model, files, layers, prefix
        self.stored = stored or {}  # model tensor name -> the checkpoint's, where they differ
        self.names = {module: name for name, module in model.named_modules()}

    @classmethod
    def open(cls, src: Path, dtype: str = "auto", trust_remote_code: bool = False) -> StreamedModel:
        from transformers import AutoModelForCausalLM

        config = models.load_config(src, trust_remote_code)
        if models.DTYPES.get(dtype) is None:
            raise NotStreamable(f"unknown dtype {dtype}")
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=model_dtype(src, config, dtype),
                                                     trust_remote_code=trust_remote_code)
        model.eval()
        moe.linearize(model)
        files = sources.tensor_files(src)
        stored = checkpoint_keys(model, files)
        reason = layout_mismatch(model, files, stored)
        if reason:
            raise NotStreamable(reason)
        layers = models.decoder_layers(model)
        return cls(model, files, layers, models.module_name(model, layers), stored)

    def rest(self) -> list[nn.Module]:
        """The modules outside the decoder layers (on disk but between `load_rest` and `release_rest`)."""
        return outside(self.model, self.layers)

    def load_rest(self) -> None:
        """Read the modules outside the decoder layers (tied weights are read once, under their stored name). The
        layers are not looked into: the last one may be packed by the writer's thread meanwhile, its modules
        gaining the format's tensors (`finalization.finalize._LayerIO`)."""
        self.model.tie_weights()
        self._load_entries(_state(self.model, skip=self.layers))
        self.model.tie_weights()

    def release_rest(self) -> None:
        for module in self.rest():
            self.release(module)

    def load(self, module: nn.Module) -> None:
        """Read `module`'s parameters and persistent buffers from the checkpoint (cast to the model's dtypes). Only
        `module`'s own tensors are touched: a decoder layer can be read in one thread while others are computed on
        or released in another (`finalization.finalize._LayerIO`)."""
        prefix = self.names[module]
        self._load_entries([(f"{prefix}.{key}", value) for key, value in _state(module)])

    def release(self, module: nn.Module) -> None:
        """Put `module`'s parameters and persistent buffers back on the meta device (their memory is freed)."""
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if param is not None:
                    owner._parameters[name] = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
            for name, buffer in list(owner._buffers.items()):
                if buffer is not None and name not in owner._non_persistent_buffers_set:
                    owner._buffers[name] = buffer.to("meta")
        return_freed_memory()

    def _load_entries(self, targets: list[tuple[str, torch.Tensor]]) -> None:
        from safetensors import safe_open

        by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
        for key, value in targets:
            by_file.setdefault(self.files[self.stored.get(key, key)], []).append((key, value))
        for file, entries in by_file.items():
            with safe_open(str(file), framework="pt") as handle:
                for key, value in entries:
                    tensor = handle.get_tensor(self.stored.get(key, key))
                    if tensor.is_floating_point() and value.is_floating_point():
                        tensor = tensor.to(value.dtype)
                    if tuple(tensor.shape) != tuple(value.shape):
                        raise NotStreamable(f"{key} is stored with shape {list(tensor.shape)}; the model expects {list(value.shape)}")
                    _assign(self.model, key, tensor)


def _state(model: nn.Module, skip: nn.Module | None = None) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and persistent buffer, each tensor once (tied weights under their first
    name), in state-dict order; the tensors under `skip` left out without being looked at."""
    seen, out = set(), []

    def visit(module: nn.Module, prefix: str) -> None:
        if module is skip:
            return
        persistent = [(n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for name, value in [*module._parameters.items(), *persistent]:
            if value is not None and id(value) not in seen:
                seen.add(id(value))
                out.append((prefix + name, value))
        for name, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.")

    visit(model, "")
    return out


def stored_keys(model: nn.Module) -> list[str]:
    """The names a checkpoint of `model` stores: its state dict without the aliases of tied weights."""
    return [name for name, _ in _state(model)]


def checkpoint_keys(model: nn.Module, files: dict[str, Path]) -> dict[str, str]:
    """The model's tensor names that the checkpoint (holding the tensors in `files`) stores under another name,
    as transformers' conversion mapping renames them (e.g. Mixtral's `mlp` is `block_sparse_moe` on disk)."""
    missing = [key for key in stored_keys(model) if key not in files]
    if not missing:
        return {}
    return {key: name for key, name in moe.checkpoint_names(model, missing).items() if name != key}


def layout_mismatch(model: nn.Module, files: dict[str, Path], stored: dict[str, str] | None = None) -> str | None:
    """Why a checkpoint holding the tensors in `files` cannot be read into `model` name by name (or under the
    checkpoint names in `stored`), or None."""
    stored = stored or {}
    missing = next((key for key in stored_keys(model) if stored.get(key, key) not in files), None)
    if missing is None:
        return None
    return (f"the checkpoint does not name its tensors as {type(model).__name__} does ({missing} is not in it: "
            "transformers converts this layout while loading)")


def _assign(model: nn.Module, key: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = key.rpartition(".")
    owner = model.get_submodule(owner_name)
    if attr in owner._parameters:
        old = owner._parameters[attr]
        owner._parameters[attr] = type(old)(tensor, requires_grad=old.requires_grad)
    else:
        owner._buffers[attr] = tensor


def outside(model: nn.Module, layers: nn.Module) -> list[nn.Module]:
    """The largest modules that neither are nor hold `layers`, in module order (embeddings, final norm, lm_head)."""
    found = []
    for child in model.children():
        if child is layers:
            continue
        if any(m is layers for m in child.modules()):
            found.extend(outside(child, layers))
        else:
            found.append(child)
    return found
