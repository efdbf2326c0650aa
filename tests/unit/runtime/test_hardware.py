import pytest

from quantkit.errors import HardwareError
from quantkit.runtime import hardware


def _gpus(monkeypatch, count: int) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_more_ranks_than_gpus_is_refused_naming_both_numbers(monkeypatch):
    _gpus(monkeypatch, 1)
    with pytest.raises(HardwareError, match="--nproc-per-node 2 needs 2 GPUs .* this machine has 1; pass --nproc-per-node 1"):
        hardware.check_ranks("cuda", 2)
    with pytest.raises(HardwareError, match="needs 3 GPUs"):
        hardware.check_ranks(None, 3)  # train: CUDA when there is a GPU


def test_ranks_that_fit_or_run_on_the_cpu_pass(monkeypatch):
    _gpus(monkeypatch, 2)
    hardware.check_ranks("cuda", 2)
    hardware.check_ranks("cpu", 16)
    _gpus(monkeypatch, 0)
    hardware.check_ranks(None, 4)  # train on a machine without a GPU: CPU processes
    hardware.check_ranks("cpu", 4)
    with pytest.raises(HardwareError, match="no CUDA GPU"):
        hardware.check_ranks("cuda", 2)


def test_ranks_sharing_one_named_gpu_are_refused(monkeypatch):
    _gpus(monkeypatch, 2)
    with pytest.raises(HardwareError, match="--device cuda:1 with --nproc-per-node 2: .* pass --device cuda"):
        hardware.check_ranks("cuda:1", 2)


def test_eval_device_auto_is_the_gpu_when_there_is_one(monkeypatch):
    _gpus(monkeypatch, 1)
    assert hardware.eval_device("auto") == "cuda"
    _gpus(monkeypatch, 0)
    assert hardware.eval_device("auto") == "cpu"
    with pytest.raises(HardwareError, match="no CUDA GPU"):
        hardware.eval_device("cuda")
    with pytest.raises(HardwareError, match="not a device"):
        hardware.eval_device("gpu0")


def test_evals_device_error_names_auto_its_default():
    with pytest.raises(HardwareError, match=r"^--device foo: not a device; use auto, cpu, cuda or cuda:N$"):
        hardware.eval_device("foo")
