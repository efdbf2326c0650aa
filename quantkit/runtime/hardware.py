"""The GPUs this machine has: `--device` and `--nproc-per-node` checked against them before any work starts
(what a recipe's kernels need is `quantkit.finalization.checks`' question)."""

from __future__ import annotations

from quantkit.errors import HardwareError


def cuda_capability() -> tuple[int, int] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def check_device(name: str, choices: str = "cpu, cuda or cuda:N") -> None:
    """A compute device this machine has (`--device cuda` on a CPU-only machine is refused before any work);
    `choices`: what the option takes, for the message."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise HardwareError(f"--device {name}: not a device; use {choices}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise HardwareError(f"--device {name}: this machine has no CUDA GPU (torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= count:
            raise HardwareError(f"--device {name}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    elif device.type != "cpu":
        raise HardwareError(f"--device {name}: quantkit computes on cpu or cuda")


def check_ranks(device: str | None, ranks_per_node: int) -> None:
    """`--nproc-per-node N` computing on CUDA takes N GPUs of this machine, one per rank (`device` None: CUDA when
    there is a GPU, as `train` does): refused before anything is launched when it has fewer, or when the ranks
    would share one named GPU."""
    if ranks_per_node <= 1 or (device is not None and not device.startswith("cuda")):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device is None and count == 0:
        return  # train on a machine without a GPU: CPU ranks
    check_device(device or "cuda")
    if device is not None and device != "cuda":
        raise HardwareError(f"--device {device} with --nproc-per-node {ranks_per_node}: every rank takes a GPU of its own; "
                            "pass --device cuda")
    if ranks_per_node > count:
        raise HardwareError(f"--nproc-per-node {ranks_per_node} needs {ranks_per_node} GPUs (one per rank) and this machine "
                            f"has {count}; pass --nproc-per-node {count} or fewer, or --device cpu for CPU processes")


def eval_device(name: str) -> str:
    """`eval --device`: auto is CUDA when there is a GPU, else the CPU; any other name is checked (`check_device`)."""
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    check_device(name, "auto, cpu, cuda or cuda:N")
    return name
