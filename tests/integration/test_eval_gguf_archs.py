"""Gemma2, Gemma3 and Phi-3 GGUF files run in llama.cpp (llama-cpp-python) compute the model quantkit quantized in
memory: on one window of text, the perplexities within 1%, the top token the same at most positions, and no logit
further off than half the logits' spread (llama.cpp quantizes activations for its dot products: not equal).

The models are made sharp (projections x4, embeddings and lm_head scaled, norm weights spread, small soft-caps, a
sliding window of 16 in a window of 128, Gemma3's global layers scaled linearly on another RoPE base, Phi-3's
LongRoPE factors far from 1) so that a wrong convention shows. Measured, perplexity in memory vs llama.cpp: Q8_0
Gemma2 2956.7 vs 2956.5, Gemma3 3480.0 vs 3480.8, Phi-3 448.0 vs 447.6; Q4_K_M Gemma2 2911.6 vs 2898.1, Gemma3
3577.1 vs 3573.0, Phi-3 445.0 vs 444.7 (max logit difference at most 0.30 of the logits' spread; a tiny Llama made
alike: 0.15 Q8_0, 0.22 Q4_K_M). Broken on purpose, each fails: Gemma's norms without the +1 (top-1 agreement 0-2%),
no sliding window, every layer global, the default attention soft-cap (1.4 spreads off), Gemma3's RoPE bases
swapped, its linear scaling dropped (0.76), Phi-3 without its LongRoPE factors or attention factor (1.9)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.llama_cpp_python]

pytest.importorskip("llama_cpp", reason="needs llama-cpp-python: pip install 'quantkit-llm[gguf]'")

SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
CONFIGS = {
    "gemma2": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=16, attn_logit_softcapping=2.0,
                   final_logit_softcapping=5.0),
    "gemma3_text": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=16, final_logit_softcapping=5.0,
                        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
    "phi3": dict(intermediate_size=256, max_position_embeddings=4096, original_max_position_embeddings=512,
                 pad_token_id=None, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                     "original_max_position_embeddings": 512,
                                                     "long_factor": [1.0 + i for i in range(32)],
                                                     "short_factor": [1.0 + i / 2 for i in range(32)]}),
}
EMBEDDING_SCALE = {"gemma2": 10.0, "gemma3_text": 10.0, "phi3": 2.0}
WINDOW = 128


@pytest.fixture(scope="module")
def sharp_models(tmp_path_factory):
    """A sharp tiny model of each architecture, built on first use (named without the architecture: llama.cpp gives
    a model named phi3 special tokens a tiny tokenizer lacks)."""
    from safetensors.torch import load_file, save_file

    from conftest import make_text
    from quantkit.models.tiny import build_tiny_model

    built = {}

    def model(arch):
        if arch not in built:
            src = build_tiny_model(tmp_path_factory.mktemp("sharp") / f"sharp-{len(built)}", make_text(3000), arch,
                                   **{**SHAPES, **CONFIGS[arch]})
            weights, noise = load_file(src / "model.safetensors"), torch.Generator().manual_seed(0)
            save_file({k: sharpened(k, v, EMBEDDING_SCALE[arch], noise) for k, v in weights.items()},
                      src / "model.safetensors", metadata={"format": "pt"})
            built[arch] = src
        return built[arch]
    return model


def sharpened(key: str, value: torch.Tensor, embedding_scale: float, noise: torch.Generator) -> torch.Tensor:
    if key.endswith("proj.weight"):
        return value * 4
    if "norm" in key:
        return value + 0.3 * torch.randn(value.shape, generator=noise)
    if "embed_tokens" in key or key.startswith("lm_head"):
        return value * embedding_scale
    return value


def logits_both_ways(src, out, recipe_name: str, text: str, options=None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(the in-memory quantized model's logits, llama.cpp's on the file) on the text's first WINDOW tokens."""
    from transformers import AutoTokenizer

    from quantkit.evaluation.gguf import open_model
    from quantkit.export import for_format
    from quantkit.finalization.finalize import finalize, prepare, quantize_model
    from quantkit.quant import registry

    finalize(src, out, registry.resolve(recipe_name), calibration=options)
    recipe = for_format(registry.resolve(recipe_name), registry.Format.GGUF)
    model = quantize_model(prepare(src, recipe, registry.Format.GGUF, calibration=options), recipe, calibration=options)
    ids = AutoTokenizer.from_pretrained(src)(text)["input_ids"][:WINDOW]
    with torch.no_grad():
        in_memory = model(torch.tensor([ids])).logits[0].float()
    llm = open_model(out, n_ctx=WINDOW, threads=2)
    try:
        llm.eval(ids)
        file = torch.tensor(np.array(llm.scores[:len(ids)]), dtype=torch.float32)
    finally:
        llm.close()
    return in_memory, file, ids


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return math.exp(-logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean().item())


def assert_same_model(in_memory: torch.Tensor, file: torch.Tensor, ids: list[int]) -> dict:
    """llama.cpp quantizes activations for its dot products, so not equal: close, by three measures."""
    found = {"in memory": perplexity(in_memory, ids), "llama.cpp": perplexity(file, ids),
             "top-1 agreement": (in_memory.argmax(-1) == file.argmax(-1)).float().mean().item(),
             "max |logit diff| / logit std": ((in_memory - file).abs().max() / in_memory.std()).item()}
    assert found["llama.cpp"] == pytest.approx(found["in memory"], rel=0.01), found
    assert found["top-1 agreement"] >= 0.85, found
    assert found["max |logit diff| / logit std"] < 0.5, found
    return found


@pytest.mark.parametrize("arch", CONFIGS)
def test_llama_cpp_computes_the_q8_0_model_quantkit_wrote(sharp_models, text_file, tmp_path, arch):
    in_memory, file, ids = logits_both_ways(sharp_models(arch), tmp_path / "m.gguf", "gguf-q8-0", text_file.read_text())
    print(arch, "gguf-q8-0", assert_same_model(in_memory, file, ids))


@pytest.mark.parametrize("arch", CONFIGS)
def test_llama_cpp_computes_the_q4_k_m_model_quantkit_wrote(sharp_models, text_file, tmp_path, arch):
    """GPTQ on llama.cpp's Q4_K_M types (Gemma's tied embedding Q6_K, Phi-3's attn_qkv by attn_v's rule)."""
    from quantkit.finalization.finalize import CalibrationOptions

    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=64)
    in_memory, file, ids = logits_both_ways(sharp_models(arch), tmp_path / "m.gguf", "gguf-q4-k-m", text_file.read_text(),
                                            options)
    print(arch, "gguf-q4-k-m", assert_same_model(in_memory, file, ids))
