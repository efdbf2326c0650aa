"""AutoRound against references: V = 0 with unit clipping is RTN bit for bit; the learned grid is the fake-quantized
weight the tuning saw; the gradients are autograd's through a plain straight-through reference; tuning lowers a
small layer's output error below RTN's; the same seed gives the same rounding."""

import pytest
import torch

from quantkit import algorithms
from quantkit.algorithms.methods.autoround import AutoRoundArgs
import threading

from quantkit.algorithms import autoround
from quantkit.algorithms.autoround import Rounding, draws, fake_quantize, quantize, tune
from quantkit.grids import quantize_weight
from quantkit.quant.registry import parse_recipe
from quantkit.grids.schemes import Granularity, QDtype, ScaleDtype, SchemeError, WeightSpec

INT4_G32 = WeightSpec(QDtype.INT4, Granularity.GROUP, group_size=32)
INT4_G128 = WeightSpec(QDtype.INT4, Granularity.GROUP, group_size=128)
INT4_G32_ASYM = WeightSpec(QDtype.INT4, Granularity.GROUP, group_size=32, symmetric=False)
INT2_G32 = WeightSpec(QDtype.INT2, Granularity.GROUP, group_size=32)
INT3_G32_F32 = WeightSpec(QDtype.INT3, Granularity.GROUP, group_size=32, scale_dtype=ScaleDtype.FLOAT32)
INT8_CHANNEL = WeightSpec(QDtype.INT8, Granularity.CHANNEL)
SPECS = [INT4_G32, INT4_G128, INT4_G32_ASYM, INT2_G32, INT3_G32_F32, INT8_CHANNEL]
IDS = ["int4-g32", "int4-g128", "int4-g32-asym", "int2-g32", "int3-g32-f32scale", "int8-channel"]


def _weight(dtype=torch.float32, out=48, inp=256, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(out, inp, generator=generator) * 0.05).to(dtype)


def _random_rounding(weight, spec, seed=3):
    generator = torch.Generator().manual_seed(seed)
    rounding = Rounding.nearest(weight, spec)
    rounding.value.uniform_(-0.5, 0.5, generator=generator)
    rounding.min_scale.uniform_(0.7, 1.0, generator=generator)
    rounding.max_scale.uniform_(0.7, 1.0, generator=generator)
    return rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_nearest_rounding_is_rtn_bit_for_bit(spec, dtype):
    weight = _weight(dtype)
    ours = quantize(weight, Rounding.nearest(weight, spec), spec)
    rtn = quantize_weight(weight, spec)
    assert torch.equal(ours.qdata, rtn.qdata)
    assert ours.scale.dtype == rtn.scale.dtype and torch.equal(ours.scale, rtn.scale)
    assert (ours.zero_point is None and rtn.zero_point is None) or torch.equal(ours.zero_point, rtn.zero_point)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_learned_grid_is_the_fake_quantized_weight_tuning_saw(spec):
    weight = _weight()
    rounding = _random_rounding(weight, spec)
    qweight = quantize(weight, rounding, spec)
    torch.testing.assert_close(qweight.dequantize(torch.float32), fake_quantize(weight, rounding, spec), atol=0, rtol=0)
    qmin, qmax = spec.dtype.qrange
    assert qmin <= int(qweight.qdata.min()) and int(qweight.qdata.max()) <= qmax


