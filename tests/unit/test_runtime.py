import pytest

from quantkit import runtime


@pytest.mark.parametrize("value, enabled", [("1", True), ("true", True), ("YES", True), ("0", False), ("", False),
                                            ("false", False), ("no", False)])
def test_debug_is_on_only_for_1_true_yes(monkeypatch, value, enabled):
    monkeypatch.setenv("QUANTKIT_DEBUG", value)
    assert runtime.debug_enabled() is enabled


def test_debug_is_off_when_unset(monkeypatch):
    monkeypatch.delenv("QUANTKIT_DEBUG", raising=False)
    assert not runtime.debug_enabled()


def test_rank_and_launcher_from_the_environment(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", runtime.THREADS_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    assert runtime.is_main_process() and not runtime.under_torchrun() and runtime.launched_threads() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(runtime.THREADS_VARIABLE, "3")
    assert not runtime.is_main_process() and runtime.under_torchrun() and runtime.launched_threads() == 3


def test_set_threads_sets_torch_threads():
    import torch

    before = torch.get_num_threads()
    try:
        assert runtime.set_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
