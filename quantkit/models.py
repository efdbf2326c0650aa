"""Loading and inspecting Hugging Face causal-LM directories: config, weights, tokenizer, decoder layers."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.errors import SourceModelError, UnsupportedModelError, UsageError

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json",
)
# Any one of these makes a directory loadable by AutoTokenizer.
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_dir(path: str | Path) -> Path:
    """A directory with config.json and safetensors weights, or SourceModelError saying what is missing."""
    path = Path(path)
    if not path.exists():
        raise SourceModelError(f"{path} does not exist; pass a Hugging Face model directory")
    if not path.is_dir():
        raise SourceModelError(f"{path} is a file; pass a Hugging Face model directory (config.json + *.safetensors)")
    if not (path / "config.json").is_file():
        raise SourceModelError(f"{path} has no config.json; it is not a Hugging Face model directory")
    if not list(path.glob("*.safetensors")):
        raise SourceModelError(f"{path} has no *.safetensors weights; save the model with safe_serialization (pickle checkpoints are not loaded)")
    return path


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "merges.txt", "vocab.*", "*.jinja"]


def resolve_source(source: str | Path, revision: str | None = None) -> Path:
    """A model directory: `source` itself when it exists (or does not look like a hub id), else the hub id
    `org/name` resolved through huggingface_hub: its cache (HF_HOME; HF_HUB_OFFLINE=1 never goes online), or a
    download of the config, weights and tokenizer when the network allows."""
    if Path(source).exists() or not HUB_ID.match(str(source)):
        return check_model_dir(source)
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(str(source), revision=revision, allow_patterns=HUB_FILES)
    except Exception as exc:  # noqa: BLE001 - offline misses, unknown repos and revisions, network failures alike
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SourceModelError(
            f"{source} is neither a directory nor a model in the Hugging Face cache ({reason}); pass a model "
            f"directory, or download it first (`hf download {source}`)"
        ) from exc
    return check_model_dir(folder)


def read_config_json(path: str | Path) -> dict[str, Any]:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise SourceModelError(f"{path}/config.json is not valid JSON ({exc.msg})") from exc


def quantization_method(path: str | Path) -> str | None:
    """The `quant_method` of an already-quantized model directory, or None for a full-precision one."""
    config = read_config_json(path).get("quantization_config") or {}
    return config.get("quant_method") or ("quantized" if config else None)


def check_full_precision(path: Path) -> None:
    method = quantization_method(path)
    if method:
        raise SourceModelError(f"{path} is already quantized ({method}); pass the full-precision model it was made from")


def load_config(path: Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as exc:
        raise SourceModelError(f"{path}: cannot read the model config ({str(exc).splitlines()[0]})") from exc


def meta_model(config, trust_remote_code: bool = False) -> nn.Module:
    """The model's module tree without weights (for planning before anything is loaded)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise SourceModelError(f"not a causal language model ({str(exc).splitlines()[0]})") from exc


def load_model(path: Path, dtype: str = "auto", trust_remote_code: bool = False, **kwargs) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise SourceModelError(f"unknown dtype '{dtype}'; use one of {', '.join(DTYPES)}")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, **kwargs
    )
    return model.eval()


def load_tokenizer(path: str | Path, trust_remote_code: bool = False, fix: str = "pass --tokenizer DIR"):
    """The tokenizer saved in a directory; SourceModelError ending in `fix` (what the user should do) when
    there is none or it does not load."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir() or not any((path / name).is_file() for name in TOKENIZER_MARKERS):
        raise SourceModelError(f"{path} has no tokenizer files; {fix}")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise SourceModelError(f"{path}: cannot load the tokenizer ({str(exc).splitlines()[0]}); {fix}") from exc


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers at model.<base_model_prefix>.layers (Llama-, Qwen2-, Mistral-style models)."""
    prefix = getattr(model, "base_model_prefix", "model")
    layers = getattr(getattr(model, prefix, None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise UnsupportedModelError(
            f"{type(model).__name__}: calibration needs decoder layers at model.{prefix}"
            ".layers (Llama-, Qwen2-, Mistral-style models); this architecture has none there"
        )
    return layers


def module_name(model: nn.Module, module: nn.Module) -> str:
    """The qualified name of `module` inside `model` (e.g. "model.layers" for the decoder layers)."""
    return next(name for name, candidate in model.named_modules() if candidate is module)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes from "5GB", "500MB", "2GiB" or a plain number of bytes; UsageError otherwise."""
    match = _SIZE.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"--max-shard-size {text}: not a size; write it like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def fingerprint(path: Path) -> str:
    """sha256 over config.json and every safetensors file, in name order."""
    digest = hashlib.sha256()
    for file in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
        digest.update(file.name.encode())
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 23), b""):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def weights_size(path: Path) -> int:
    """Bytes of the safetensors weights in a model directory."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
