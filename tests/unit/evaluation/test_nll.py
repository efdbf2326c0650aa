"""quantkit.evaluation.nll: the loss from lm_head's logits a chunk of tokens at a time equals the loss from the full
logits, for models that scale or soft-cap their logits, tied embeddings and quantized artifacts; the logits held at
once are bounded; a model whose forward does something else falls back to its full logits."""

from __future__ import annotations

import pytest
import torch

from quantkit.data import eval_windows
from quantkit.evaluation import evaluate, nll
from quantkit.evaluation.evaluate import perplexity
from quantkit.models.tiny import TINY_LLAMA

CONFIGS = {
    "llama": ("llama", {}),
    "gemma2 (soft-capped logits)": ("gemma2", {"final_logit_softcapping": 0.5, "head_dim": 16}),
    "tied embeddings": ("llama", {"tie_word_embeddings": True}),
    "granite (logits_scaling)": ("granite", {"logits_scaling": 4.0}),
    "cohere (logit_scale)": ("cohere", {"logit_scale": 0.25, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
}


def _tiny(model_type: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**TINY_LLAMA, **overrides})
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, TINY_LLAMA["vocab_size"], (600,), generator=torch.Generator().manual_seed(1))


def _reference_nll(model, ids: torch.Tensor, seq_len: int, stride: int) -> float:
    """Mean NLL over the same windows, from the model's full logits."""
    total, count = 0.0, 0
    with torch.inference_mode():
        for begin, end, target_begin in eval_windows(ids.numel(), seq_len, stride):
            inputs = ids[begin:end][None]
            labels = inputs.clone()
            labels[:, : target_begin - begin] = nll.IGNORE_INDEX
            window_nll, window_count = nll.full_logits_nll(model, inputs, labels)
            total, count = total + window_nll, count + window_count
    return total / count


def _chosen(model, ids: torch.Tensor):
    with torch.inference_mode():
        return nll.nll_function(model, ids).func


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_loss_equals_the_full_logits_loss(name, ids):
    model_type, overrides = CONFIGS[name]
    model = _tiny(model_type, **overrides)
    assert _chosen(model, ids) is nll.chunked_nll
    result = perplexity(model, ids, seq_len=128, stride=64, batch_size=2)
    assert result.nll == pytest.approx(_reference_nll(model, ids, 128, 64), rel=1e-5)


def test_a_bfloat16_model_is_chunked_and_equal_to_its_full_logits(ids, monkeypatch):
    """16-bit logits: the chunked ones may round a unit of the last place the other way, and still pass the probe."""
    model = _tiny("gemma2", final_logit_softcapping=0.5, head_dim=16).to(torch.bfloat16)
    assert _chosen(model, ids) is nll.chunked_nll
    chunked = perplexity(model, ids, seq_len=128, stride=64)
    monkeypatch.setattr(evaluate, "nll_function", lambda model, probe: lambda *batch: nll.full_logits_nll(model, *batch))
    assert chunked.nll == pytest.approx(perplexity(model, ids, seq_len=128, stride=64).nll, rel=1e-3)


def test_the_logit_transform_is_the_models(ids):
    """The soft-capping matters here (logits well beyond the cap): without it the chunked logits would differ."""
    model = _tiny("gemma2", final_logit_softcapping=0.5, head_dim=16)
    with torch.inference_mode():
        capped = nll.logit_head(model)(model.base_model(input_ids=ids[None, :8]).last_hidden_state)
        raw = model.lm_head(model.base_model(input_ids=ids[None, :8]).last_hidden_state)
    assert capped.abs().max() <= 0.5 < raw.abs().max()


