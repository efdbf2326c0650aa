"""What `finalize` says before it loads anything: the preflight line, and a note where AutoRound would leave ranks
waiting (fewer forward and backward passes a step than ranks)."""

import pytest

from quantkit import algorithms
from quantkit.algorithms.methods.autoround import AutoRoundArgs
from quantkit.cli import finalize as cli_finalize


def _report(ranks: int, passes: int | None = None) -> dict:
    report = {"peak_ram_bytes": 1 << 30, "output_bytes": 1 << 20, "work_dir_bytes": 0, "free_disk_bytes": 1 << 40,
              "ranks": ranks}
    if passes is not None:  # what AutoRound's object adds to the preflight's report
        report.update(algorithms.get("autoround").report(AutoRoundArgs(samples_per_pass=4), 4 * passes, ranks))
    return report


@pytest.mark.parametrize("ranks, passes, noted", [(1, 2, False), (2, 2, False), (3, 2, True), (8, 2, True), (8, None, False)])
def test_a_note_only_where_autoround_leaves_ranks_waiting(monkeypatch, ranks, passes, noted):
    lines = []
    monkeypatch.setattr(cli_finalize.out, "print", lambda text, **kwargs: lines.append(text))
    cli_finalize.announce(_report(ranks, passes))
    assert lines[0].startswith("preflight: peak RAM about 1.0 GiB")
    assert len(lines) == (2 if noted else 1)
    if noted:
        assert lines[1] == (f"note: AutoRound tunes on 2 of the {ranks} ranks at a time (2 forward and backward passes a "
                            "step); a user recipe with a smaller samples_per_pass (or a larger batch_size) keeps more of "
                            "them busy")
