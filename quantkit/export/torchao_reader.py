"""Reading torchao artifacts: plain transformers loads their tensor subclasses. Their kernels may need a CUDA GPU (the
recipe's `requires` in quantkit.json says which), and they do not shard over `eval --tp`. Torch-free at import."""

from __future__ import annotations

from pathlib import Path

from quantkit.export import made_as
from quantkit.quant.registry import Format

TENSOR_PARALLEL = False  # its quantized tensors lack the operations transformers' tensor parallelism splits them with


def detect(path: Path) -> bool:
    return made_as(path) == Format.TORCHAO.value


def check_device(path: Path, device: str) -> None:
    """An artifact whose kernels need a CUDA GPU (FP8: torch has no per-row FP8 product on the CPU) is refused on the
    CPU in one line, not with PyTorch's internal assertion halfway through the first forward."""
    from quantkit.export import metadata

    made = metadata.read(Path(path)) or {}
    needs = ((made.get("recipe") or {}).get("requires") or {}).get("torchao", {}).get("cuda_capability")
    if needs and str(device).partition(":")[0] == "cpu":
        from quantkit.errors import HardwareError

        raise HardwareError(f"{path}: a torchao artifact whose kernels need a CUDA GPU with compute capability {needs}+; "
                            "evaluate it on such a GPU (--device cuda), or finalize with --format compressed-tensors for the CPU")