def test_the_logits_held_at_once_are_bounded(ids, monkeypatch):
    """With chunks of 5 positions, lm_head never computes more than 5 positions of a window at once (the probe's own
    forward excepted: PROBE_TOKENS positions), where a batch of two 128-token windows has 254 scored positions."""
    model = _tiny("llama")
    expected = perplexity(model, ids, seq_len=128, batch_size=2)
    vocab = model.config.vocab_size
    monkeypatch.setattr(nll, "LOGITS_CHUNK_BYTES", 5 * 4 * vocab)
    shapes = []
    handle = model.lm_head.register_forward_hook(lambda module, args, output: shapes.append(tuple(output.shape)))
    try:
        result = perplexity(model, ids, seq_len=128, batch_size=2)
    finally:
        handle.remove()
    positions = [torch.Size(shape[:-1]).numel() for shape in shapes]
    assert max(positions) <= max(5, nll.PROBE_TOKENS) and sum(positions) > 254
    assert all(shape[-1] == vocab for shape in shapes)
    assert result.nll == pytest.approx(expected.nll, rel=1e-6)


def test_only_the_scored_positions_reach_lm_head(ids):
    """A strided window's context is fed to the base model, not to lm_head."""
    model = _tiny("llama")
    inputs = ids[None, :64]
    labels = inputs.clone()
    labels[:, :48] = nll.IGNORE_INDEX
    shapes = []
    handle = model.lm_head.register_forward_hook(lambda module, args, output: shapes.append(tuple(output.shape)))
    try:
        with torch.inference_mode():
            total, count = nll.chunked_nll(model.base_model, nll.logit_head(model), 1000, inputs, labels)
    finally:
        handle.remove()
    assert shapes == [(1, 16, model.config.vocab_size)] and count == 16
    assert total == pytest.approx(nll.full_logits_nll(model, inputs, labels)[0], rel=1e-5)


def test_a_forward_that_does_something_else_gets_its_full_logits(ids, monkeypatch):
    """A model whose forward changes the logits in a way `logit_head` does not know is found on the probe's tokens
    and measured from its own logits, as before."""
    model = _tiny("llama")
    forward = model.forward

    def doubled(*args, **kwargs):
        output = forward(*args, **kwargs)
        output.logits = output.logits * 2
        return output

    monkeypatch.setattr(model, "forward", doubled)
    assert _chosen(model, ids) is nll.full_logits_nll
    result = perplexity(model, ids, seq_len=128, stride=64)
    assert result.nll == pytest.approx(_reference_nll(model, ids, 128, 64), rel=1e-5)


def test_a_wrapped_model_gets_its_full_logits(ids):
    """No base model or lm_head of its own (a wrapper, e.g. DDP in training): the full logits."""
    inner = _tiny("llama")

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            return self.inner(**kwargs)

    assert _chosen(Wrapper(), ids) is nll.full_logits_nll
    assert perplexity(Wrapper(), ids, seq_len=128).nll == pytest.approx(perplexity(inner, ids, seq_len=128).nll, rel=1e-6)


QUANTIZED_LM_HEAD = """scheme:
  weights: {dtype: int8, granularity: channel, symmetric: true}
  activations: {dtype: int8, granularity: token, symmetric: false, dynamic: true}
algorithm: {name: rtn}
format: compressed-tensors
ignore: []
"""


@pytest.mark.parametrize("fmt", ["compressed-tensors", "torchao"])
def test_a_quantized_artifact_with_a_quantized_lm_head_is_chunked_and_equal(tiny_model_dir, ids, tmp_path, fmt):
    """The chunked path runs the artifact's own lm_head (its weights and run-time activation quantization)."""
    from quantkit.finalization.finalize import finalize
    from quantkit.quant.registry import Format, resolve

    recipe = tmp_path / "w8a8-with-lm-head.yaml"
    recipe.write_text(QUANTIZED_LM_HEAD)
    written = finalize(tiny_model_dir, tmp_path / "out", resolve(str(recipe)), Format(fmt))
    assert any(e.name == "lm_head" and e.quantized for e in written.plan)
    model, _ = evaluate.load_eval_model(written.dst)
    ids = ids % model.config.vocab_size
    assert _chosen(model, ids) is nll.chunked_nll
    result = perplexity(model, ids, seq_len=128, stride=64)
    assert result.nll == pytest.approx(_reference_nll(model, ids, 128, 64), rel=1e-5)
