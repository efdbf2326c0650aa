"""Training checkpoints: resume lookup, the one pickle read safely, RNG round trips."""

import random

import pytest
import torch

from quantkit.errors import UsageError
from quantkit.training import checkpoint


def test_latest_and_resolve_resume(tmp_path):
    assert checkpoint.latest(tmp_path) is None
    with pytest.raises(UsageError, match="no checkpoint under"):
        checkpoint.resolve_resume(tmp_path, "latest")
    for step in (5, 10):
        folder = tmp_path / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        torch.save({"step": step}, folder / checkpoint.STATE_FILE)
    assert checkpoint.latest(tmp_path).name == "step-000010"
    assert checkpoint.resolve_resume(tmp_path, "latest") == tmp_path / "checkpoints" / "step-000010"
    with pytest.raises(UsageError, match="not a quantkit checkpoint"):
        checkpoint.resolve_resume(tmp_path, str(tmp_path))


def test_trainer_state_is_read_without_unpickling_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"evil": Evil()}, tmp_path / checkpoint.STATE_FILE)
    with pytest.raises(Exception, match="Weights only load failed"):
        checkpoint.load_state(tmp_path)


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    state = checkpoint.rng_state()
    torch.save(state, tmp_path / checkpoint.STATE_FILE)
    expected = (torch.rand(3), random.random())
    checkpoint.set_rng_state(checkpoint.load_state(tmp_path))
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
