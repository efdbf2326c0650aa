"""Checks that a format's kernels can run here, before any weight is loaded."""

from __future__ import annotations

import importlib.util

from quantkit.errors import HardwareError
from quantkit.registry import Format, Recipe


def cuda_capability() -> tuple[int, int] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def needed_capability(recipe: Recipe, fmt: Format) -> str | None:
    """The CUDA compute capability `recipe` needs in `fmt`: the recipe's `requires`, or what torchao's kernels need
    for the scheme's config (so a user recipe without `requires` is checked too), whichever is higher."""
    needs = [recipe.requirement(fmt).cuda_capability]
    if fmt is Format.TORCHAO:
        from quantkit.export import torchao

        needs.append(torchao.cuda_capability(recipe.scheme))
    needs = [need for need in needs if need]
    return max(needs, key=_version) if needs else None


def _version(capability: str) -> tuple[int, ...]:
    return tuple(int(x) for x in capability.split("."))


def missing_requirement(recipe: Recipe, fmt: Format) -> str | None:
    """What this machine lacks for `recipe` in `fmt`, or None."""
    req = recipe.requirement(fmt)
    need = needed_capability(recipe, fmt)
    if need:
        have = cuda_capability()
        if have is None:
            return f"a CUDA GPU with compute capability {need}+ (this machine has no CUDA GPU)"
        if have < _version(need):
            return f"a CUDA GPU with compute capability {need}+ (this one is {have[0]}.{have[1]})"
    for package in req.packages:
        if importlib.util.find_spec(package) is None:
            return f"the '{package}' package (pip install {package})"
    return None


def check_device(name: str) -> None:
    """A compute device this machine has (`--device cuda` on a CPU-only machine is refused before any work)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise HardwareError(f"--device {name}: not a device; use cpu, cuda or cuda:N") from None
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
    check_device(name)
    return name


def check(recipe: Recipe, fmt: Format) -> None:
    missing = missing_requirement(recipe, fmt)
    if missing is None:
        return
    working = [f.value for f in Format if f is not fmt and missing_requirement(recipe, f) is None]
    hint = f"; use --format {working[0]}, which runs here" if working else ""
    raise HardwareError(f"recipe '{recipe.name}' in format {fmt.value} needs {missing}{hint}")
