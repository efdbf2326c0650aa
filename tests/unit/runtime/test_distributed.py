import pytest
from forked_ranks import on_ranks as _on_ranks
from same_threads import pinned


@pytest.mark.parametrize("world", [1, 2, 3])
def test_rank_shares_cover_the_samples_once(world):
    from quantkit.data import rank_slice

    covered = [i for rank in range(world) for i in rank_slice(16, rank, world)]
    assert covered == list(range(16))


# ---------------------------------------------------------------- collectives, on 1-3 forked gloo ranks


def _scores(i: int) -> float:
    return (i + 1) / 7 + 1e-17 * i  # a float64 value whose every bit matters


@pytest.mark.parametrize("world", [2, 3])
def test_computed_once_runs_each_item_on_one_rank_and_every_rank_gets_all_exactly(world, tmp_path):
    from quantkit.runtime.distributed import computed_once

    def work(ctx):
        ran = []
        values = computed_once(7, lambda i: ran.append(i) or _scores(i), ctx)
        return values, ran

    outcomes = _on_ranks(world, work, tmp_path)
    alone = computed_once(7, _scores, None)
    assert all(values == alone for values, _ in outcomes)  # bit for bit, on every rank
    ran = sorted(i for _, mine in outcomes for i in mine)
    assert ran == list(range(7))  # each once
    assert all(len(mine) < 7 for _, mine in outcomes)  # shared out, not repeated


@pytest.mark.parametrize("world", [2, 3])
def test_gathered_in_order_puts_each_ranks_columns_where_a_single_process_holds_them(world, tmp_path):
    import torch

    from quantkit.data import rank_slice
    from quantkit.runtime.distributed import gathered_in_order

    whole = torch.randn(4, 10, dtype=torch.float64) / 3  # per-batch values of 4 candidates over 10 batches

    def work(ctx):
        mine = rank_slice(10, ctx.rank, ctx.world_size)  # the batches this rank holds (`data.rank_batches`)
        return gathered_in_order(whole[:, mine.start : mine.stop], ctx)

    for table in _on_ranks(world, work, tmp_path):
        assert torch.equal(table, whole)


def _counting_all_reduces():
    """Wrap torch.distributed.all_reduce in this (forked) rank; returns the list its calls are appended to."""
    import torch.distributed as dist

    calls, real = [], dist.all_reduce
    dist.all_reduce = lambda tensor, *a, **k: calls.append(tensor.numel()) or real(tensor, *a, **k)
    return calls


def _rank_observers(rank: int):
    import torch

    from quantkit.grids.observers import HessianObserver, StaticMinMax

    gen = torch.Generator().manual_seed(rank)
    hessian, minmax = HessianObserver(), StaticMinMax()
    hessian.update(torch.randn(2, 40, 300, generator=gen))  # 300 inputs: two row blocks of the upper triangle
    minmax.update(torch.randn(2, 40, 300, generator=gen))
    return hessian, minmax


@pytest.mark.parametrize("bucket_bytes", [None, 1024])
def test_observers_reduce_in_one_collective_per_op_and_dtype_with_the_per_tensor_result(bucket_bytes, tmp_path):
    import torch

    from quantkit.runtime import distributed
    def work(ctx):
        if bucket_bytes:
            distributed.BUCKET_BYTES = bucket_bytes
        calls = _counting_all_reduces()
        hessian, minmax = _rank_observers(ctx.rank)
        distributed.all_reduce_observers([hessian, minmax], ctx)
        return hessian.xtx(), hessian.state["count"], minmax.state["min"], minmax.state["max"], calls

    ranks = _on_ranks(2, work, tmp_path)
    with pinned():  # the ranks' thread count
        (h0, m0), (h1, m1) = _rank_observers(0), _rank_observers(1)
    summed = [(a + b) for a, b in zip(h0.state["xtx"], h1.state["xtx"])]  # float64, two terms: exact in any order
    h0.state["xtx"], h0.state["count"] = summed, h0.state["count"] + h1.state["count"]
    for xtx, count, low, high, calls in ranks:
        assert torch.equal(xtx, h0.xtx()) and count.item() == 160
        assert torch.equal(low, torch.minimum(m0.state["min"], m1.state["min"]))
        assert torch.equal(high, torch.maximum(m0.state["max"], m1.state["max"]))
        if bucket_bytes is None:  # float64 SUM (Hessian blocks + count), float32 MIN, float32 MAX
            assert len(calls) == 3, calls
        else:  # no bucket over 1 KiB, except a tensor larger than that alone
            assert len(calls) > 3


