"""Quantization algorithms, registered explicitly by name. Each is a pure function over tensors:
`fn(weight, spec, **kwargs) -> QuantizedWeight`."""

from __future__ import annotations

from typing import Callable

from quantkit.registry import Algorithm


_ALGORITHMS: dict[Algorithm, Callable] = {}


def register(name: Algorithm) -> Callable[[Callable], Callable]:
    def decorator(fn: Callable) -> Callable:
        if name in _ALGORITHMS:
            raise ValueError(f"algorithm {name.value} registered twice")
        _ALGORITHMS[name] = fn
        return fn

    return decorator


def get_algorithm(name: Algorithm) -> Callable:
    return _ALGORITHMS[name]


from quantkit.algorithms import gptq, rtn  # noqa: E402,F401  (rtn registers itself)

register(Algorithm.GPTQ)(gptq.gptq_quantize)
