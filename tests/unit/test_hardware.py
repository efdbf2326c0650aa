import pytest

from quantkit import hardware, registry
from quantkit.errors import FormatError, HardwareError
from quantkit.export import check_supported
from quantkit.registry import Format

FP8 = "float8-dynamic-act-float8-weight"


def test_fp8_torchao_without_gpu_names_the_working_format(monkeypatch):
    monkeypatch.setattr(hardware, "cuda_capability", lambda: None)
    with pytest.raises(HardwareError, match="compute capability 8.9\\+ .*use --format compressed-tensors"):
        hardware.check(registry.resolve(FP8), Format.TORCHAO)


def test_fp8_torchao_on_an_older_gpu(monkeypatch):
    monkeypatch.setattr(hardware, "cuda_capability", lambda: (8, 0))
    assert "this one is 8.0" in hardware.missing_requirement(registry.resolve(FP8), Format.TORCHAO)


def test_fp8_torchao_on_a_new_gpu(monkeypatch):
    monkeypatch.setattr(hardware, "cuda_capability", lambda: (9, 0))
    hardware.check(registry.resolve(FP8), Format.TORCHAO)


def test_compressed_tensors_fp8_needs_nothing():
    hardware.check(registry.resolve(FP8), Format.COMPRESSED_TENSORS)


def test_missing_package_is_named(tmp_path):
    path = tmp_path / "needs.yaml"
    path.write_text(
        "scheme: {weights: {dtype: int8, granularity: channel}}\nformat: torchao\n"
        "requires: {torchao: {packages: [surely_not_installed_pkg]}}"
    )
    with pytest.raises(HardwareError, match="pip install surely_not_installed_pkg.*--format compressed-tensors"):
        hardware.check(registry.resolve(str(path)), Format.TORCHAO)


@pytest.mark.parametrize("name, reason", [
    ("mxfp4-a16", "MX weight-only has no torchao config"),
    ("w4a8-fp8", "mslk's CUDA kernels"),
    ("nvfp4", "round-to-nearest recipes"),  # its activations' global scale is calibrated
])
def test_scheme_a_format_cannot_express_is_refused_with_the_alternative(name, reason):
    with pytest.raises(FormatError, match=f"{reason}.*use --format compressed-tensors"):
        check_supported(registry.resolve(name), Format.TORCHAO)


def test_nvfp4_weight_only_in_torchao_needs_no_gpu(monkeypatch):
    monkeypatch.setattr(hardware, "cuda_capability", lambda: None)
    check_supported(registry.resolve("nvfp4-a16"), Format.TORCHAO)
    hardware.check(registry.resolve("nvfp4-a16"), Format.TORCHAO)


@pytest.mark.parametrize("name, need", [("mxfp4", "10.0"), ("mxfp8", "10.0"), ("fp8-block", "8.9")])
def test_torchao_float_grids_need_their_kernels_gpu(monkeypatch, name, need):
    check_supported(registry.resolve(name), Format.TORCHAO)  # expressible
    monkeypatch.setattr(hardware, "cuda_capability", lambda: None)
    with pytest.raises(HardwareError, match=f"compute capability {need}\\+ .*use --format compressed-tensors"):
        hardware.check(registry.resolve(name), Format.TORCHAO)
    monkeypatch.setattr(hardware, "cuda_capability", lambda: (9, 0))
    assert (hardware.missing_requirement(registry.resolve(name), Format.TORCHAO) is None) == (need == "8.9")
    monkeypatch.setattr(hardware, "cuda_capability", lambda: (10, 0))
    hardware.check(registry.resolve(name), Format.TORCHAO)


def test_a_user_recipe_without_requires_is_gated_by_its_torchao_config(tmp_path, monkeypatch):
    """The capability comes from the scheme's torchao config, not only from a recipe's `requires`."""
    path = tmp_path / "my-mx.yaml"
    path.write_text(
        "scheme:\n  weights: {dtype: float8_e4m3fn, granularity: group, group_size: 32, scale_dtype: float8_e8m0fnu}\n"
        "  activations: {dtype: float8_e4m3fn, granularity: group, group_size: 32, scale_dtype: float8_e8m0fnu, dynamic: true}\n"
        "format: torchao\non_indivisible: skip\n"
    )
    recipe = registry.resolve(str(path))
    assert recipe.requirement(Format.TORCHAO).cuda_capability is None
    monkeypatch.setattr(hardware, "cuda_capability", lambda: (9, 0))
    assert "compute capability 10.0+ (this one is 9.0)" in hardware.missing_requirement(recipe, Format.TORCHAO)


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
