"""Shards assembled from pieces by copying bytes: the same tensors, split at the size limit, with an index."""

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
    assert not (tmp_path / ".pieces").exists() and not (tmp_path / "model.safetensors.index.json").exists()


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
