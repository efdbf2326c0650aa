"""The work directory's hidden-state files, rank by rank: what a resume needs is always there, a rank on another
machine (its own DST.partial, no shared file system) keeps two layers' inputs at most, and a finished run leaves
nothing. Checkpoints of the hidden states come at most every `every` seconds, and an interrupted run saves the
one held back. Ranks are played in turn in one process (barriers are no-ops at world size 1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from quantkit.calibration.layer import CalibrationResult
from quantkit.calibration.resume import Resumable
from quantkit.runtime.distributed import Context

LAYERS = 4


def rank(path, index: int, every: float = 0.0) -> Resumable:
    return Resumable(path, {"ranks": "2"}, resume=False, ctx=Context(index, 1, 0, torch.device("cpu")), every=every)


def save(work: Resumable, index: int) -> None:
    work.save_layer(index, nn.Linear(8, 8), f"model.layers.{index}", CalibrationResult(), [torch.randn(2, 4, 8)], LAYERS)


def hidden_files(path) -> list[str]:
    return sorted(p.name for p in path.glob("hidden-*"))


def test_a_rank_on_another_machine_keeps_two_layers_of_inputs_and_removes_them_at_the_end(tmp_path):
    work = rank(tmp_path / "out.partial", 1)
    for index in range(LAYERS):
        save(work, index)
        kept = [i for i in (index, index + 1) if 1 <= i < LAYERS]  # this layer's inputs until rank 0's state moves on
        assert hidden_files(work.path) == [f"hidden-{i:05d}-rank1.safetensors" for i in kept]
    work.finish()
    assert not work.path.exists()


def test_in_a_shared_directory_the_state_always_has_its_inputs(tmp_path):
    ranks = [rank(tmp_path / "out.partial", r) for r in (0, 1)]
    for index in range(LAYERS):
        for work in ranks:
            save(work, index)
        completed = json.loads((tmp_path / "out.partial" / "state.json").read_text())["completed"]
        expected = [f"hidden-{completed:05d}-rank{r}.safetensors" for r in (0, 1)] if completed < LAYERS else []
        assert hidden_files(tmp_path / "out.partial") == expected
    for work in reversed(ranks):
        work.finish()
    assert not (tmp_path / "out.partial").exists()


def test_a_rank_finishing_while_rank_0_removes_the_shared_directory_does_not_fail(tmp_path, monkeypatch):
    """Every rank finishes after the last barrier: rank 0's removal of the shared directory can land while another
    rank lists its leftovers there (seen under load as `FileNotFoundError: ... out.partial` failing rank 1 of a
    finished run)."""
    ranks = [rank(tmp_path / "out.partial", r) for r in (0, 1)]
    for index in range(LAYERS):
        for work in ranks:
            save(work, index)

    def listing_while_removed(self, pattern):  # the directory goes between the listing's check and its scan
        shutil.rmtree(self, ignore_errors=True)
        raise FileNotFoundError(2, "No such file or directory", str(self))

    monkeypatch.setattr(Path, "glob", listing_while_removed)
    ranks[1].finish()
    assert not (tmp_path / "out.partial").exists()


def test_the_float_models_hidden_states_are_saved_and_restored_beside_the_layers_inputs(tmp_path):
    """AutoRound tunes against the float model's hidden states: a resumed run goes on with both streams."""
    hidden, floats = [torch.randn(2, 4, 8), torch.randn(1, 4, 8)], [torch.randn(2, 4, 8), torch.randn(1, 4, 8)]
    work, ctx = rank(tmp_path / "out.partial", 0), Context(0, 1, 0, torch.device("cpu"))
    work.save_layer(0, nn.Linear(8, 8), "model.layers.0", CalibrationResult(), hidden, LAYERS, floats)
    resumed = Resumable(work.path, {"ranks": "2"}, resume=True, ctx=ctx)
    got_hidden, got_floats = resumed.restore(resumed.open(), CalibrationResult(), LAYERS)
    assert all(torch.equal(a, b) for a, b in zip(got_hidden + got_floats, hidden + floats, strict=True))
    save(work, 1)  # a recipe without a float stream saves none
    resumed = Resumable(work.path, {"ranks": "2"}, resume=True, ctx=ctx)
    got_hidden, got_floats = resumed.restore(resumed.open(), CalibrationResult(), LAYERS)
    assert len(got_hidden) == 1 and got_floats == []


def test_checkpoints_wait_for_the_interval_and_the_last_layer(tmp_path, monkeypatch):
    """Layer files after every layer; the hidden states and the state file only once `every` seconds have passed
    since the last checkpoint (a fake clock here), and after the last layer."""
    from quantkit.calibration import resume

    clock = [0.0]
    monkeypatch.setattr(resume.time, "monotonic", lambda: clock[0])
    work = rank(tmp_path / "out.partial", 0, every=10.0)
    work.open()
    state = lambda: json.loads((work.path / "state.json").read_text())["completed"]
    for index, now in enumerate([3.0, 6.0, 11.0]):  # due at 11 s: 10 s after the run began
        clock[0] = now
        save(work, index)
        assert (work.path / f"layer-{index:05d}.safetensors").is_file()
    assert state() == 3 and hidden_files(work.path) == ["hidden-00003-rank0.safetensors"]
    assert work.completed == 3
    clock[0] = 12.0
    save(work, 3)  # the last layer: its state is saved whatever the clock says
    assert state() == LAYERS and hidden_files(work.path) == []


def test_an_interrupted_run_saves_the_checkpoint_the_interval_held_back(tmp_path):
    hidden = [torch.randn(2, 4, 8)]
    work = rank(tmp_path / "out.partial", 0, every=3600.0)
    work.open()
    save(work, 0)
    work.save_layer(1, nn.Linear(8, 8), "model.layers.1", CalibrationResult(), hidden, LAYERS)
    assert not (work.path / "state.json").exists() and hidden_files(work.path) == []
    work.save_pending()  # what finalize does on Ctrl-C
    resumed = Resumable(work.path, {"ranks": "2"}, resume=True, ctx=Context(0, 1, 0, torch.device("cpu")))
    got, _ = resumed.restore(resumed.open(), CalibrationResult(), LAYERS)
    assert resumed.completed == 2 and torch.equal(got[0], hidden[0])
    assert hidden_files(work.path) == ["hidden-00002-rank0.safetensors"]


def test_ranks_of_a_distributed_run_do_not_save_alone_when_interrupted(tmp_path):
    """The other ranks are not there to write their hidden states: the last checkpoint written stands."""
    work = Resumable(tmp_path / "out.partial", {"ranks": "2"}, resume=False,
                     ctx=Context(0, 2, 0, torch.device("cpu"), grouped=True), every=3600.0)
    work._pending = (1, LAYERS, [torch.randn(2, 4, 8)], [], torch.get_rng_state(), {})
    work.save_pending()
    assert not work.path.exists()


def test_a_checkpoint_whose_hidden_states_are_overwritten_is_dropped_and_not_saved(tmp_path):
    """GPTQ's staged pass builds the residual stream in the layer's inputs (`Layer.take_inputs`): the checkpoint
    held back, which references them, is dropped first, and an interrupted run keeps the last one written."""
    work = rank(tmp_path / "out.partial", 0, every=3600.0)
    work.open()
    save(work, 0)
    save(work, 1)
    work.drop_pending()
    work.save_pending()
    assert not (work.path / "state.json").exists() and hidden_files(work.path) == []
