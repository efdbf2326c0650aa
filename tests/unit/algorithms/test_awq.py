import torch

from quantkit.algorithms.methods.awq import AWQArgs
from quantkit.algorithms.awq import awq_scales, fold_scales, search_scales


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_scales_are_normalised_and_ratio_zero_is_identity():
    act = torch.rand(32, generator=_gen()) * 10 + 0.1
    scales = awq_scales(act, 0.5)
    torch.testing.assert_close((scales.max() * scales.min()).sqrt(), torch.tensor(1.0))
    torch.testing.assert_close(awq_scales(act, 0.0), torch.ones(32))


def test_folding_into_a_norm_leaves_the_float_output_unchanged():
    x, norm = torch.randn(16, 32, generator=_gen(1)), torch.rand(32, generator=_gen(2)) + 0.5
    weights = [torch.randn(8, 32, generator=_gen(3)), torch.randn(12, 32, generator=_gen(4))]
    before = [(x * norm) @ w.T for w in weights]
    fold_scales(norm, None, weights, awq_scales(x.abs().mean(0), 0.7))
    for b, w in zip(before, weights):
        torch.testing.assert_close((x * norm) @ w.T, b, rtol=1e-5, atol=1e-5)


def test_folding_into_a_linear_with_bias_leaves_the_float_output_unchanged():
    prev, nxt = torch.nn.Linear(24, 32), torch.nn.Linear(32, 8)
    x = torch.randn(5, 24, generator=_gen(5))
    before = nxt(prev(x)).detach()
    fold_scales(prev.weight, prev.bias, [nxt.weight], awq_scales(prev(x).abs().mean(0).detach(), 0.5))
    torch.testing.assert_close(nxt(prev(x)).detach(), before, rtol=1e-5, atol=1e-5)


def test_search_keeps_the_least_error_and_never_worse_than_rtn():
    act = torch.rand(16, generator=_gen(6)) + 0.1
    target = awq_scales(act, 0.35)
    error_of = lambda s: float((s - target).abs().sum())  # noqa: E731 - least at ratio 0.35
    scales, error = search_scales(act, error_of, AWQArgs(grid=20))
    torch.testing.assert_close(scales, target)
    assert error <= error_of(torch.ones(16))
