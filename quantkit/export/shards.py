"""Safetensors shards written piece by piece, so that no more than one piece is ever held in memory.

A streamed finalize hands over each decoder layer's output tensors as soon as they are made (`ShardWriter.add`:
one small safetensors file per piece, beside the output). `finish` then lays the pieces out into shards of at
most `max_shard_size` bytes, in the order they came, named as transformers names them (`model.safetensors`, or
`model-00001-of-00003.safetensors` ... with `model.safetensors.index.json`), by copying bytes: the shards'
headers are built from the pieces' headers and the tensors' bytes are copied from file to file, never loaded.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

DEFAULT_MAX_SHARD_SIZE = 50 * 10**9  # transformers' save_pretrained default ("50GB")
_COPY_CHUNK = 1 << 24


class ShardWriter:
    def __init__(self, out_dir: Path, max_shard_size: int | None = None):
        self.out_dir = Path(out_dir)
        self.max_shard_size = max_shard_size or DEFAULT_MAX_SHARD_SIZE
        self.pieces_dir = self.out_dir / ".pieces"
        self.pieces: list[Path] = []
        self.keys: set[str] = set()

    def add(self, tensors: dict) -> None:
        """Write `tensors` (name -> CPU tensor) as the next piece."""
        from safetensors.torch import save_file

        if not tensors:
            return
        repeated = self.keys.intersection(tensors)
        if repeated:
            raise ValueError(f"tensor {sorted(repeated)[0]} was written twice")
        self.keys.update(tensors)
        self.pieces_dir.mkdir(exist_ok=True)
        path = self.pieces_dir / f"piece-{len(self.pieces):05d}.safetensors"
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
        self.pieces.append(path)

    def finish(self) -> list[str]:
        """Assemble the shards (and the index when there are several); remove the pieces. Returns the file names."""
        entries = [(piece, name, info) for piece in self.pieces for name, info in _header(piece)[1].items()]
        shards: list[list[tuple[Path, str, dict]]] = [[]]
        size = 0
        for entry in entries:
            nbytes = _nbytes(entry[2])
            if shards[-1] and size + nbytes > self.max_shard_size:
                shards.append([])
                size = 0
            shards[-1].append(entry)
            size += nbytes
        names = ["model.safetensors"] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
        ]
        for name, shard in zip(names, shards):
            _write_shard(self.out_dir / name, shard)
        if len(shards) > 1:
            weight_map = {tensor: name for name, shard in zip(names, shards) for _, tensor, _ in shard}
            index = {"metadata": {"total_size": sum(_nbytes(info) for _, _, info in entries)}, "weight_map": weight_map}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        shutil.rmtree(self.pieces_dir, ignore_errors=True)
        return names


def _header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, tensor name -> header entry) of a safetensors file."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def _nbytes(info: dict) -> int:
    begin, end = info["data_offsets"]
    return end - begin


def _write_shard(path: Path, shard: list[tuple[Path, str, dict]]) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for _, name, info in shard:
        header[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + _nbytes(info)]}
        offset += _nbytes(info)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    starts = {piece: _header(piece)[0] for piece in {piece for piece, _, _ in shard}}
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for piece, _, info in shard:
            with open(piece, "rb") as src:
                src.seek(starts[piece] + info["data_offsets"][0])
                remaining = _nbytes(info)
                while remaining:
                    chunk = src.read(min(remaining, _COPY_CHUNK))
                    out.write(chunk)
                    remaining -= len(chunk)
