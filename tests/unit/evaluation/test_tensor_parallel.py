"""What `eval --tp N` refuses before launching anything (quantkit.evaluation.tensor_parallel.check), read from config.json alone:
families without a plan, heads or activation groups N does not divide, formats that do not shard."""

from __future__ import annotations

import json

import pytest

from quantkit.errors import UnsupportedModelError, UsageError
from quantkit.evaluation import tensor_parallel
from quantkit.models import compat


def write_config(folder, model_type: str = "llama", quantization: dict | None = None, **fields):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **fields)
    folder.mkdir()
    config.save_pretrained(folder)
    if quantization:
        document = json.loads((folder / "config.json").read_text())
        document["quantization_config"] = quantization
        (folder / "config.json").write_text(json.dumps(document))
    return folder


LLAMA = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
# compressed-tensors' FP8 block scheme (LLM Compressor's FP8_BLOCK): activations in groups of 128
FP8_BLOCK = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}}}}


def test_a_model_whose_heads_and_widths_split_passes(tmp_path):
    tensor_parallel.check(write_config(tmp_path / "m", **LLAMA), 2)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, shared_expert_intermediate_size=96)
    tensor_parallel.check(write_config(tmp_path / "moe", "qwen2_moe", **LLAMA, **moe), 2)


def test_heads_the_ranks_do_not_divide_are_refused(tmp_path):
    with pytest.raises(UsageError) as caught:
        tensor_parallel.check(write_config(tmp_path / "m", **LLAMA), 3)
    assert "--tp 3 does not divide the model's num_attention_heads 4, num_key_value_heads 2" in str(caught.value)


@pytest.mark.parametrize("uneven", [False, True], ids=["5.17-5.20", "5.21+"])
def test_a_vocabulary_the_ranks_do_not_divide_is_refused_where_transformers_splits_lm_head_evenly_only(uneven, tmp_path, monkeypatch):
    monkeypatch.setattr(compat, "shards_rows_unevenly", lambda version=None: uneven)
    model = write_config(tmp_path / "m", **LLAMA, vocab_size=425)
    if uneven:
        tensor_parallel.check(model, 2)
        return
    with pytest.raises(UsageError) as caught:
        tensor_parallel.check(model, 2)
    assert "--tp 2 does not divide the model's vocab_size 425" in str(caught.value) and "upgrade transformers" in str(caught.value)
    tensor_parallel.check(write_config(tmp_path / "even", **LLAMA, vocab_size=426), 2)


def test_a_family_without_a_plan_is_refused_naming_those_with_one(tmp_path):
    with pytest.raises(UnsupportedModelError) as caught:
        tensor_parallel.check(write_config(tmp_path / "m", "gpt2", n_embd=64, n_layer=1, n_head=4), 2)
    message = str(caught.value)
    assert "no tensor-parallel plan for 'gpt2' models" in message and "\n" not in message
    assert all(f" {family}," in message for family in ("llama", "mixtral", "qwen2_moe", "gemma2", "phi3", "olmo2"))
    assert {"llama", "qwen3_moe"} <= set(tensor_parallel.families()) and "gpt2" not in tensor_parallel.families()


def test_torchao_artifacts_are_refused(tmp_path):
    torchao = {"quant_method": "torchao", "quant_type": {"default": {"_type": "Int8WeightOnlyConfig"}}}
    with pytest.raises(UnsupportedModelError, match="torchao artifacts do not shard.*--format compressed-tensors"):
        tensor_parallel.check(write_config(tmp_path / "m", quantization=torchao, **LLAMA), 2)


def test_activation_groups_split_over_ranks_are_refused(tmp_path):
    with pytest.raises(UsageError) as caught:  # each rank would hold 64 of o_proj's 128 inputs: half a group
        tensor_parallel.check(write_config(tmp_path / "m", quantization=FP8_BLOCK, **LLAMA), 2)
    assert "a rank's share of the attention output 128 does not hold whole activation groups of 128" in str(caught.value)
    wide = {**LLAMA, "hidden_size": 256, "intermediate_size": 512}
    tensor_parallel.check(write_config(tmp_path / "wide", quantization=FP8_BLOCK, **wide), 2)
    tensor_parallel.check(write_config(tmp_path / "one", quantization=FP8_BLOCK, **LLAMA), 1)


def test_gather_ints_outside_a_distributed_run_is_this_process_alone():
    assert tensor_parallel.gather_ints(7) == [7]