def _reference_fake_quantize(weight, value, min_scale, max_scale, spec):
    """auto-round's `quant_tensor_sym` / `quant_tensor_asym`, written out plainly on quantkit's grid (scale from
    the clipped range over (qmax - qmin) / 2 symmetric, (qmax - qmin) asymmetric)."""
    qmin, qmax = spec.dtype.qrange
    groups = weight.float().reshape(weight.shape[0], -1, weight.shape[1] // min_scale.shape[1])
    ste = lambda x: (x.round() - x).detach() + x  # noqa: E731
    low = torch.clamp(groups.min(-1)[0] * min_scale, max=0)
    high = torch.clamp(groups.max(-1)[0] * max_scale, min=0)
    if spec.symmetric:
        scale, zero = (torch.max(-low, high) / ((qmax - qmin) / 2)).unsqueeze(-1), 0.0
    else:
        scale = ((high - low) / (qmax - qmin)).unsqueeze(-1)
        zero = torch.clamp(qmin - ste(low.unsqueeze(-1) / scale), qmin, qmax)
    q = torch.clamp(ste(groups / scale + value.reshape(groups.shape)) + zero, qmin, qmax)
    return ((q - zero) * scale).reshape(weight.shape)


@pytest.mark.parametrize("spec", [INT4_G32, INT4_G32_ASYM, INT2_G32], ids=["int4-g32", "int4-g32-asym", "int2-g32"])
def test_gradients_match_autograd_through_a_straight_through_reference(spec):
    torch.manual_seed(0)
    weight, x = _weight(out=16, inp=64), torch.randn(2, 10, 64)
    target = x @ weight.T
    rounding = _random_rounding(weight, spec)

    def grads(fake_quantize_fn):
        params = [t.detach().clone().requires_grad_() for t in rounding.tensors()]
        loss = torch.nn.functional.mse_loss(x @ fake_quantize_fn(weight, *params).T, target)
        return torch.autograd.grad(loss, params)

    ours = grads(lambda w, v, a, b: fake_quantize(w, Rounding(v, a, b), spec))
    reference = grads(lambda w, v, a, b: _reference_fake_quantize(w, v, a, b, spec))
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-9)
    # and V's gradient is dL/dW times the group's scale where the grid does not clamp (the STE's derivative)
    fake = fake_quantize(weight, rounding, spec).requires_grad_()
    dw, = torch.autograd.grad(torch.nn.functional.mse_loss(x @ fake.T, target), fake)
    assert torch.count_nonzero(ours[0]) > 0.8 * ours[0].numel()
    assert torch.equal(torch.sign(ours[0])[ours[0] != 0], torch.sign(dw)[ours[0] != 0])


