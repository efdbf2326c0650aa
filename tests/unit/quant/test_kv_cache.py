"""The KV cache's modules, scales and recording: the keys the recorder sees are the ones transformers' own cache
keeps (after RoPE), per layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from quantkit.errors import UnsupportedModelError
from quantkit.models.loading import decoder_layers
from quantkit.quant import kv_cache
from quantkit.grids.schemes import Granularity, KVCacheSpec


def _model(model_type: str = "llama") -> nn.Module:
    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=64, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2"])
def test_the_recorder_sees_the_keys_and_values_transformers_caches(model_type):
    model = _model(model_type)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        reference = model(ids, past_key_values=cache, use_cache=True).logits
    attentions = kv_cache.cached_attentions(model)
    assert list(attentions) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    seen = {}
    with kv_cache.recording(attentions, lambda name, k, v: seen.setdefault(name, (k, v))), torch.no_grad():
        logits = model(ids, use_cache=False).logits
    torch.testing.assert_close(logits, reference, atol=0, rtol=0)  # the recorder changes nothing
    for i, name in enumerate(attentions):
        torch.testing.assert_close(seen[name][0], cache.layers[i].keys, atol=0, rtol=0)
        torch.testing.assert_close(seen[name][1], cache.layers[i].values, atol=0, rtol=0)
    with torch.no_grad():  # the hooks are gone
        model(ids, use_cache=False)
    assert len(seen) == 2


def test_scales_are_absmax_over_448_in_compressed_tensors_shapes():
    per_tensor = kv_cache.scale(torch.tensor(8.96), KVCacheSpec())
    assert per_tensor.shape == (1,) and per_tensor.item() == pytest.approx(0.02)
    per_head = kv_cache.scale(torch.tensor([4.48, 0.0]), KVCacheSpec(granularity=Granularity.HEAD))
    assert per_head.shape == (2, 1, 1) and per_head[0].item() == pytest.approx(0.01)
    assert per_head[1].item() > 0  # an all-zero head still gets a usable scale


def test_a_layer_without_a_cached_attention_is_refused_naming_it():
    model = _model()
    layers = decoder_layers(model)
    kv_cache.check_model(model, layers)
    layers[1].self_attn = nn.Identity()
    with pytest.raises(UnsupportedModelError, match=r"decoder layer 1 \(LlamaDecoderLayer\) has no attention module"):
        kv_cache.check_model(model, layers)


def test_an_attention_that_uses_its_cache_beyond_update_is_refused():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.k_proj = nn.Linear(4, 4)

        def forward(self, x, past_key_values=None):
            return past_key_values.get_seq_length()

    class OddAttention(Odd):
        pass

    module = OddAttention()
    with pytest.raises(UnsupportedModelError, match="OddAttention uses its cache beyond update"):
        with kv_cache.recording({"a": module}, lambda *_: None):
            module(torch.zeros(1, 4))


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.k_proj, self.v_proj = nn.Linear(4, 4), nn.Linear(4, 4)


class LegacyAttention(_Attention):  # transformers < 5.24
    def forward(self, x, past_key_values=None):
        return past_key_values.update(x, -x, 0)


class RenamedAttention(_Attention):  # transformers >= 5.24
    def forward(self, x, cache=None):
        return cache.update(x, -x, 0)


@pytest.mark.parametrize("attention", [LegacyAttention, RenamedAttention])
def test_attention_is_found_under_either_name_of_its_cache_argument(attention):
    module = nn.Sequential(attention(), nn.Linear(4, 4))
    assert list(kv_cache.cached_attentions(module)) == ["0"]
    seen = []
    with kv_cache.recording(kv_cache.cached_attentions(module), lambda name, k, v: seen.append((name, k, v))):
        keys, values = module[0](torch.ones(2, 4))
    assert seen[0][0] == "0" and torch.equal(keys, torch.ones(2, 4)) and torch.equal(values, -torch.ones(2, 4))


def test_the_quantized_cache_rounds_keys_and_values_to_fp8_with_their_scales():
    module = RenamedAttention()
    module.k_scale = nn.Parameter(torch.tensor([0.01]), requires_grad=False)
    module.v_scale = nn.Parameter(torch.tensor([1.0]), requires_grad=False)
    assert kv_cache.quantize_cache(module) == 1
    x = torch.tensor([[0.0123, 1.0, 5.0, -9.0]])
    keys, values = module(x)
    expected_keys = (x / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.01  # 5.0 and -9.0 clip to +-4.48
    torch.testing.assert_close(keys, expected_keys, atol=0, rtol=0)
    assert keys[0, 3].item() == pytest.approx(-4.48) and values[0, 0].item() != -0.0123  # FP8 values near 0.0123
