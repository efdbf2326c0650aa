"""Forwards of a bfloat16 / float16 model on a CPU without native instructions for that dtype (calibration and
`eval`'s perplexity): the Linear products run in float32.

On such a CPU (x86 without AVX512-BF16 / AMX, AVX512-FP16 / AMX-FP16), torch's half-precision matmul converts
its way through slow paths: measured on a 2-core AVX2 machine, a 68M bf16 Llama's GPTQ calibration (16 x 256
tokens, 1 thread) took 83 s, and 37 s with the whole model in float32. Computing `F.linear` on the float32
values of the same inputs and weights, then rounding the output to the model's dtype once, is what a native
half-precision GEMM does too (products of half-precision numbers are exact in float32, the sums accumulate in
float32, the output is rounded once): only the order of the float32 sums can differ. The weights stay as they
are; only the products are computed differently, during calibration and perplexity.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

HALF = (torch.bfloat16, torch.float16)
NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def native_half_products(dtype: torch.dtype, cpu_flags: set[str] | None = None) -> bool:
    """Whether this CPU multiplies `dtype` matrices with instructions of its own (x86 flags; other machines: yes,
    leave them as they are)."""
    flags = cpu_flags if cpu_flags is not None else _cpu_flags()
    if flags is None:
        return True
    return any(flag in flags for flag in NATIVE_FLAGS[dtype])


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 matrices natively: a CUDA GPU that supports bf16, a CPU with AVX512-BF16
    or AMX (other CPUs: no; bf16 autocast would be slower than float32 there)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and _cpu_flags() is not None and native_half_products(torch.bfloat16)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of a model's floating-point parameters (its first one; float32 when it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


@contextlib.contextmanager
def float32_products(model_dtype: torch.dtype, device: torch.device) -> Iterator[bool]:
    """Within the block, every `nn.Linear` on the CPU given half-precision inputs computes in float32 and rounds
    its output to the input's dtype, when this CPU has no native products for `model_dtype`. Yields whether it
    is on."""
    if device.type != "cpu" or model_dtype not in HALF or native_half_products(model_dtype):
        yield False
        return
    original = nn.Linear.forward
    nn.Linear.forward = _float32_forward
    try:
        yield True
    finally:
        nn.Linear.forward = original


@contextlib.contextmanager
def tf32_products(device: torch.device | str) -> Iterator[None]:
    """Within the block, float32 products on a CUDA device run on its tensor cores in TF32 (inputs rounded to a 10-bit
    mantissa, products summed in float32: ~7x float32's rate on an H100); the setting is put back after. Elsewhere
    nothing changes. For products whose inputs TF32 holds exactly (16-bit values), or whose use tolerates its
    rounding (a relative 4e-4 at most)."""
    if torch.device(device).type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _float32_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in HALF or x.device.type != "cpu":
        return F.linear(x, self.weight, self.bias)
    bias = self.bias.float() if self.bias is not None else None
    return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux x86), else None."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith("flags")), None)
    return frozenset(line.split(":", 1)[1].split()) if line else None
