"""The layer wirings: found from the module tree, and the names every algorithm reads from them."""

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.errors import UnsupportedModelError
from quantkit.models.architectures import LLAMA, PHI3, STARCODER2, find_wiring, shared_input_leaders, wiring_of
from quantkit.models.loading import decoder_layers


def _layer(model_type: str) -> nn.Module:
    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=64, pad_token_id=0)
    with torch.device("meta"):
        return decoder_layers(AutoModelForCausalLM.from_config(config))[0]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_llama_style_layers_have_the_llama_wiring(model_type):
    layer = _layer(model_type)
    assert find_wiring(layer) is LLAMA and wiring_of(layer) is LLAMA
    for stage in LLAMA.stages:
        assert all(isinstance(layer.get_submodule(name), nn.Linear) for name in stage)


def test_fused_projections_have_the_phi3_wiring_with_each_linear_once():
    layer = _layer("phi3")
    assert find_wiring(layer) is PHI3
    assert PHI3.stages == ((PHI3.q,), (PHI3.o,), (PHI3.gate,), (PHI3.down,))
    assert [linears for _, linears in PHI3.smoothing] == [(PHI3.q,), (PHI3.gate,)]  # a fused Linear is scaled once


def test_a_non_gated_mlp_has_the_starcoder2_wiring_with_one_linear_reading_the_norm():
    layer = _layer("starcoder2")
    assert find_wiring(layer) is STARCODER2 and STARCODER2.gate is None
    assert STARCODER2.stages == (STARCODER2.qkv, (STARCODER2.o,), (STARCODER2.up,), (STARCODER2.down,))
    assert [linears for _, linears in STARCODER2.smoothing] == [STARCODER2.qkv, (STARCODER2.up,)]
    assert all(isinstance(layer.get_submodule(name), nn.Linear) for stage in STARCODER2.stages for name in stage)


def test_the_wiring_orders_and_groups_the_linears():
    assert LLAMA.stages == ((LLAMA.q, LLAMA.k, LLAMA.v), (LLAMA.o,), (LLAMA.gate, LLAMA.up), (LLAMA.down,))
    assert [norm for norm, _ in LLAMA.smoothing] == [LLAMA.input_norm, LLAMA.post_attention_norm]
    feeding = [(prev, linears) for prev, linears, _ in LLAMA.awq_mappings]
    assert feeding[1] == (LLAMA.v, (LLAMA.o,)) and feeding[3] == (LLAMA.up, (LLAMA.down,))


def test_a_layer_without_the_parts_is_refused_naming_the_first_missing_one():
    layer = _layer("llama")
    del layer.mlp.down_proj
    assert find_wiring(layer) is None
    with pytest.raises(UnsupportedModelError, match="needs mlp.down_proj in each decoder layer"):
        wiring_of(layer)


def test_shared_input_leaders_group_each_layers_stages():
    names = [f"model.layers.{i}.{n}" for i in (0, 1) for n in (LLAMA.q, LLAMA.k, LLAMA.o, LLAMA.gate, LLAMA.up)]
    leaders = shared_input_leaders(names)
    assert leaders[f"model.layers.1.{LLAMA.k}"] == f"model.layers.1.{LLAMA.q}"  # v is not planned: q and k still share
    assert leaders[f"model.layers.1.{LLAMA.up}"] == f"model.layers.1.{LLAMA.gate}"
    assert leaders[f"model.layers.0.{LLAMA.o}"] == f"model.layers.0.{LLAMA.o}"