@pytest.mark.parametrize("case", ["symmetric", "asymmetric", "fixed-clipping"])
def test_grid_rounding_gives_autograds_straight_through_gradients(case):
    """The fused rounding onto the grid (`_RoundToGrid`): its output is the plain expression's bit for bit, and its
    gradients are autograd's through it (round passed straight through, clamp's gradient only inside the grid),
    with clamped elements on both ends, a zero point that takes gradients, and a scale that takes none."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(6, 4, 16, generator=generator)
    scale = (values.abs().amax(-1, keepdim=True) / 7.5).requires_grad_(case != "fixed-clipping")
    value = (torch.rand(values.shape, generator=generator) * 3 - 1.5).requires_grad_()  # past the grid's ends too
    zero = torch.randint(-3, 4, (6, 4, 1), generator=generator).float().requires_grad_() if case == "asymmetric" else None
    qmin, qmax = -8, 7

    def plain(values, value, scale, zero):
        shifted = autoround.round_ste(values * (1.0 / scale) + value) + (0 if zero is None else zero)
        return (torch.clamp(shifted, qmin, qmax) - (0 if zero is None else zero)) * scale

    ours = autoround._RoundToGrid.apply(values, value, scale, zero, qmin, qmax)
    theirs = plain(values, value, scale, zero)
    assert torch.equal(ours, theirs)
    shifted = values / scale.detach() + value.detach()
    assert (shifted.round() > qmax).any() and (shifted.round() < qmin).any()  # both ends clamp somewhere
    inputs = [t for t in (value, scale, zero) if t is not None and t.requires_grad]
    upstream = torch.randn(values.shape, generator=generator)
    for a, b in zip(torch.autograd.grad(ours, inputs, upstream), torch.autograd.grad(theirs, inputs, upstream)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _structured_layer(seed=0, inp=128, out=64, tokens=64, samples=16):
    """A Linear on correlated inputs with a few large features, as trained models see (RTN's error is uneven)."""
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(inp, inp, generator=generator) / inp**0.5
    gains = 1 + 6 * torch.rand(inp, generator=generator) ** 4
    xs = [(torch.randn(tokens, inp, generator=generator) * gains) @ mixing for _ in range(samples)]
    return _weight(out=out, inp=inp, seed=seed + 1), xs


def _output_error(weight, qweight, xs):
    return sum(((x @ weight.T - x @ qweight.T) ** 2).mean().item() for x in xs) / len(xs)


def _reference_full_range(weight, value, min_scale, max_scale, spec):
    """auto-round's `quant_tensor_sym` (`data_type/int.py`), written out plainly: the scale is the larger side of the
    clipped range over 2^(bits-1), negative where that side is the maximum, so that side lands on -2^(bits-1)."""
    maxq = -spec.dtype.qrange[0]
    groups = weight.float().reshape(weight.shape[0], -1, weight.shape[1] // min_scale.shape[1])
    ste = lambda x: (x.round() - x).detach() + x  # noqa: E731
    wmin_abs = -(torch.clamp(groups.min(-1)[0], max=0) * min_scale)
    wmax_abs = torch.clamp(groups.max(-1)[0], min=0) * max_scale
    max_v = (2 * (wmax_abs < wmin_abs).int() - 1) * torch.max(wmax_abs, wmin_abs)
    scale = max_v / maxq
    scale = torch.where(scale < 0, torch.clamp(scale, max=-1e-5), torch.clamp(scale, min=1e-5)).unsqueeze(-1)
    q = torch.clamp(ste(groups / scale + value.reshape(groups.shape)), -maxq, maxq - 1)
    return (q * scale).reshape(weight.shape)


@pytest.mark.parametrize("spec", [INT4_G32, INT2_G32, INT3_G32_F32], ids=["int4-g32", "int2-g32", "int3-g32-f32scale"])
def test_full_range_grid_is_auto_rounds_with_its_gradients(spec):
    torch.manual_seed(0)
    weight, x = _weight(out=16, inp=64), torch.randn(2, 10, 64)
    rounding = _random_rounding(weight, spec)
    ours = fake_quantize(weight, rounding, spec, full_range=True)
    torch.testing.assert_close(ours, _reference_full_range(weight, *rounding.tensors(), spec), rtol=1e-6, atol=0)
    qweight = quantize(weight, rounding, spec, full_range=True)  # what tuning saw is what is written
    torch.testing.assert_close(qweight.dequantize(torch.float32), ours, atol=0, rtol=0)
    assert (qweight.scale < 0).any() and (qweight.scale > 0).any() and qweight.zero_point is None

    def grads(fake_quantize_fn):
        params = [t.detach().clone().requires_grad_() for t in rounding.tensors()]
        loss = torch.nn.functional.mse_loss(x @ fake_quantize_fn(weight, *params).T, x @ weight.T)
        return torch.autograd.grad(loss, params)

    mine = grads(lambda w, v, a, b: fake_quantize(w, Rounding(v, a, b), spec, full_range=True))
    theirs = grads(lambda w, v, a, b: _reference_full_range(w, v, a, b, spec))
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9)


def test_full_range_puts_each_groups_larger_side_on_the_grid():
    """Unlike the min-max grid (its scale is max|w| / 1.5 at 2 bits, so +max|w| rounds to 0.67 max|w|), the full
    range represents the extreme of each group exactly (up to the scale's rounding): all four 2-bit levels used."""
    weight = _weight(out=8, inp=64)
    nearest = Rounding.nearest(weight, INT2_G32)
    deq = quantize(weight, nearest, INT2_G32, full_range=True).dequantize(torch.float32).reshape(8, -1, 32)
    groups = weight.reshape(8, -1, 32)
    extreme = torch.where(groups.amax(-1) > -groups.amin(-1), groups.amax(-1), groups.amin(-1))
    larger = torch.gather(deq, -1, (groups - extreme.unsqueeze(-1)).abs().argmin(-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(larger, extreme, rtol=1e-6, atol=0)
    minmax = quantize(weight, nearest, INT2_G32).dequantize(torch.float32).reshape(8, -1, 32)
    assert ((groups - deq) ** 2).sum() != ((groups - minmax) ** 2).sum()


def _linear_loss(weight, xs, amp=False):
    """A Linear's `SampleLoss`: each sample's mean squared output error, the samples stacked in one product (in
    bf16 autocast with `amp`)."""
    stacked = torch.stack(xs)

    def sample_loss(fake, samples):
        x = stacked[samples]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = x @ fake["w"].T
        return ((out.float() - x @ weight.T) ** 2).flatten(1).mean(1)

    return sample_loss


def _tune_linear(weight, xs, spec, args, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return tune({"w": weight}, {"w": spec}, _linear_loss(weight, xs), len(xs), generator, args)


@pytest.mark.parametrize("full_range", [True, False], ids=["full-range", "min-max"])
@pytest.mark.parametrize("spec", [INT4_G32, INT2_G32], ids=["int4-g32", "int2-g32"])
def test_tuning_lowers_the_layer_output_error_below_rtn(spec, full_range):
    weight, xs = _structured_layer()
    args = AutoRoundArgs(iters=60, batch_size=4, full_range=full_range)
    tuned = _tune_linear(weight, xs[:12], spec, args)
    learned = quantize(weight, tuned.roundings["w"], spec, args.full_range).dequantize(torch.float32)
    rtn = quantize_weight(weight, spec).dequantize(torch.float32)
    assert _output_error(weight, learned, xs[:12]) < 0.8 * _output_error(weight, rtn, xs[:12])
    assert _output_error(weight, learned, xs[12:]) < _output_error(weight, rtn, xs[12:])  # held-out samples too
    assert tuned.best_loss < tuned.first_loss


@pytest.mark.parametrize("per_pass", [1, 3])
def test_step_gradient_is_autograd_of_the_summed_loss_through_the_fake_quantization(per_pass):
    """One fake-quantization a step: the passes' gradients with respect to the fake-quantized weight, summed and
    carried back through the fake-quantization once, are autograd's gradients of the summed loss; each sample's
    loss comes back in its place, whichever pass it was in."""
    weight, xs = _structured_layer(samples=6)
    rounding = _random_rounding(weight, INT4_G32_ASYM)
    params = [t.requires_grad_() for t in rounding.tensors()]
    sample_loss = _linear_loss(weight, xs)
    chosen = [0, 2, 3, 5]
    fake = {"w": fake_quantize(weight, rounding, INT4_G32_ASYM)}
    flat, losses = autoround._gradients({"w": fake["w"].detach().requires_grad_()}, sample_loss,
                                        autoround.passes(chosen, per_pass))
    ours = autoround._through_fake_quantization(fake, params, flat)
    fake = {"w": fake_quantize(weight, rounding, INT4_G32_ASYM)}  # that graph is spent: again, for autograd's own
    reference = torch.autograd.grad(sum(sample_loss(fake, [s]).sum() for s in chosen), params)
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(losses, torch.cat([sample_loss(fake, [s]) for s in chosen]).double().detach())


def test_passes_cut_a_step_into_consecutive_runs_of_samples():
    assert autoround.passes([1, 4, 5, 7, 9], 2) == [[1, 4], [5, 7], [9]]
    assert autoround.passes([1, 4, 5], 4) == [[1, 4, 5]] and autoround.passes([1, 4], 1) == [[1], [4]]


def _tune_on_ranks(weight, xs, spec, args, ranks, per_pass=None, pass_dtype=None, amp=False):
    """`tune` on `ranks` threads, each holding a contiguous slice of the samples and running their passes, one
    sample a pass (or, with `per_pass`, running the passes dealt to it), each rank's table rows copied to the
    others as `distributed.all_gather_rows` does; every rank's result."""
    held, tables, results = len(xs) // ranks, [None] * ranks, [None] * ranks
    barrier = threading.Barrier(ranks)

    def run(rank):
        def gather_rows(tensors, shares):
            tables[rank] = tensors
            barrier.wait()
            for other in range(ranks):
                for into, source in zip(tensors, tables[other]):
                    if other != rank:
                        into[shares[other]] = source[shares[other]]
            barrier.wait()

        if per_pass is None:  # each rank its own slice of the samples, one a pass
            owner = lambda place, samples: samples[0] // held  # noqa: E731
        else:  # the step's passes dealt out
            owner = lambda place, samples: place % ranks  # noqa: E731
        share = autoround.Share(rank, ranks, owner, gather_rows)
        results[rank] = tune({"w": weight}, {"w": spec}, _linear_loss(weight, xs, amp), len(xs),
                             torch.Generator().manual_seed(0), args, per_pass or 1, share, pass_dtype)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.parametrize("per_pass", [None, 1, 2, 3], ids=["held", "dealt-1", "dealt-2", "dealt-3"])
def test_one_and_several_ranks_tune_the_same_rounding_bit_for_bit(per_pass):
    """Each pass's gradient is the same tensor on whichever rank runs it, and every rank adds the passes up in pass
    order: 1, 2 and 3 ranks take the same steps (3 samples a pass: passes of 3, 3 and 2 samples; on 2 ranks one
    runs two of them)."""
    weight, xs = _structured_layer(samples=8)
    args = AutoRoundArgs(iters=20, batch_size=8)
    one, = _tune_on_ranks(weight, xs, INT4_G32, args, 1, per_pass)
    for ranks in (2, 3) if per_pass else (2,):
        for other in _tune_on_ranks(weight, xs, INT4_G32, args, ranks, per_pass):
            assert all(torch.equal(a, b) for a, b in zip(one.roundings["w"].tensors(), other.roundings["w"].tensors()))
            assert (other.first_loss, other.best_loss, other.best_iter) == (one.first_loss, one.best_loss, one.best_iter)


def test_samples_per_pass_changes_the_sums_not_the_tuning():
    """Passes of several samples sum the samples' gradients inside one product instead of afterwards: not the same
    bits as one sample a pass, but the same tuning to within the rounding of those sums."""
    weight, xs = _structured_layer(samples=8)
    args = AutoRoundArgs(iters=30, batch_size=8)
    single, = _tune_on_ranks(weight, xs, INT4_G32, args, 1, 1)
    shared, = _tune_on_ranks(weight, xs, INT4_G32, args, 1, 4)
    assert abs(shared.best_loss - single.best_loss) < 0.02 * single.best_loss
    assert (shared.roundings["w"].value == single.roundings["w"].value).float().mean() > 0.95


def test_bf16_passes_give_the_gradients_autocast_gives_float32_weights():
    """Under bf16 autocast a product's gradient comes out of a bf16 product either way: weights handed to the
    passes in bf16 (half the bytes to gather) tune exactly as float32 ones, on 1 and 2 ranks."""
    weight, xs = _structured_layer(samples=8)
    args = AutoRoundArgs(iters=10, batch_size=8)
    as_float, = _tune_on_ranks(weight, xs, INT4_G32, args, 1, 4, amp=True)
    as_bf16 = _tune_on_ranks(weight, xs, INT4_G32, args, 2, 4, torch.bfloat16, amp=True)
    for other in as_bf16:
        assert all(torch.equal(a, b) for a, b in zip(as_float.roundings["w"].tensors(), other.roundings["w"].tensors()))
        assert other.best_loss == as_float.best_loss


def test_same_seed_same_rounding_and_bounds_hold():
    weight, xs = _structured_layer(samples=8)
    args = AutoRoundArgs(iters=300, batch_size=2, lr=0.01, minmax_lr=0.01)  # steps that add up past the bounds
    first, again = (_tune_linear(weight, xs, INT4_G32, args, seed=5) for _ in range(2))
    for a, b in zip(first.roundings["w"].tensors(), again.roundings["w"].tensors()):
        assert torch.equal(a, b)
    value, low, high = first.roundings["w"].tensors()
    assert value.abs().max() <= 0.5 and low.min() >= 0 and high.max() <= 1


def test_draws_are_auto_rounds_cyclic_shuffled_batches():
    steps = draws(10, 4, 6, torch.Generator().manual_seed(0))
    assert all(len(s) == 4 and len(set(s)) == 4 for s in steps)
    assert len(set(steps[0]) | set(steps[1])) == 8  # one pass through a shuffled order, then a reshuffle
    assert steps == draws(10, 4, 6, torch.Generator().manual_seed(0))
    assert draws(3, 8, 2, torch.Generator().manual_seed(0)) == [[0, 1, 2], [0, 1, 2]]  # batch capped at the samples


def test_registered_and_arguments_checked():
    autoround = algorithms.get("autoround")
    assert autoround.quantizer and autoround.needs_data and autoround.float_reference
    args = AutoRoundArgs(iters=50)
    assert args.rounding_lr == args.clipping_lr == 1 / 50
    assert AutoRoundArgs(iters=50, lr=0.1).clipping_lr == 0.1
    assert autoround.parse_arguments({"lr": None, "minmax_lr": 1}) == {"lr": None, "minmax_lr": 1.0}
    for bad in ({"iters": 0}, {"batch_size": 0}, {"samples_per_pass": 0}, {"lr": -1.0}, {"lr": "fast"}, {"steps": 3}):
        with pytest.raises(SchemeError):
            autoround.parse_arguments(bad)


@pytest.mark.parametrize("scheme,message", [
    ({"weights": {"dtype": "float8_e4m3fn", "granularity": "channel"}}, "integer weights"),
    ({"weights": {"dtype": "int8", "granularity": "channel"},
      "activations": {"dtype": "int8", "dynamic": False}}, "static activation"),
])
def test_recipe_refuses_grids_autoround_cannot_tune(scheme, message):
    with pytest.raises(SchemeError, match=message):
        parse_recipe("bad", {"scheme": scheme, "algorithm": {"name": "autoround"}, "format": "compressed-tensors"})
