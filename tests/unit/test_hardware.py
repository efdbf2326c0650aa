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


def test_scheme_a_format_cannot_express_is_refused_with_the_alternative():
    with pytest.raises(FormatError, match="NVFP4.*use --format compressed-tensors"):
        check_supported(registry.resolve("nvfp4-a16"), Format.TORCHAO)
