"""The work directory's hidden-state files, rank by rank: what a resume needs is always there, a rank on another
machine (its own DST.partial, no shared file system) keeps two layers' inputs at most, and a finished run leaves
nothing. Ranks are played in turn in one process (barriers are no-ops at world size 1)."""

from __future__ import annotations

import json

import torch
from torch import nn

from quantkit.calibration.layer import CalibrationResult
from quantkit.calibration.resume import Resumable
from quantkit.distributed import Context

LAYERS = 4


def rank(path, index: int) -> Resumable:
    return Resumable(path, {"ranks": "2"}, resume=False, ctx=Context(index, 1, 0, torch.device("cpu")))


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
