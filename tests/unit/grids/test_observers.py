"""Each observer's statistics over two halves, reduced with its declared ops, equal those over the whole."""

import pytest
import torch

from quantkit.grids.observers import ChannelAbsMax, HessianObserver, ReduceOp, StaticMinMax, reduce_parts


def _data(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(6, 10, 16, generator=generator) * torch.linspace(0.1, 5, 16)


@pytest.mark.parametrize("make", [StaticMinMax, ChannelAbsMax, HessianObserver])
@pytest.mark.parametrize("split", [1, 3, 5])
def test_halves_reduced_equal_the_whole(make, split):
    x = _data()
    whole = make()
    for batch in x.split(2):
        whole.update(batch)
    first, second = make(), make()
    first.update(x[:split])
    second.update(x[split:])
    first.merge([second])
    assert set(first.state) == set(make.REDUCE)
    for key in make.REDUCE:
        torch.testing.assert_close(first.state[key], whole.state[key], rtol=1e-5, atol=1e-5)


def test_declared_ops():
    assert StaticMinMax.REDUCE == {"min": ReduceOp.MIN, "max": ReduceOp.MAX}
    assert ChannelAbsMax.REDUCE == {"absmax": ReduceOp.MAX}
    assert HessianObserver.REDUCE == {"xtx": ReduceOp.SUM, "count": ReduceOp.SUM}


def test_hessian_is_the_gptq_normalisation():
    x = _data().reshape(-1, 16)
    observer = HessianObserver()
    observer.update(x)
    torch.testing.assert_close(observer.hessian(), 2 * x.T @ x / x.shape[0])


@pytest.mark.parametrize("shares", [(3,), (1, 2), (2, 1), (1, 1, 1)])
def test_hessian_is_bit_identical_for_any_split_of_the_batches(shares):
    """Float32 products per batch, summed in float64: however whole batches are shared out to ranks and
    merged, the float32 Hessian is the same (what lets 1 and N ranks write the same GPTQ artifact)."""
    batches = list(_data().split(2))
    whole = HessianObserver()
    for batch in batches:
        whole.update(batch)
    parts, start = [], 0
    for share in shares:
        part = HessianObserver()
        for batch in batches[start : start + share]:
            part.update(batch)
        parts.append(part)
        start += share
    parts[0].merge(parts[1:])
    assert torch.equal(parts[0].hessian(), whole.hessian())


@pytest.mark.parametrize("width", [16, 300, 600])  # one block; blocks with a ragged last one
def test_the_hessian_is_kept_as_upper_blocks_and_comes_out_whole_and_symmetric(width):
    from quantkit.grids import observers
    rows = torch.randn(40, width, generator=torch.Generator().manual_seed(0))
    blocks = observers.gram_blocks(rows)
    assert [b.shape for b in blocks] == [(min(256, width - s), width - s) for s in range(0, width, 256)]
    observer = HessianObserver()
    observer.update(rows[:25])
    observer.update(rows[25:])
    whole = observer.hessian()
    assert torch.equal(whole, whole.T)
    torch.testing.assert_close(whole, 2 * (rows.T.double() @ rows.double()).float() / 40, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(observer.xtx(), (rows.T.double() @ rows.double()).float(), rtol=1e-5, atol=1e-4)
    assert torch.equal(observer.pop_hessian(), whole) and observer.state == {}


def test_static_minmax_absmax_and_reduce_parts():
    observer = StaticMinMax()
    observer.update(torch.tensor([[-3.0, 1.0], [2.0, 0.5]]))
    assert observer.absmax().item() == 3.0
    parts = [torch.tensor([1.0, 5.0]), torch.tensor([3.0, 2.0])]
    assert reduce_parts(parts, ReduceOp.AVG).tolist() == [2.0, 3.5]
    assert reduce_parts(parts, ReduceOp.MIN).tolist() == [1.0, 2.0]


def test_mean_minmax_reduces_exactly_and_averages_batch_ranges():
    from quantkit.grids.observers import MeanMinMax

    x = _data()
    whole = MeanMinMax()
    for batch in x:
        whole.update(batch)
    first, second = MeanMinMax(), MeanMinMax()
    for batch in x[:2]:
        first.update(batch)
    for batch in x[2:]:
        second.update(batch)
    first.merge([second])
    for key in MeanMinMax.REDUCE:
        torch.testing.assert_close(first.state[key], whole.state[key])
    expected = torch.maximum(x.amin((1, 2)).mean().abs(), x.amax((1, 2)).mean().abs())
    torch.testing.assert_close(whole.absmax(), expected)
    assert whole.absmax() <= x.abs().max()


def test_a_batch_longer_than_a_chunk_is_added_chunk_by_chunk_to_the_same_hessian(monkeypatch):
    """A batch is added HESSIAN_CHUNK_TOKENS tokens at a time (no float32 copy of the whole batch): the Hessian is
    the one of the tokens added one chunk at a time, and equals the whole batch's to float32 rounding."""
    from quantkit.grids import observers

    monkeypatch.setattr(observers, "HESSIAN_CHUNK_TOKENS", 5)
    x = torch.randn(3, 7, 40)
    chunked, by_hand = HessianObserver(), HessianObserver()
    chunked.update(x)
    rows = x.reshape(-1, 40)
    monkeypatch.setattr(observers, "HESSIAN_CHUNK_TOKENS", 10**6)
    for start in range(0, rows.shape[0], 5):
        by_hand.update(rows[start:start + 5])
    assert torch.equal(chunked.hessian(), by_hand.hessian())
    whole = HessianObserver()
    whole.update(x)
    torch.testing.assert_close(chunked.hessian(), whole.hessian(), rtol=1e-5, atol=1e-5)
    assert float(chunked.state["count"]) == 21


def test_hessian_takes_16_bit_inputs_and_sums_in_float64():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    observer = HessianObserver()
    observer.update(x)
    observer.update(x)
    assert {b.dtype for b in observer.state["xtx"]} == {torch.float64} and observer.state["count"].item() == 128
    torch.testing.assert_close(observer.hessian(), 2 * (x.float().T @ x.float()) * 2 / 128, rtol=1e-5, atol=1e-4)


def test_an_empty_hessian_says_no_tokens_reached_the_module():
    with pytest.raises(ValueError, match="no calibration tokens"):
        HessianObserver().hessian()
