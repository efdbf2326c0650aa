import torch

from quantkit.algorithms.methods.smoothquant import SmoothQuantArgs
from quantkit.algorithms.smoothquant import fold_scales, smoothing_scales


def _setup(seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 32, generator=generator)
    x[:, 3] *= 50  # an outlier channel
    norm = torch.rand(32, generator=generator) + 0.5
    weights = [torch.randn(16, 32, generator=generator), torch.randn(24, 32, generator=generator)]
    return x, norm, weights


def test_smoothing_leaves_the_float_output_unchanged():
    x, norm, weights = _setup()
    before = [(x * norm) @ w.T for w in weights]
    scales = smoothing_scales((x * norm).abs().amax(0), weights, SmoothQuantArgs(alpha=0.8))
    fold_scales(norm, weights, scales)
    after = [(x * norm) @ w.T for w in weights]
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_smoothing_flattens_activation_outliers():
    x, norm, weights = _setup()
    acts = (x * norm).abs().amax(0)
    spread_before = acts.max() / acts.median()
    fold_scales(norm, weights, smoothing_scales(acts, weights, SmoothQuantArgs(alpha=0.8)))
    acts_after = (x * norm).abs().amax(0)
    assert acts_after.max() / acts_after.median() < spread_before / 5


def test_alpha_zero_only_balances_weights():
    x, norm, weights = _setup()
    scales = smoothing_scales((x * norm).abs().amax(0), weights, SmoothQuantArgs(alpha=0.0))
    weight_max = torch.cat(weights).abs().amax(0)
    torch.testing.assert_close(scales, 1 / weight_max)
