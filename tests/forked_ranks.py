"""A test helper: run a function on processes joined in a gloo process group."""

from same_threads import THREADS


def on_ranks(world: int, work, tmp_path, start: str = "fork") -> list:
    """`work(ctx)` on `world` processes joined in a gloo group, each computing with `same_threads.THREADS` torch
    threads (a one-process result compared with theirs bit for bit is computed inside `same_threads.pinned()`);
    each rank's return value, in rank order (saved by torch.save, read back with weights_only=True).

    `start` "spawn" for work that runs autograd: where a GPU is visible, a forked child cannot run a backward pass
    once its parent has (autograd's device threads do not survive fork); `work` must then be picklable (a
    module-level function, or a functools.partial of one)."""
    import multiprocessing

    import torch

    context = multiprocessing.get_context(start)
    procs = [context.Process(target=_rank_main, args=(rank, world, work, tmp_path)) for rank in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=180)
    assert [proc.exitcode for proc in procs] == [0] * world
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(world)]


def _rank_main(rank: int, world: int, work, tmp_path) -> None:
    import torch
    import torch.distributed as dist

    from quantkit.runtime.distributed import Context

    torch.set_num_threads(THREADS)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=rank, world_size=world)
    try:
        torch.save(work(Context(rank, world, rank, torch.device("cpu"))), tmp_path / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
