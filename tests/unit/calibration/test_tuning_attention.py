"""The tuning passes' CPU bf16 attention computes what transformers' `sdpa` attention computes (causal without a
mask, boolean and additive masks, grouped key/value heads, more keys than queries), to bf16's precision, with
gradients; what it does not handle goes to `sdpa` itself; the swap lasts only as long as its context."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from quantkit.calibration.tuning_attention import NAME, attention, bf16_cpu_attention
from quantkit.models.loading import decoder_layers


class _Module(torch.nn.Module):
    def __init__(self, groups: int, causal: bool = True):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, causal


def _qkv(batch=2, heads=4, kv_heads=2, q_len=16, kv_len=16, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, q_len, dim), (batch, kv_heads, kv_len, dim), (batch, kv_heads, kv_len, dim)]
    return [torch.randn(s, generator=g).bfloat16().requires_grad_() for s in shapes]


def _padding_mask(batch, q_len, kv_len, boolean: bool):
    keep = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    keep[1, :, :, :3] = False  # the second sample's first 3 keys padded away
    return keep if boolean else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("case", ["causal", "bool-mask", "float-mask", "more-keys", "not-causal"])
def test_same_outputs_and_gradients_as_sdpa(case):
    q_len, kv_len = 16, 24 if case == "more-keys" else 16
    module = _Module(groups=2, causal=case != "not-causal")
    mask = {"bool-mask": _padding_mask(2, q_len, kv_len, True), "float-mask": _padding_mask(2, q_len, kv_len, False)}.get(case)
    ours_in, theirs_in = _qkv(q_len=q_len, kv_len=kv_len), _qkv(q_len=q_len, kv_len=kv_len)
    ours, none = attention(module, *ours_in, mask, scaling=0.2)
    theirs, _ = sdpa_attention_forward(module, *theirs_in, mask, scaling=0.2)
    assert none is None and ours.shape == theirs.shape == (2, q_len, 4, 32) and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=0.03, atol=0.03)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    (ours.float() * weights).sum().backward()
    (theirs.float() * weights).sum().backward()
    for a, b in zip(ours_in, theirs_in):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=0.05, atol=0.05)


def test_float32_queries_under_bf16_autocast_compute_in_bf16():
    """Rotary embeddings in float32 turn the bf16 projections' queries into float32 ones under autocast."""
    q, k, v = (t.detach().float() for t in _qkv())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention(_Module(2), q, k, v, None)
    assert out.dtype == torch.bfloat16
    reference, _ = sdpa_attention_forward(_Module(2), q, k, v, None)
    torch.testing.assert_close(out.float(), reference, rtol=0.03, atol=0.03)


def test_what_it_does_not_handle_goes_to_sdpa(monkeypatch):
    import quantkit.calibration.tuning_attention as tuning

    seen = []
    monkeypatch.setattr(tuning, "sdpa_attention_forward", lambda *a, **k: seen.append(k) or ("sdpa", None))
    q, k, v = _qkv()
    assert attention(_Module(2), q.float(), k.float(), v.float(), None)[0] == "sdpa"  # float32, no autocast
    assert attention(_Module(2), q, k, v, None, softcap=30.0)[0] == "sdpa"
    assert attention(_Module(2), q, k, v, None, position_bias=torch.zeros(1))[0] == "sdpa"
    assert attention(_Module(2), q, k, v, None, dropout=0.1)[0] == "sdpa"
    assert len(seen) == 4 and seen[1]["softcap"] == 30.0


def test_the_layer_uses_it_only_inside_the_context():
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config).eval()
    layer = decoder_layers(model)[0]
    with bf16_cpu_attention(layer):
        assert layer.self_attn.config._attn_implementation == NAME
        ids = torch.randint(0, 300, (2, 12))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = model(ids).logits
    assert layer.self_attn.config._attn_implementation == "sdpa"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outside = model(ids).logits
    torch.testing.assert_close(inside.float(), outside.float(), rtol=0.05, atol=0.05)
    eager = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", num_hidden_layers=1, hidden_size=64,
                                             intermediate_size=128, num_attention_heads=4, vocab_size=300,
                                             attn_implementation="eager"))
    with bf16_cpu_attention(decoder_layers(eager)[0]):  # other implementations are left as they are
        assert eager.config._attn_implementation == "eager"
