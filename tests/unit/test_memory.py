"""The allocator thresholds a streamed finalize sets: the run's, and a lower one around GPTQ's solves that is
always put back."""

from __future__ import annotations

import pytest

from quantkit import memory


@pytest.fixture
def thresholds(monkeypatch):
    """The thresholds handed to glibc, in order (none reach glibc: the test process keeps its own)."""
    calls: list[int] = []
    monkeypatch.setattr(memory, "_set_threshold", calls.append)
    monkeypatch.setattr(memory, "_threshold", None)
    return calls


def test_a_run_loaded_whole_keeps_the_allocators_own_threshold(thresholds):
    with memory.mapped_from():
        pass
    assert thresholds == []


def test_the_solve_threshold_is_set_within_and_the_runs_put_back_after(thresholds):
    memory.map_large_allocations()
    with memory.mapped_from():
        assert thresholds == [memory.RUN_THRESHOLD, memory.SOLVE_THRESHOLD]
    assert thresholds[-1] == memory.RUN_THRESHOLD


def test_the_runs_threshold_is_put_back_when_the_solve_fails(thresholds):
    memory.map_large_allocations(8 << 20)
    with pytest.raises(ValueError), memory.mapped_from(1 << 20):
        raise ValueError("not positive definite")
    assert thresholds == [8 << 20, 1 << 20, 8 << 20]
