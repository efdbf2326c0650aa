"""Reading MLX directories (mlx-lm's layout: config.json's `quantization`, each quantized Linear a packed `weight` with
`scales` and `biases`): transformers cannot run them. Torch-free at import."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from quantkit.export import config_json
from quantkit.errors import SourceModelError

ENGINE = "quantkit.evaluation.mlx"  # mlx-lm, in its own Python: windows' losses from its logits
TENSOR_PARALLEL = False
RUN_IT = "run it in mlx-lm (`mlx_lm.generate --model PATH`, `mlx_lm.perplexity --model PATH`)"


def detect(path: Path) -> bool:
    """A directory whose config.json has MLX's `quantization` ({group_size, bits}) and whose safetensors hold
    `.scales` and `.biases` tensors (the first shard's header, or the index)."""
    path = Path(path)
    if not path.is_dir():
        return False
    try:
        quantization = config_json(path).get("quantization")
    except SourceModelError:
        return False
    if not isinstance(quantization, dict) or not {"group_size", "bits"} <= quantization.keys():
        return False
    names = _tensor_names(path)
    return any(n.endswith(".scales") for n in names) and any(n.endswith(".biases") for n in names)


def _tensor_names(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text()).get("weight_map", {}))
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        return []
    with open(files[0], "rb") as fh:
        size = struct.unpack("<Q", fh.read(8))[0]
        return list(json.loads(fh.read(size)))


def quantized(path: Path) -> str:
    return "an MLX model"


def unsharded(path: Path) -> str:
    return f"--tp shards transformers models; {path} is an MLX model: evaluate it without --tp"


def legend(runtimes: list[str], tasks: bool) -> str:
    return f"MLX models run in {', '.join(runtimes)}" + (", without task scores (n/a)" if tasks else "")


def check_load(path: Path) -> None:
    """transformers cannot load MLX's packed weights: refused in one line, saying what runs them."""
    from quantkit.errors import UsageError

    raise UsageError(f"{path} is an MLX model, which transformers cannot run; {RUN_IT.replace('PATH', str(path))}")
