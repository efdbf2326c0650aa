"""Cayley SGD on the orthogonal group: the optimizer SpinQuant learns its rotations with.

A rotation R (n x n, RᵀR = I) with a loss gradient G moves along the skew-symmetric direction
A = ½(G·Rᵀ - R·Gᵀ) (the gradient projected on the tangent space at R, the ½ as in SpinQuant's SGDG), by the
Cayley transform R ← (I + α/2·A)⁻¹(I - α/2·A)·R, which is orthogonal for any α: no
re-projection is needed. To first order the step is R - α·A·R, a descent direction. As in SGDG, the step size
is capped at 1/‖A‖₁ (the matrix 1-norm), so a large learning rate (SpinQuant's 1.5) cannot overshoot when the
gradient is large. Solved exactly in float64 (SGDG iterates a fixed-point approximation instead).
"""

from __future__ import annotations

import math

import torch

__all__ = ["cayley_step", "cosine_learning_rate"]


@torch.no_grad()
def cayley_step(rotation: torch.Tensor, gradient: torch.Tensor, learning_rate: float) -> torch.Tensor:
    """The rotation after one Cayley SGD step (float64, orthogonal to rounding); `rotation` is not changed. Works
    on a batch of rotations ([..., n, n]), each with its own step cap."""
    r = rotation.to(torch.float64)
    g = gradient.to(torch.float64)
    direction = 0.5 * (g @ r.mT - r @ g.mT)
    norm_one = direction.abs().sum(dim=-2).amax(dim=-1)  # max column sum, per matrix
    step = torch.clamp(1.0 / (norm_one + 1e-8), max=learning_rate)[..., None, None]
    eye = torch.eye(r.shape[-1], dtype=torch.float64, device=r.device)
    return torch.linalg.solve(eye + 0.5 * step * direction, (eye - 0.5 * step * direction) @ r)


def cosine_learning_rate(base: float, step: int, steps: int) -> float:
    """The learning rate at `step` (0-based) of `steps`: cosine from `base` down to zero (SpinQuant's schedule)."""
    return 0.5 * base * (1.0 + math.cos(math.pi * step / max(1, steps)))
