"""What no format's reader detects: a Hugging Face model directory that plain transformers loads as it is (full
precision, or quantized by another tool: GPTQ, AWQ, bitsandbytes, ...). `export.reader_for`'s fallback, not a
format: it detects nothing itself. Torch-free at import."""

from __future__ import annotations

from pathlib import Path


def detect(path: Path) -> bool:
    return True


def quantized(path: Path) -> str | None:
    from quantkit.models.loading import quantization_method

    return quantization_method(path)


def unsharded(path: Path) -> str | None:
    """Full precision shards; another tool's quantized tensors do not."""
    from quantkit.export import not_sharded
    from quantkit.models.loading import quantization_method

    method = quantization_method(path)
    return not_sharded(path, method) if method else None
