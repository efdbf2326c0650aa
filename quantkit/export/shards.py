"""Safetensors shards written tensor by tensor, so that no more than one piece is ever held in memory and the
output's bytes are written once.

A streamed finalize hands over each decoder layer's output tensors as soon as they are made (`ShardWriter.add`).
Their bytes go straight into the current shard file, after room left at its start for its header; the next
shard begins where a tensor would take this one past `max_shard_size` (transformers' rule). `finish` writes each
header into its room, padded with spaces (which the safetensors format allows; the data section stays 8-byte
aligned), and names the shards as transformers names them (`model.safetensors`, or
`model-00001-of-00003.safetensors` ... with `model.safetensors.index.json`).

The room is sized from the first tensors' header bytes per data byte and the shard's expected size (the smaller of
`max_shard_size` and `expected_bytes`, the preflight's estimate of the output). Where a header outgrows its room,
or its padding is over 4 KiB and 0.1% of the shard, the shard is rewritten once with a header of
its own size (the data copied in the kernel where it can be): the only case where bytes are written twice.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

DEFAULT_MAX_SHARD_SIZE = 50 * 10**9  # transformers' save_pretrained default ("50GB")
_ROOM_MIN, _ROOM_MAX = 4096, 16 << 20
_COPY_CHUNK = 1 << 24


class ShardWriter:
    def __init__(self, out_dir: Path, max_shard_size: int | None = None, expected_bytes: int | None = None):
        self.out_dir = Path(out_dir)
        self.max_shard_size = max_shard_size or DEFAULT_MAX_SHARD_SIZE
        self.expected_bytes = expected_bytes
        self.shards: list[_Shard] = []
        self.keys: set[str] = set()
        self._header_per_byte: float | None = None

    def add(self, tensors: dict) -> None:
        """Write `tensors` (name -> tensor), in their order, into the current shard (and the next ones)."""
        if not tensors:
            return
        repeated = self.keys.intersection(tensors)
        if repeated:
            raise ValueError(f"tensor {sorted(repeated)[0]} was written twice")
        self.keys.update(tensors)
        entries = [(name, tensor, _as_bytes(tensor)) for name, tensor in tensors.items()]
        if self._header_per_byte is None:
            header = sum(len(json.dumps({name: _entry(tensor, 0, len(data))})) for name, tensor, data in entries)
            self._header_per_byte = header / max(1, sum(len(data) for _, _, data in entries))
        for name, tensor, data in entries:
            shard = self.shards[-1] if self.shards else None
            if shard is None or (shard.size and shard.size + len(data) > self.max_shard_size):
                if shard is not None:
                    shard.close_data()
                shard = self._open()
            shard.write(name, tensor, data)

    def finish(self) -> list[str]:
        """Write the headers, name the shards (and write the index when there are several). Returns the names."""
        if not self.shards:
            self._open()
        names = ["model.safetensors"] if len(self.shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors" for i in range(len(self.shards))
        ]
        for name, shard in zip(names, self.shards):
            shard.finish(self.out_dir / name)
        if len(self.shards) > 1:
            weight_map = {tensor: name for name, shard in zip(names, self.shards) for tensor in shard.header}
            total = sum(shard.size for shard in self.shards)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names

    def _open(self) -> _Shard:
        expected = min(self.max_shard_size, self.expected_bytes or self.max_shard_size)
        room = 2 * (self._header_per_byte or 0) * expected + _ROOM_MIN
        room = min(_ROOM_MAX, int(room) + (-int(room) % 8))
        self.shards.append(_Shard(self.out_dir / f".shard-{len(self.shards):05d}.safetensors", room))
        return self.shards[-1]


class _Shard:
    """One shard file being written: `8 + room` bytes kept for the length and the header, then the data."""

    def __init__(self, path: Path, room: int):
        self.path, self.room = path, room
        self.header: dict[str, dict] = {}
        self.size = 0
        self.file = open(path, "wb")
        self.file.seek(8 + room)

    def write(self, name: str, tensor, data: memoryview) -> None:
        self.header[name] = _entry(tensor, self.size, self.size + len(data))
        self.file.write(data)
        self.size += len(data)

    def close_data(self) -> None:
        if not self.file.closed:
            self.file.close()

    def finish(self, final: Path) -> None:
        self.close_data()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
        padding = self.room - len(header)
        if padding < 0 or padding > max(_ROOM_MIN, self.size // 1000):
            _rewrite(self.path, header, 8 + self.room, self.size)
        else:
            with open(self.path, "r+b") as out:
                out.write(struct.pack("<Q", self.room) + header + b" " * padding)
        os.replace(self.path, final)


def _rewrite(path: Path, header: bytes, data_start: int, size: int) -> None:
    """`path` again with `header` (its data section moved to follow it), through a temporary file."""
    tmp = path.with_suffix(".tmp")
    with open(path, "rb") as src, open(tmp, "wb") as out:
        out.write(struct.pack("<Q", len(header)) + header)
        out.flush()
        _copy(src, out, data_start, size)
    os.replace(tmp, path)


def _copy(src, out, start: int, size: int) -> None:
    """`size` bytes of `src` from `start` appended to `out`: in the kernel (sendfile) where it can, else in chunks."""
    copied = 0
    try:
        while copied < size:
            done = os.sendfile(out.fileno(), src.fileno(), start + copied, size - copied)
            if done == 0:
                raise OSError(f"{src.name} ended before its {size} data bytes")
            copied += done
        return
    except (AttributeError, OSError) as error:  # no sendfile between files here (macOS): copy through memory
        if copied or getattr(error, "errno", None) not in (None, errno.EINVAL, errno.ENOSYS, errno.ENOTSOCK):
            raise
    src.seek(start)
    while copied < size:
        chunk = src.read(min(size - copied, _COPY_CHUNK))
        if not chunk:
            raise OSError(f"{src.name} ended before its {size} data bytes")
        out.write(chunk)
        copied += len(chunk)


def _as_bytes(tensor) -> memoryview:
    """The tensor's bytes (on the CPU, contiguous), without a copy where it is already so."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _entry(tensor, begin: int, end: int) -> dict:
    """A tensor's safetensors header entry, its bytes at [begin, end) of the data section."""
    return {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [begin, end]}


class _Dtypes(dict):
    """torch dtype -> safetensors' name for it, as `safetensors.torch.save_file` writes it (built on first use)."""

    def __missing__(self, dtype):
        from safetensors.torch import _TYPES

        self.update({torch_dtype: name for name, torch_dtype in _TYPES.items()})
        if dtype not in self:
            raise ValueError(f"safetensors cannot store {dtype}")
        return self[dtype]


_DTYPES = _Dtypes()
