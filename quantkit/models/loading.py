"""Loading and inspecting Hugging Face causal-LM directories: config, weights, tokenizer, decoder layers."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.errors import SourceModelError
from quantkit.models.architectures import decoder_layers, module_name  # noqa: F401  (where callers find them)

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json",
)
# Any one of these makes a directory loadable by AutoTokenizer.
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        custom = not trust_remote_code and "auto_map" in read_config_json(path)
        hint = "; it ships its own model code: pass --trust-remote-code to run it, if you trust it" if custom else ""
        raise SourceModelError(f"{path}: cannot read the model config ({str(exc).splitlines()[0]}){hint}") from exc


def max_positions(config) -> int | None:
    """The longest sequence the model's positions cover (its text config's max_position_embeddings, or GPT-2's
    n_positions), or None where the config names no limit."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions"):
        limit = getattr(text, name, None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return None


def meta_model(config, trust_remote_code: bool = False) -> nn.Module:
    """The model's module tree without weights (for planning before anything is loaded)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise SourceModelError(f"not a causal language model ({str(exc).splitlines()[0]})") from exc


def load_model(path: Path, dtype: str = "auto", trust_remote_code: bool = False, **kwargs) -> nn.Module:
    """A model directory through plain transformers, an artifact with what its format's reader puts around that
    (`export.reader_for`: compressed-tensors' asymmetric weights, which plain transformers 5.x cannot load, and the KV
    cache scales and online transforms it ignores)."""
    from transformers import AutoModelForCausalLM

    from quantkit.export import reader_for

    if dtype not in DTYPES:
        raise SourceModelError(f"unknown dtype '{dtype}'; use one of {', '.join(DTYPES)}")
    reader = reader_for(path)
    with reader.loading():
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, output_loading_info=True, **kwargs
        )
    check_loaded(path, info)
    return reader.loaded(model, Path(path)).eval()


def check_loaded(path: str | Path, info) -> None:
    """Refuse a checkpoint that lacks tensors the model needs: transformers loads it anyway, with those tensors
    left as random initial values (a checkpoint saved under other names, e.g. torch.compile's `_orig_mod.`)."""
    info = info if isinstance(info, dict) else vars(info)
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    if not missing:
        return
    hint = f"; it holds {unexpected[0]} and {len(unexpected) - 1} more not in the model" if unexpected else ""
    prefix = _extra_prefix(missing, unexpected)
    fix = (f"save the weights without the prefix '{prefix}' in their names" if prefix
           else "pass the model directory its config belongs to, with all its weights")
    raise SourceModelError(f"{path} lacks {len(missing)} of the model's tensors ({missing[0]}{hint}): they would be "
                           f"random; {fix}")


def _extra_prefix(missing: list[str], unexpected: list[str]) -> str | None:
    """The prefix that every unexpected name has over a missing one (`_orig_mod.model.x` for `model.x`), or None."""
    if not unexpected or not unexpected[0].endswith(missing[0]) or unexpected[0] == missing[0]:
        return None
    prefix = unexpected[0][: -len(missing[0])]
    names = set(missing)
    return prefix if all(n.startswith(prefix) and n[len(prefix):] in names for n in unexpected) else None


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


def check_finite(name: str, weight: torch.Tensor) -> None:
    """A weight about to be quantized holds no NaN or Inf (its scales would be non-finite and the artifact garbage).
    Its least and greatest values are finite exactly when all are (both propagate NaN): one pass, ~30x faster on a
    CPU than counting `isfinite` (185 -> 6 ms for a 5632 x 2048 bf16 weight); the count is taken for the message."""
    if weight.numel() == 0 or all(torch.isfinite(t) for t in torch.aminmax(weight.detach())):
        return
    bad = int((~torch.isfinite(weight)).sum())
    if bad:
        raise SourceModelError(
            f"{name}.weight has {bad} non-finite values (NaN or Inf) in the source model; fix the checkpoint, or leave "
            "the module out of the recipe (`ignore`)"
        )


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


def fingerprint_in_background(path: Path):
    """`fingerprint(path)` computed in a thread of its own (hashlib lets go of the GIL over large reads), as a
    Future: a finalize hashes its source while it quantizes instead of after."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-fingerprint")
    future = pool.submit(fingerprint, path)
    pool.shutdown(wait=False)
    return future


def weights_size(path: Path) -> int:
    """Bytes of the safetensors weights in a model directory."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
