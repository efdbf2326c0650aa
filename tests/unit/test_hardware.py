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
