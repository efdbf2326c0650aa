"""KV cache scales: the keys (after RoPE) and values each attention module puts in its cache, observed on the
quantized layer (what the cache holds when the artifact is served), merged over all ranks.

Not an algorithm of the recipe's list but a property of the recipe (`kv_cache`, `finalize --kv-cache`): the
pipeline runs this step after the quantizer. It runs the layer once over the calibration batches and returns
the outputs, which are the next layer's inputs (no extra pass where the quantizer did not compute them).
"""

from __future__ import annotations

import time

import torch

from quantkit.calibration.hooks import run_layer_last
from quantkit.calibration.layer import Layer
from quantkit.quant import kv_cache
from quantkit.grids.observers import Observer, activation_observer
from quantkit.grids.schemes import Granularity
from quantkit.runtime import distributed


def kv_cache_step(layer: Layer) -> list[torch.Tensor]:
    """Observe every cached attention module's keys and values: one range per tensor, or per key/value head."""
    started = time.perf_counter()
    spec = layer.recipe.kv_cache
    make = activation_observer(spec.observer)
    per_head = spec.granularity is Granularity.HEAD
    observers: dict[str, list[Observer]] = {}

    def observe(name: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        for which, states in (("k", keys), ("v", values)):  # [batch, kv heads, tokens, head dim]
            parts = [states[:, h] for h in range(states.shape[1])] if per_head else [states]
            found = observers.setdefault(f"{name}.{which}_scale", [make() for _ in parts])
            for observer, part in zip(found, parts):
                observer.update(part)

    attentions = kv_cache.cached_attentions(layer.module, layer.prefix)
    with kv_cache.recording(attentions, observe):
        outputs = run_layer_last(layer)  # the inputs' last reader
    missing = [f"{name}.k_scale" for name in attentions if f"{name}.k_scale" not in observers]
    if missing:
        raise RuntimeError(f"{', '.join(missing)}: the attention never handed its keys to the cache")
    distributed.all_reduce_observers([observer for parts in observers.values() for observer in parts], layer.ctx)
    for name, parts in observers.items():
        absmax = torch.stack([o.absmax() for o in parts]).squeeze(0)
        layer.result.kv_scales[name] = kv_cache.scale(absmax, spec)
        layer.result.kv_ranges[name] = absmax.max().item()
    layer.result.seconds["kv cache"] += time.perf_counter() - started
    return outputs
