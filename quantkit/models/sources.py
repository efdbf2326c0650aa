"""Where a model comes from: a local directory or a hub id, checked before anything heavy is imported.

No torch here: the CLI and `finalize` report a wrong SRC, DST or size within a fraction of a second. The
safetensors headers are read (not the tensors), so a truncated or foreign file is named before any work.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from quantkit.errors import SourceModelError, UsageError


def check_model_dir(path: str | Path) -> Path:
    """A directory with config.json and safetensors weights, or SourceModelError saying what is missing."""
    path = Path(path)
    if not path.exists():
        raise SourceModelError(f"{path} does not exist; pass a Hugging Face model directory")
    if not path.is_dir():
        raise SourceModelError(f"{path} is a file; pass a Hugging Face model directory (config.json + *.safetensors)")
    if not list(path.glob("*.safetensors")) and ((path / "final").is_dir() or (path / "checkpoints").is_dir()):
        raise SourceModelError(f"{path} is a training run's output directory; pass its model, {path / 'final'} "
                               f"(or a checkpoint under {path / 'checkpoints'})")
    if not (path / "config.json").is_file():
        raise SourceModelError(f"{path} has no config.json; it is not a Hugging Face model directory")
    if not list(path.glob("*.safetensors")):
        raise SourceModelError(f"{path} has no *.safetensors weights; save the model with safe_serialization (pickle checkpoints are not loaded)")
    check_safetensors(path)
    return path


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name
TOKENIZER_FILES = ["*.json", "tokenizer*", "*.model", "merges.txt", "vocab.*", "*.jinja"]
HUB_FILES = [*TOKENIZER_FILES, "*.safetensors"]


def is_hub_id(source: str | Path) -> bool:
    """`org/name` that is not an existing path: resolved through the Hugging Face cache."""
    return not Path(source).exists() and bool(HUB_ID.match(str(source)))


def resolve_source(source: str | Path, revision: str | None = None) -> Path:
    """A model directory: `source` itself when it exists (or does not look like a hub id), else the hub id
    `org/name` resolved through huggingface_hub: its cache (HF_HOME; HF_HUB_OFFLINE=1 never goes online), or a
    download of the config, weights and tokenizer when the network allows."""
    if not is_hub_id(source):
        return check_model_dir(source)
    return check_model_dir(_snapshot(str(source), revision, HUB_FILES, "model"))


def resolve_tokenizer(source: str | Path, revision: str | None = None) -> Path:
    """A tokenizer directory: `source` itself when it is not a hub id, else the hub id's tokenizer files (no
    weights) resolved like `resolve_source`. Whether tokenizer files are there is `models.load_tokenizer`'s check."""
    return _snapshot(str(source), revision, TOKENIZER_FILES, "tokenizer") if is_hub_id(source) else Path(source)


def _snapshot(repo_id: str, revision: str | None, patterns: list[str], what: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # noqa: BLE001 - offline misses, unknown repos and revisions, network failures alike
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        at = f" at revision {revision}" if revision else ""
        download = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
        other = (f", or another --revision (the cache holds {repo_id}, but not {revision})"
                 if revision and _cached(repo_id, patterns) else "")
        raise SourceModelError(
            f"{repo_id}{at} is neither a directory nor a {what} in the Hugging Face cache ({reason}); pass a {what} "
            f"directory, or download it first (`{download}`){other}"
        ) from exc


def _cached(repo_id: str, patterns: list[str]) -> bool:
    """Whether the cache holds `repo_id` at its default revision (offline: a lookup, no download)."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached
        return False
    return True


def check_safetensors(path: Path) -> None:
    """Each safetensors file's header parses and its tensors lie within the file (a truncated download does not)."""
    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with open(file, "rb") as fh:
                (length,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (struct.error, ValueError, KeyError, TypeError, IndexError, MemoryError, OverflowError) as exc:
            raise SourceModelError(f"{file} is not a readable safetensors file ({type(exc).__name__}); download or save it again") from exc
        if file.stat().st_size < 8 + length + end:
            raise SourceModelError(
                f"{file} is truncated ({file.stat().st_size} bytes; its header describes {8 + length + end}); download or save it again"
            )


DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def _headers(path: Path):
    for file in sorted(Path(path).glob("*.safetensors")):
        with open(file, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        yield file, {k: t for k, t in header.items() if k != "__metadata__"}


def tensor_headers(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor's (safetensors dtype, shape) in a model directory, from the headers alone."""
    return {k: (t["dtype"], t["shape"]) for _, header in _headers(path) for k, t in header.items()}


def tensor_files(path: Path) -> dict[str, Path]:
    """The safetensors file each tensor of a model directory is stored in, from the headers alone."""
    return {k: file for file, header in _headers(path) for k in header}


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, option: str = "--max-shard-size") -> int:
    """Bytes from "5GB", "500MB", "2GiB" or a plain number of bytes; UsageError (naming `option`) otherwise."""
    match = _SIZE.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"{option} {text}: not a size; write it like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


