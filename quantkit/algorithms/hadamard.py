"""Hadamard matrices: the rotations of QuaRot / SpinQuant, the same matrices compressed-tensors and vLLM apply.

A Hadamard matrix H of size n has entries ±1 and H·Hᵀ = n·I, so H/√n is orthogonal: rotating a Linear's input
by it (x → x·H/√n, W → W·H/√n) leaves the layer's output unchanged while spreading an outlier channel over all
n channels, which is what makes 4-bit activations and FP4 work.

Which matrix, for which n (compressed-tensors 0.17.0 to 0.20.0 build them with the same code and file):

- n = 2^k: Sylvester's (H_2n = [[H_n, H_n], [H_n, -H_n]]), the matrix of compressed-tensors'
  `deterministic_hadamard_matrix` and so of its `"hadamard"` transform type; vLLM applies that type online with
  its Sylvester kernel (`hadacore_transform`) and never reads the matrix. Built here rather than by calling it:
  importing compressed_tensors imports transformers (5 s), and pure algorithms stay light. Tested equal.
- n = m·2^k otherwise: H_m from compressed-tensors' `transform/utils/hadamards.safetensors` (N. J. A. Sloane's
  library: every multiple of 4 up to 256, so any n = q·2^k with q odd ≤ 63 and k ≥ 2, e.g. 12·2^k, 20·2^k,
  28·2^k), combined with Sylvester's the way compressed-tensors' `random_hadamard_matrix` combines them: the
  largest stored m with n/m a power of two, the matrix (H_m ⊗ H_{n/m})ᵀ. Its `"hadamard"` type refuses these
  sizes (Sylvester only); its `"random-hadamard"` type uses this matrix with random signs, stored in the
  checkpoint, which vLLM reads. The file is read directly (found without importing the package), not through
  the library's private `_fetch_hadamard_divisor`.
- any other n has no construction here (nor in compressed-tensors or QuaRot): `UnsupportedWidthError`.
  A real one: Qwen2-72B's MLP width 29568 = 231·2^7.

`random_hadamard_matrix(n, seed)` is diag(s)·H with signs s from a CPU `torch.Generator` seeded with `seed`:
every rank draws the same, and it equals compressed-tensors' `random_hadamard_matrix(n, gen=that generator)`
(the signs do not depend on the dtype they are drawn in). For n = 32 its H is the stored 32 (not Sylvester's),
as compressed-tensors'. QuaRot builds its matrices with the same butterfly but picks the smallest known factor
(12 for 3072, where compressed-tensors takes 192): a valid Hadamard matrix, not the same one.

Matrices are built once per size, in float64 with exact ±1 entries, and cached; callers get a copy in their dtype.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from pathlib import Path

import torch

__all__ = ["UnsupportedWidthError", "hadamard_matrix", "random_hadamard_matrix", "hadamard_transform",
           "is_supported_width", "random_signs"]

_CT_FILE = ("transform", "utils", "hadamards.safetensors")


class UnsupportedWidthError(ValueError):
    """No Hadamard matrix of this size can be built (from Sylvester's construction and the known matrices)."""

    def __init__(self, width: int):
        self.width = width
        odd = max(_odd_part(m) for m in _stored())
        super().__init__(f"no Hadamard matrix of size {width}: sizes supported are 2^k, and q·2^k for odd q ≤ {odd} "
                         f"and k ≥ 2 (12·2^k, 20·2^k, 28·2^k, ...)")


def is_supported_width(n: int) -> bool:
    """Whether `hadamard_matrix(n)` exists."""
    return n > 0 and (_is_pow2(n) or _divisor(n) is not None)


def is_power_of_two(n: int) -> bool:
    """Sizes compressed-tensors' "hadamard" type builds (Sylvester's construction)."""
    return _is_pow2(n)


def hadamard_matrix(n: int, *, normalize: bool = True, dtype: torch.dtype = torch.float64,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The Hadamard matrix of size n (see the module docstring for which), divided by √n unless `normalize` is
    False (the ±1 matrix, what a compressed-tensors checkpoint stores for an online transform)."""
    return _finish(_deterministic(n), normalize, dtype, device)


def random_hadamard_matrix(n: int, seed: int, *, normalize: bool = True, dtype: torch.dtype = torch.float64,
                           device: torch.device | str | None = None) -> torch.Tensor:
    """diag(s)·H: compressed-tensors' random-hadamard matrix for a generator seeded with `seed`."""
    return _finish(random_signs(n, seed).unsqueeze(1) * _randomized_base(n), normalize, dtype, device)


def random_signs(n: int, seed: int) -> torch.Tensor:
    """n signs ±1 (float64, CPU) drawn as compressed-tensors draws them: the same on every rank and machine."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=generator, dtype=torch.float64) * 2 - 1


@torch.no_grad()
def hadamard_transform(x: torch.Tensor, *, seed: int | None = None, normalize: bool = True,
                       compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """x·H along the last dimension (x·diag(s)·H with `seed`), in x's dtype, without building the n×n matrix:
    H_m on blocks of n/m, then a fast Walsh-Hadamard transform (log2(n/m) butterflies). Equal to
    `x @ hadamard_matrix(n)` up to rounding in `compute_dtype`."""
    n = x.shape[-1]
    signs, m, h = _operands(n, seed, x.device, compute_dtype)
    y = x.to(compute_dtype)
    if signs is not None:
        y = y * signs
    y = y.unflatten(-1, (m, n // m))
    if h is not None:  # x·(H_mᵀ ⊗ S) reshaped to [m, n/m] is H_m·X·S; H_m·X for every row as one product (Xᵀ·H_mᵀ),
        # not one tiny [m, m] x [m, n/m] product per row (8x slower for 512-wide rows, whose n/m is 2)
        y = (y.transpose(-1, -2) @ h.T).transpose(-1, -2).contiguous()
    y = _fwht(y).flatten(-2)
    if normalize:
        y = y / math.sqrt(n)
    return y.to(x.dtype)


@functools.lru_cache(maxsize=16)
def _operands(n: int, seed: int | None, device: torch.device, dtype: torch.dtype):
    """(the signs or None, m, H_m or None) of `hadamard_transform` at width n, on `device` in `dtype`: made once,
    not on every call (an online rotation runs on every forward of a down projection: drawing the signs and
    copying them and H_m to a GPU each time would synchronise the host every time)."""
    m = 1 if seed is None and _is_pow2(n) else _divisor(n)
    if m is None:
        raise UnsupportedWidthError(n)
    signs = random_signs(n, seed).to(device=device, dtype=dtype) if seed is not None else None
    h = _stored()[m].to(device=device, dtype=dtype) if m > 1 else None
    return signs, m, h


def _finish(matrix: torch.Tensor, normalize: bool, dtype: torch.dtype, device) -> torch.Tensor:
    out = matrix / math.sqrt(matrix.shape[0]) if normalize else matrix.clone()
    return out.to(dtype=dtype, device=device)


@functools.lru_cache(maxsize=4)  # a model needs 2-3 sizes; 14336² float64 is 1.6 GB, so few are kept
def _deterministic(n: int) -> torch.Tensor:
    return _sylvester(n) if n > 0 and _is_pow2(n) else _randomized_base(n)


@functools.lru_cache(maxsize=4)
def _randomized_base(n: int) -> torch.Tensor:
    """(H_m ⊗ S_{n/m})ᵀ for compressed-tensors' m: the matrix its random_hadamard_matrix puts signs on."""
    m = _divisor(n) if n > 0 else None
    if m is None:
        raise UnsupportedWidthError(n)
    return torch.kron(_stored()[m], _sylvester(n // m)).T.contiguous()


def _sylvester(n: int) -> torch.Tensor:
    return _fwht(torch.eye(n, dtype=torch.float64))


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """x·S along the last dimension (a power of two), S Sylvester's ±1 matrix: log2(n) butterflies, each written
    straight into the other of two buffers (3.5x faster than stacking each level's sums and differences: 2.9 ms
    against 10.8 ms for 1024 x 512 float64 on one thread, the same numbers). `x` is left as it is."""
    n, half = x.shape[-1], 1
    x = x.clone(memory_format=torch.contiguous_format)
    y = torch.empty_like(x)
    while half < n:
        pairs, into = x.unflatten(-1, (n // (2 * half), 2, half)), y.unflatten(-1, (n // (2 * half), 2, half))
        torch.add(pairs[..., 0, :], pairs[..., 1, :], out=into[..., 0, :])
        torch.sub(pairs[..., 0, :], pairs[..., 1, :], out=into[..., 1, :])
        x, y = y, x
        half *= 2
    return x


def _divisor(n: int) -> int | None:
    """The largest stored size m with n/m a power of two (compressed-tensors' choice), or None."""
    fits = [m for m in _stored() if n % m == 0 and _is_pow2(n // m)]
    return max(fits, default=None)


@functools.lru_cache(maxsize=1)
def _stored() -> dict[int, torch.Tensor]:
    """Every matrix in compressed-tensors' hadamards.safetensors (sizes 1, 2, 4, 8, 12, 16, ..., 256: 1.4 MB)."""
    from safetensors.torch import load_file

    return {int(size): matrix.to(torch.float64) for size, matrix in load_file(_ct_file()).items()}


def _ct_file() -> Path:
    spec = importlib.util.find_spec("compressed_tensors")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("compressed-tensors is not installed: it holds the Hadamard matrices quantkit uses")
    path = Path(next(iter(spec.submodule_search_locations)), *_CT_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"compressed-tensors has no {'/'.join(_CT_FILE)} at {path}")
    return path


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _odd_part(n: int) -> int:
    return n // (n & -n)
