"""Cayley SGD keeps a rotation orthogonal, descends, caps its step, and steps a batch of rotations each alone."""

import math

import torch

from quantkit.algorithms import hadamard
from quantkit.algorithms.cayley import cayley_step, cosine_learning_rate


def _orthogonal(n: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
    return q


def _orthogonality_error(r: torch.Tensor) -> float:
    return float((r.mT @ r - torch.eye(r.shape[-1], dtype=r.dtype)).abs().max())


def test_a_step_stays_orthogonal_even_with_a_huge_gradient():
    r = hadamard.hadamard_matrix(64)
    g = torch.randn(64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1e6
    for _ in range(50):
        r = cayley_step(r, g, learning_rate=1.5)
    assert _orthogonality_error(r) < 1e-12
    assert torch.isfinite(r).all()


def test_steps_descend_towards_a_target_rotation():
    """f(R) = ||R - T||² has its minimum at the orthogonal T; its gradient is 2(R - T)."""
    target, r = _orthogonal(16, 1), _orthogonal(16, 2)
    first = float((r - target).norm())
    for step in range(200):
        r = cayley_step(r, 2 * (r - target), learning_rate=0.2)
    assert float((r - target).norm()) < 0.05 * first
    assert _orthogonality_error(r) < 1e-12


def test_the_step_is_capped_by_the_gradients_norm():
    """A learning rate above 1/||A||₁ moves R exactly as far as that cap: the large rate cannot overshoot."""
    r = _orthogonal(8, 3)
    g = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 100
    assert torch.equal(cayley_step(r, g, learning_rate=10.0), cayley_step(r, g, learning_rate=1e3))
    assert not torch.equal(cayley_step(r, g, learning_rate=1e-4), cayley_step(r, g, learning_rate=1e-3))


def test_a_batch_of_rotations_steps_each_alone():
    rs = torch.stack([_orthogonal(8, s) for s in range(3)])
    gs = torch.randn(3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    gs[1] *= 1e4  # its own cap, not the others'
    batched = cayley_step(rs, gs, learning_rate=0.5)
    for i in range(3):
        torch.testing.assert_close(batched[i], cayley_step(rs[i], gs[i], learning_rate=0.5), rtol=0, atol=1e-12)


def test_a_zero_gradient_leaves_the_rotation():
    r = _orthogonal(8, 6)
    assert torch.equal(cayley_step(r, torch.zeros_like(r), learning_rate=1.5), r)


def test_the_cosine_schedule_starts_at_the_rate_and_decays_to_zero():
    assert cosine_learning_rate(1.5, 0, 100) == 1.5
    assert math.isclose(cosine_learning_rate(1.5, 50, 100), 0.75)
    assert cosine_learning_rate(1.5, 99, 100) < 0.001
