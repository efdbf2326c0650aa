"""What quantkit needs of compressed-tensors that its older releases lack, written here for them.

quantkit installs beside the serving stack: vLLM 0.28-0.30 pins compressed-tensors 0.17.0 and llm-compressor 0.14
pins 0.19.0, while 0.20 is the newest. Each function here calls the library's own where it has what quantkit
needs, and otherwise does the missing part itself; `tests/unit/export/test_ct_compat.py` checks that the result
is the newer library's, bit for bit.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


def version() -> str:
    from importlib.metadata import version as installed

    return installed("compressed-tensors")


def apply_quantization_config(model: nn.Module, config, allowed_modules: Iterable[nn.Module] | None = None) -> None:
    """compressed-tensors' `apply_quantization_config` without its progress bar (0.19+), on the modules in
    `allowed_modules` only where given: 0.20's argument; for 0.17 to 0.19, the modules it matches and the
    attention modules it gives a KV cache scheme are narrowed to those while it runs."""
    from compressed_tensors.quantization.lifecycle import apply

    accepted = inspect.signature(apply.apply_quantization_config).parameters
    kwargs = {"show_progress": False} if "show_progress" in accepted else {}
    if allowed_modules is None:
        apply.apply_quantization_config(model, config, **kwargs)
    elif "allowed_modules" in accepted:
        apply.apply_quantization_config(model, config, allowed_modules=list(allowed_modules), **kwargs)
    else:
        with _narrowed(apply, {id(module) for module in allowed_modules}):
            apply.apply_quantization_config(model, config, **kwargs)


@contextmanager
def _narrowed(apply, allowed: set[int]) -> Iterator[None]:
    """Inside: the `apply` module's module matching and attention check see only the modules whose ids are in
    `allowed` (what 0.20's `allowed_modules` does)."""
    attention_check = "is_cached_attention_module" if hasattr(apply, "is_cached_attention_module") else "is_attention_module"
    match, is_attention = apply.match_named_modules, getattr(apply, attention_check)

    def matched(*args, **kwargs):
        return ((name, module) for name, module in match(*args, **kwargs) if id(module) in allowed)

    apply.match_named_modules = matched
    setattr(apply, attention_check, lambda module: id(module) in allowed and is_attention(module))
    try:
        yield
    finally:
        apply.match_named_modules = match
        setattr(apply, attention_check, is_attention)


def _release() -> tuple[int, int]:
    major, minor = (int(part) for part in version().split(".")[:2])
    return major, minor


def cannot_pack(bits: int) -> str | None:
    """Why the installed compressed-tensors cannot write `bits`-bit integer weights as pack-quantized the way
    0.18+ does (3, 5, 6 and 7 bits densely across int32 words; 0.17 packs 32 // bits values a word, a layout of
    the same name that 0.18+ reads wrong), or None."""
    if 32 % bits == 0 or _release() >= (0, 18):
        return None
    return (f"{bits}-bit weights need compressed-tensors >= 0.18 (dense pack-quantized; {version()} is installed: "
            "pip install 'compressed-tensors>=0.18')")


def sizes_packed_zero_points_unpacked() -> bool:
    """Whether the installed compressed-tensors (0.18+) prepares an asymmetric pack-quantized module for loading
    with unpacked zero points, so that plain transformers cannot load such artifacts (llm-compressor #1618)."""
    return _release() >= (0, 18)


def dequantizes_by_scheme() -> bool:
    """Whether the installed compressed-tensors dequantizes float- and int-quantized weights with the scheme's
    arguments (0.19+); 0.17 and 0.18 infer the layout from the scale's shape, which takes FP8 blocks for channels
    where a weight is one block wide and fails where a weight is not a whole number of blocks."""
    return _release() >= (0, 19)


def compute_as_newer_releases() -> None:
    """From now on in this process, compressed-tensors 0.17 and 0.18 compute as 0.19+ does where quantkit relies
    on it (a no-op on 0.19+): they dequantize float- and int-quantized weights (the naive-quantized compressor:
    FP8, MXFP8, int8) with the scheme's arguments, and round to FP4 eagerly (0.17 runs its FP4 rounding through
    torch.compile, which on CPU needs a C++ compiler, compiles for seconds and leaves files in the temporary
    directory). Called before compressed-tensors installs, packs or loads anything."""
    if dequantizes_by_scheme():
        return
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA

    NaiveQuantizationCompressor.decompress = classmethod(_decompress)
    FP4_E2M1_DATA.cast_to_fp4 = staticmethod(_cast_to_fp4)


def _decompress(cls, state_dict: dict, scheme) -> dict:
    """compressed-tensors 0.20's `NaiveQuantizationCompressor.decompress`."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    state_dict = dict(state_dict)
    weight = state_dict.pop("weight")
    state_dict["weight"] = dequantize(x_q=weight, scale=state_dict.get("weight_scale"),
                                      zero_point=state_dict.get("weight_zero_point"), args=scheme.weights)
    return state_dict


def _cast_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors 0.20's `cast_to_fp4` on CPU (0.17's, without torch.compile): the nearest FP4 E2M1 value,
    ties as it breaks them."""
    sign = torch.sign(x)
    x = torch.abs(x)
    x[(x >= 0.0) & (x <= 0.25)] = 0.0
    x[(x > 0.25) & (x < 0.75)] = 0.5
    x[(x >= 0.75) & (x <= 1.25)] = 1.0
    x[(x > 1.25) & (x < 1.75)] = 1.5
    x[(x >= 1.75) & (x <= 2.5)] = 2.0
    x[(x > 2.5) & (x < 3.5)] = 3.0
    x[(x >= 3.5) & (x <= 5.0)] = 4.0
    x[x > 5.0] = 6.0
    return x * sign
