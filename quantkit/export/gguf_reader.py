"""Reading GGUF files: one file, run by llama.cpp (`quantkit.evaluation.gguf`, through llama-cpp-python), not by
transformers. Torch-free at import: the CLI checks a .gguf path before torch loads."""

from __future__ import annotations

from pathlib import Path

from quantkit.export import single_file
from quantkit.quant.registry import Format

MAGIC = b"GGUF"  # the first four bytes of every GGUF file
SUFFIX = Path(single_file(Format.GGUF)).suffix  # .gguf, in any case
ENGINE = "quantkit.evaluation.gguf"  # llama.cpp: its path and option checks, windows' losses from llama.cpp's logits
TENSOR_PARALLEL = False


def detect(path: Path) -> bool:
    """A path named .gguf (what is there, if anything, is `check_gguf_file`'s to say), or a file of another name that
    starts with the GGUF magic bytes."""
    if str(path).lower().endswith(SUFFIX):
        return True
    try:
        with open(path, "rb") as fh:
            return fh.read(len(MAGIC)) == MAGIC
    except OSError:  # missing, a directory, unreadable: not a GGUF file
        return False


def quantized(path: Path) -> str:
    return "a GGUF file"


def unsharded(path: Path) -> str:
    return f"--tp shards transformers models; {path} runs in llama.cpp: evaluate it without --tp"


def legend(runtimes: list[str], tasks: bool) -> str:
    return f".gguf files run in {', '.join(runtimes)}" + (", without task scores (n/a)" if tasks else "")