def test_gathered_rows_arrive_packed_in_one_broadcast_per_rank(tmp_path):
    import torch

    from quantkit.runtime.distributed import all_gather_rows

    gen = torch.Generator().manual_seed(3)
    whole = [torch.randint(-8, 8, (300, 64), dtype=torch.int8, generator=gen),
             torch.randn(300, 3, generator=gen).to(torch.bfloat16),
             torch.randn(300, 5, generator=gen).to(torch.float8_e4m3fn)]
    shares = [slice(0, 128), slice(128, 128), slice(128, 300)]  # uneven, one empty

    def work(ctx):
        import torch.distributed as dist

        sent, real = [], dist.broadcast
        dist.broadcast = lambda tensor, *a, **k: sent.append(tensor.dtype) or real(tensor, *a, **k)
        mine = [torch.zeros_like(t) for t in whole]
        for full, part in zip(mine, whole):
            full[shares[ctx.rank]] = part[shares[ctx.rank]]
        all_gather_rows(mine, shares, ctx)
        return [t.view(torch.uint8) for t in mine], sent

    for got, sent in _on_ranks(3, work, tmp_path):
        assert all(torch.equal(g, w.view(torch.uint8)) for g, w in zip(got, whole))
        assert sent == [torch.uint8, torch.uint8]  # one packed broadcast for each rank with rows


@pytest.mark.parametrize("world", [2, 3])
def test_a_factor_computed_by_several_ranks_is_the_one_process_factor(world, tmp_path):
    """GPTQ's inverse-Hessian factor with its blocks shared out (`algorithms.factor`: Cholesky row blocks dealt out,
    panels broadcast; inverse rows shared, exchanged), as `calibration.steps.gptq` shares it: the values one
    process computes, bit for bit, on every rank. 1000 columns: not a multiple of the block."""
    from types import SimpleNamespace

    import torch

    from quantkit.algorithms.factor import factor_
    from quantkit.calibration.steps.gptq import _sharing

    x = torch.randn(2000, 1000, generator=torch.Generator().manual_seed(5))
    matrix = x.T @ x / 2000 + 0.01 * torch.eye(1000)
    alone = matrix.clone()
    with pinned():  # the ranks' thread count: MKL's Cholesky adds in another order on more threads
        assert factor_(alone)

    def work(ctx):
        mine = matrix.clone()
        assert factor_(mine, _sharing(SimpleNamespace(ctx=ctx, distributed=True)))
        return mine

    for got in _on_ranks(world, work, tmp_path):
        assert torch.equal(got, alone)


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_learns_that_the_matrix_is_not_positive_definite(world, tmp_path):
    """A diagonal block that fails its Cholesky (here the third, computed ahead by its owner) reaches every rank as a
    NaN panel: all return False together (GPTQ then retries with more damping), none waits for the others."""
    from types import SimpleNamespace

    import torch

    from quantkit.algorithms.factor import factor_
    from quantkit.calibration.steps.gptq import _sharing

    def work(ctx):
        matrix = torch.eye(700)
        matrix[300, 300] = -1.0
        return factor_(matrix, _sharing(SimpleNamespace(ctx=ctx, distributed=True)))

    assert _on_ranks(world, work, tmp_path) == [False] * world


def test_the_backend_follows_the_compute_device_not_the_machine(monkeypatch):
    """nccl for ranks computing on CUDA (one GPU each), gloo for CPU ranks, also on a machine with GPUs."""
    import torch

    from quantkit.runtime import distributed
    assert distributed.backend("cuda") == "nccl" and distributed.backend("cpu") == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert distributed.rank_device("cpu", 3) == torch.device("cpu")
    assert distributed.rank_device("cuda", 3) == torch.device("cuda", 3)
    assert distributed.rank_device(None, 1) == torch.device("cuda", 1)  # train: the GPU when there is one
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.rank_device(None, 1) == torch.device("cpu")


def test_one_rank_under_torchrun_runs_the_collective_code_path(monkeypatch, tmp_path):
    """A world of one rank under torchrun gets a process group (gloo here; nccl on a GPU), so the collectives of
    N ranks run with one: the path a one-GPU machine exercises. Outside torchrun there is none."""
    import socket

    import torch.distributed as dist

    from quantkit.runtime import distributed
    with distributed.process_group("cpu") as ctx:
        assert not ctx.distributed and not dist.is_initialized()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "test", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with distributed.process_group("cpu") as ctx:
        assert ctx.distributed and ctx.world_size == 1 and dist.get_backend() == "gloo"
        assert distributed.all_reduce_mean(3.0, ctx) == 3.0
    assert not dist.is_initialized()
