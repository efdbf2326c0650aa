import pytest


@pytest.mark.parametrize("world", [1, 2, 3])
def test_rank_shares_cover_the_samples_once(world):
    from quantkit.data import rank_slice

    covered = [i for rank in range(world) for i in rank_slice(16, rank, world)]
    assert covered == list(range(16))
