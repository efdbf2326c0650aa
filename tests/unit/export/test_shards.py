"""Shards written tensor by tensor: the same tensors, split at the size limit, with an index; headers written into
the room kept for them, or the shard rewritten where the room was wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from quantkit.export.shards import ShardWriter


def pieces() -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        {"a.weight": torch.randn(64, 32), "a.scale": torch.rand(64, 1, dtype=torch.bfloat16)},
        {"b.packed": torch.randint(-2**31, 2**31 - 1, (16, 8), dtype=torch.int32), "b.shape": torch.tensor([16, 64])},
        {"c.fp8": torch.randn(8, 8).to(torch.float8_e4m3fn), "c.flag": torch.tensor([True, False])},
    ]


def written(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_one_shard_holds_every_tensor_bit_for_bit(tmp_path):
    writer = ShardWriter(tmp_path)
    for piece in pieces():
        writer.add(piece)
    assert writer.finish() == ["model.safetensors"]
    expected = {k: v for piece in pieces() for k, v in piece.items()}
    got = written(tmp_path)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no work files left


def test_shards_split_at_the_size_limit_with_an_index(tmp_path):
    writer = ShardWriter(tmp_path, max_shard_size=8192)  # a.weight alone is 8192 bytes
    for piece in pieces():
        writer.add(piece)
    names = writer.finish()
    assert len(names) > 1 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    got = written(tmp_path)
    assert set(index["weight_map"]) == set(got) and set(index["weight_map"].values()) == set(names)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in got.values())
    for name in names:
        assert (tmp_path / name).stat().st_size <= 8192 + 512  # the limit, plus the header
    assert torch.equal(got["a.weight"], pieces()[0]["a.weight"])


def test_a_tensor_written_twice_is_refused(tmp_path):
    writer = ShardWriter(tmp_path)
    writer.add({"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="written twice"):
        writer.add({"x": torch.ones(2)})


def data_bytes(tensors) -> int:
    return sum(v.numel() * v.element_size() for v in tensors.values())


def header_length(path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


def test_a_header_that_outgrows_its_room_is_written_in_full(tmp_path):
    """The room is sized from the first tensors (one large one here); then hundreds of small ones follow."""
    big = torch.randn(64, 32)
    writer = ShardWriter(tmp_path, expected_bytes=8192)
    writer.add({"big": big})
    many = {f"layers.{i}.norm.weight": torch.full((2,), float(i)) for i in range(400)}
    writer.add(many)
    writer.finish()
    path = tmp_path / "model.safetensors"
    assert header_length(path) > 4096 and header_length(path) % 8 == 0
    got = written(tmp_path)
    assert torch.equal(got["big"], big) and all(torch.equal(got[k], v) for k, v in many.items())
    assert path.stat().st_size == 8 + header_length(path) + data_bytes(got)


def test_a_room_mostly_padding_is_compacted(tmp_path):
    """Expecting a 50 GB output, the room is 16 MiB; a few kB written get a header of their own size."""
    torch.manual_seed(0)
    writer = ShardWriter(tmp_path, expected_bytes=50 * 10**9)
    writer.add({"a": torch.randn(64, 32), "b": torch.zeros(3, dtype=torch.int32)})
    writer.finish()
    path = tmp_path / "model.safetensors"
    assert path.stat().st_size - data_bytes(written(tmp_path)) - 8 == header_length(path) < 4096


def test_a_small_models_shard_does_not_keep_tens_of_kilobytes_of_padding(tmp_path):
    """A tiny model's header is a large share of its shard (many small scales and norms): padding over 0.1% of the
    shard and 4 KiB is compacted, so the file is its header, its data and at most 7 bytes of alignment."""
    torch.manual_seed(0)
    tensors = {"big": torch.randn(1024, 3072), **{f"layer.{i}.scales": torch.randn(16) for i in range(600)}}
    writer = ShardWriter(tmp_path, expected_bytes=data_bytes(tensors))
    writer.add(tensors)
    writer.finish()
    path = tmp_path / "model.safetensors"
    header = path.read_bytes()[8 : 8 + header_length(path)]
    assert len(header) - len(header.rstrip(b" ")) < 8
    assert path.stat().st_size == 8 + header_length(path) + data_bytes(written(tmp_path))


def test_large_shards_keep_their_room_padded_with_spaces(tmp_path):
    """16 MiB of data whose header needs well under 0.1% of it: written in place, the header padded with spaces."""
    torch.manual_seed(0)
    tensors = {f"w{i}": torch.randn(1024, 1024) for i in range(4)}
    writer = ShardWriter(tmp_path, expected_bytes=data_bytes(tensors))
    writer.add(tensors)
    writer.finish()
    raw = (tmp_path / "model.safetensors").read_bytes()
    header = raw[8 : 8 + header_length(tmp_path / "model.safetensors")]
    assert header.endswith(b" ") and json.loads(header)["w3"]["shape"] == [1024, 1024]
    assert all(torch.equal(written(tmp_path)[k], v) for k, v in tensors.items())


def test_the_rewrite_copies_through_memory_where_the_kernel_cannot(tmp_path, monkeypatch):
    """macOS has no sendfile between files: the compacting rewrite falls back to a chunked copy."""
    import errno
    import os

    def no_sendfile(*args):
        raise OSError(errno.ENOTSOCK, "not a socket")

    monkeypatch.setattr(os, "sendfile", no_sendfile)
    torch.manual_seed(0)
    tensors = {"a": torch.randn(64, 32), "b": torch.arange(5)}
    writer = ShardWriter(tmp_path, expected_bytes=50 * 10**9)
    writer.add(tensors)
    writer.finish()
    got = written(tmp_path)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert header_length(tmp_path / "model.safetensors") < 4096
