"""Reading compressed-tensors artifacts (vLLM's format; LLM Compressor's too): plain transformers loads them, with what
it gets wrong or ignores put right around `from_pretrained` (`export.compressed_tensors`'s reading functions).
Torch-free at import: the CLI detects a MODEL before torch loads."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from quantkit.export import config_json, made_as
from quantkit.quant.registry import Format

if TYPE_CHECKING:
    from torch import nn

# transformers decompresses on the first forward, through an offloading wrapper its tensor-parallel modules break
SHARDS_WHILE_LOADING = False


def detect(path: Path) -> bool:
    return made_as(path) == Format.COMPRESSED_TENSORS.value


def check_load(path: Path) -> None:
    """MoE experts transformers loads wrong, or not at all, refused in one line."""
    from quantkit.errors import UnsupportedModelError
    from quantkit.export.compressed_tensors import experts_load_problem

    problem = experts_load_problem(config_json(path))
    if problem:
        import transformers

        raise UnsupportedModelError(f"{path}: transformers {transformers.__version__} cannot run this artifact's MoE experts "
                                    f"({problem}); serve it with vLLM, or evaluate an artifact of a recipe whose experts load")


@contextmanager
def loading() -> Iterator[None]:
    """compressed-tensors' releases before 0.19 compute FP8 blocks as written (`ct_compat`), and asymmetric
    pack-quantized weights load (`compressed_tensors.packed_zero_points_on_load`)."""
    from quantkit.export.compressed_tensors import packed_zero_points_on_load
    from quantkit.export.ct_compat import compute_as_newer_releases

    compute_as_newer_releases()
    with packed_zero_points_on_load():
        yield


def loaded(model: nn.Module, path: Path) -> nn.Module:
    """FP4 / MX weights decompressed in the model's dtype, the KV cache scales and the online transforms (R4) that
    transformers ignores (`compressed_tensors.restore_on_load`)."""
    from quantkit.export.compressed_tensors import restore_on_load

    return restore_on_load(model, Path(path), config_json(path))


def before_sharding(model: nn.Module) -> None:
    from quantkit.export.compressed_tensors import decompress

    decompress(model)


def legend(runtimes: list[str], tasks: bool) -> str:
    return ("compressed-tensors artifacts compute with dequantized weights (transformers has no FP4 / FP8 / int4 kernels), "
            "their activations quantized as vLLM quantizes them")
