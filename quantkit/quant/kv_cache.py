"""The quantized KV cache: which modules hold one, and how its keys and values are seen on calibration data.

vLLM keeps the attention's keys (after RoPE) and values in an FP8 cache when the artifact's quantization config
has a `kv_cache_scheme`; each attention module then carries a `k_scale` and a `v_scale` (compressed-tensors'
layout: shape [1] per tensor, [kv heads, 1, 1] per head). The modules are the ones compressed-tensors gives
those scales (`is_cached_attention_module`: an "...Attention" module with a key / value projection whose forward
takes the cache), so the written names are the ones it and vLLM load. transformers 5.24 renamed
the attention's `past_key_values` argument to `cache`; compressed-tensors 0.20 looks only for the old names, so
the test is made here, for every name.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from quantkit.errors import SourceModelError, UnsupportedModelError
from quantkit.models.architectures import KV_CACHE_PROJECTIONS
from quantkit.grids import float_grids
from quantkit.grids.schemes import KVCacheSpec

Observe = Callable[[str, torch.Tensor, torch.Tensor], None]  # (attention module name, keys, values)


_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")  # transformers >= 5.24, 5.x, 4.x


def cache_argument(module: nn.Module) -> str | None:
    """The name under which `module.forward` takes the model's cache, or None."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in _CACHE_ARGUMENTS if name in parameters), None)


def is_cached_attention(module: nn.Module) -> bool:
    return ("attention" in type(module).__name__.lower()
            and any(hasattr(module, n) for n in KV_CACHE_PROJECTIONS)
            and cache_argument(module) is not None)


def cached_attentions(module: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """The attention modules under `module` that keep a KV cache, by qualified name."""
    named = ((f"{prefix}.{n}" if prefix and n else prefix or n, m) for n, m in module.named_modules())
    return {name: m for name, m in named if is_cached_attention(m)}


def check_model(model: nn.Module, layers: nn.ModuleList) -> None:
    """Every decoder layer has one cached attention module (before any work starts), else a one-line error."""
    for i, layer in enumerate(layers):
        found = cached_attentions(layer)
        if len(found) != 1:
            kind = type(layer).__name__
            what = "no attention module that keeps a KV cache" if not found else f"{len(found)} attention modules"
            raise UnsupportedModelError(
                f"--kv-cache: decoder layer {i} ({kind}) has {what}; the KV cache scales of this architecture are "
                "not supported, leave --kv-cache out"
            )


def scale(absmax: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """absmax / 448 (never 0), float32, in compressed-tensors' shape: [1] per tensor, [heads, 1, 1] per head."""
    qmax = spec.dtype.qrange[1]
    value = (absmax.float() / qmax).clamp(min=torch.finfo(torch.float32).eps)
    return value.reshape(-1, 1, 1) if value.dim() else value.reshape(1)


class _Recorder:
    """Stands in for the model's cache (`past_key_values`): the attention hands it each call's keys and values,
    which it shows to `observe` and returns unchanged (the layer computes as without a cache)."""

    def __init__(self, name: str, observe: Observe):
        self.name, self.observe = name, observe

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.observe(self.name, key_states, value_states)
        return key_states, value_states


@contextlib.contextmanager
def recording(attentions: dict[str, nn.Module], observe: Observe) -> Iterator[None]:
    """Inside: every call of these attention modules shows its keys (after RoPE) and values to `observe`."""

    def hook_for(name: str, module: nn.Module):
        key = cache_argument(module)
        recorder = _Recorder(name, observe)

        def hook(mod, args, kwargs):
            return args, {**kwargs, key: recorder}

        return hook

    handles = [m.register_forward_pre_hook(hook_for(n, m), with_kwargs=True) for n, m in attentions.items()]
    try:
        yield
    except AttributeError as exc:  # the attention asked its cache for more than `update`
        kinds = sorted({type(m).__name__ for m in attentions.values()})
        raise UnsupportedModelError(f"--kv-cache: {', '.join(kinds)} uses its cache beyond update() ({exc}); "
                                    "leave --kv-cache out") from None
    finally:
        for handle in handles:
            handle.remove()


def _fp8(states: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`states` rounded to the FP8 cache's values (scale [1] or [kv heads, 1, 1] against [batch, heads, tokens, dim])."""
    scale = scale.to(states.dtype)
    return float_grids.round_to_fp8(states / scale).to(states.dtype) * scale


class _QuantizingCache:
    """Stands in for the model's cache: rounds the keys and values to FP8 with the attention's `k_scale` /
    `v_scale`, then hands them to the real cache (or back to the attention when it has none), as
    compressed-tensors' `QuantizedKVCache` does; anything else is asked of the real cache."""

    def __init__(self, module: nn.Module, inner):
        self.module, self.inner = module, inner

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = _fp8(key_states, self.module.k_scale), _fp8(value_states, self.module.v_scale)
        return self.inner.update(keys, values, *args, **kwargs) if self.inner is not None else (keys, values)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["inner"], name)


def quantize_cache(model: nn.Module) -> int:
    """Every cached attention module holding a `k_scale` and `v_scale` then computes with the FP8 cache vLLM
    serves, where compressed-tensors installed no quantized cache of its own (its `kv_cache` module; it installs
    none on transformers 5.24's attention). Returns how many modules were hooked here."""
    hooked = 0
    for module in cached_attentions(model).values():
        key = cache_argument(module)
        # compressed-tensors' `kv_cache` replaces the cache passed as past_key_value(s) only; 0.17 installs it on
        # transformers 5.24's attention too (argument `cache`), where it quantizes nothing
        if not hasattr(module, "k_scale") or (hasattr(module, "kv_cache") and key != "cache"):
            continue

        def hook(mod, args, kwargs, key=key):
            return args, {**kwargs, key: _QuantizingCache(mod, kwargs.get(key))}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        hooked += 1
    return hooked


def load_scales(model: nn.Module, path: Path) -> None:
    """The `k_scale` / `v_scale` of every cached attention module from a model directory's safetensors files,
    where loading left them out (transformers drops them as unexpected when compressed-tensors made no place
    for them), then `quantize_cache`. A scale the files lack is a SourceModelError."""
    from safetensors import safe_open

    from quantkit.models import sources
    files = sources.tensor_files(path)
    for name, module in cached_attentions(model).items():
        dtype = next(p.dtype for p in module.parameters() if p.is_floating_point())
        for which in ("k_scale", "v_scale"):
            if hasattr(module, which):
                continue
            key = f"{name}.{which}"
            if key not in files:
                raise SourceModelError(f"{path} declares a quantized KV cache (kv_cache_scheme) but stores no {key}")
            with safe_open(str(files[key]), framework="pt") as handle:
                module.register_parameter(which, nn.Parameter(handle.get_tensor(key).to(dtype), requires_grad=False))
    quantize_cache(model)
