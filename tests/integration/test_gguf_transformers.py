"""A second reader of quantkit's GGUF files: transformers' own GGUF loader (`from_pretrained(folder, gguf_file=...)`),
which dequantizes every tensor with gguf's dequantizers, undoes llama.cpp's q/k row order for its `llama`
architecture, Gemma's stored `1 + w` norms, and builds the config from the header. So where the model is float32
it rebuilds the in-memory quantized model exactly: the same weights, bit for bit (Gemma's norms to the float32
rounding of `1 + w`), and the same logits (measured:
max |logit difference| 0.0 on every case below; the tolerance, 1e-5 of the logits' spread, only absorbs a
different order of float32 sums, e.g. an MoE block's experts fused by transformers, one Linear each in quantkit).
Its tokenizer, rebuilt from the file, splits text as the Hugging Face one does.

transformers rebuilds a config from the keys its GGUF loader maps (integrations/ggml.py), its config class's
defaults for the rest: the tiny models keep those defaults for what it does not read. The xfail cases show a
non-default width lost (transformers' limitation: llama.cpp computes the same files right); alike, by its mapping,
it reads no Gemma2/Gemma3 soft-caps, query_pre_attn_scalar or RoPE scaling and no Phi-3 LongRoPE, which quantkit
writes and llama.cpp applies (test_eval_gguf_archs.py).
Left out: mixtral. quantkit writes it as llama.cpp's converter does (`llama` with stacked ffn_*_exps); transformers'
loader has no Mixtral and builds a dense LlamaForCausalLM from such a file, its MLPs not in the file (random)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration

pytest.importorskip("gguf", reason="needs gguf: pip install 'quantkit-llm[gguf]'")
# transformers 5.17 (the lowest release quantkit supports) with gguf 0.17 reads fewer of these files: no mistral
# ("Unknown gguf model_type"), no GGUF tokenizer converter for some architectures, other Gemma3 / Phi-3 mappings.
# The files are the same; this checks them with the loader of the newest releases the suite installs.
pytest.importorskip("transformers", minversion="5.24", reason="transformers' GGUF loader before 5.24 reads fewer architectures")

SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
ARCHS = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "gemma2": {}, "gemma3_text": {},
    # transformers' loader reads neither qwen3moe.expert_feed_forward_length nor a norm_topk_prob (it sets True, as
    # llama.cpp computes): its defaults, 768 and True, kept here
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768, head_dim=64, norm_topk_prob=True),
    "phi3": dict(pad_token_id=2),  # Phi3Config's default pad id (32000) is beyond a tiny vocabulary: </s>, as in `build`
}
WINDOW = 64


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny float32 model of each architecture (widths of whole K super-blocks, grouped KV heads), its norm
    weights spread so that a norm convention shows, built on first use."""
    built = {}

    def model(arch, **extra):
        key = (arch, tuple(sorted(extra.items())))
        if key not in built:
            built[key] = build(tmp_path_factory.mktemp("models") / arch, arch, **{**SHAPES, **ARCHS.get(arch, {}), **extra})
        return built[key]
    return model


def build(folder, arch: str, **config):
    from safetensors.torch import load_file, save_file

    from conftest import make_text
    from quantkit.models.tiny import build_tiny_model

    src = build_tiny_model(folder, make_text(3000), arch, **config)
    if arch in ("qwen2", "phi3"):  # the tokenizer names a pad token (</s>), as Qwen2's and Phi-3's do: transformers 5
        import json  # loads a qwen2 folder's tokenizer as Qwen2Tokenizer, which adds one (<|endoftext|>) otherwise;
        # transformers' GGUF loader takes Phi3Config's default pad id (32000, beyond a tiny vocabulary) where the file
        # has no tokenizer.ggml.padding_token_id, and gguf's SpecialVocab writes it from the tokenizer's pad token
        settings = json.loads((src / "tokenizer_config.json").read_text())
        (src / "tokenizer_config.json").write_text(json.dumps({**settings, "pad_token": "</s>"}))
    weights, noise = load_file(src / "model.safetensors"), torch.Generator().manual_seed(0)
    save_file({k: v + 0.3 * torch.randn(v.shape, generator=noise) if "norm" in k else v for k, v in weights.items()},
              src / "model.safetensors", metadata={"format": "pt"})
    return src


def both_ways(src, out, recipe_name: str, text: str, options=None):
    """(the in-memory quantized model, transformers' model from the file, the source tokenizer's ids of the text)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.export import for_format
    from quantkit.finalization.finalize import finalize, prepare, quantize_model
    from quantkit.quant import registry

    finalize(src, out, registry.resolve(recipe_name), calibration=options)
    recipe = for_format(registry.resolve(recipe_name), registry.Format.GGUF)
    model = quantize_model(prepare(src, recipe, registry.Format.GGUF, calibration=options), recipe, calibration=options)
    ids = AutoTokenizer.from_pretrained(src)(text)["input_ids"][:WINDOW]
    assert AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)(text)["input_ids"][:WINDOW] == ids
    loaded = AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name, dtype=torch.float32)
    return model, loaded, ids


def assert_same_model(model, loaded, ids) -> float:
    """The weights both have under one name are equal: Gemma's norms up to the float32 rounding of the file's
    `1 + w` (half an ulp of [1, 4): 2**-23) before transformers' exact `- 1`, which its `1 + w` undoes exactly again;
    the logits agree to 1e-5 of their spread. Returns the max logit difference."""
    gemma = model.config.model_type.startswith("gemma")
    theirs = loaded.state_dict()
    shared = [k for k, v in model.state_dict().items() if k in theirs]
    assert len(shared) >= len(theirs) - 2 * model.config.num_hidden_layers, sorted(set(theirs) - set(shared))
    for key in shared:
        ours = model.state_dict()[key].float()
        if gemma and "norm" in key:
            torch.testing.assert_close(theirs[key], ours, rtol=0, atol=2 ** -23, msg=key)
        else:
            assert torch.equal(theirs[key], ours), key
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float()
        found = loaded(torch.tensor([ids])).logits[0].float()
    diff = (found - expected).abs().max().item()
    assert diff <= 1e-5 * expected.std().item(), diff
    return diff


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_reads_the_q8_0_model_quantkit_wrote(tiny_models, text_file, tmp_path, arch):
    model, loaded, ids = both_ways(tiny_models(arch), tmp_path / "m.gguf", "gguf-q8-0", text_file.read_text())
    # llama.cpp's `llama` holds Mistral's dense models; transformers rebuilds them as the same graph, a Llama
    assert loaded.config.model_type == {"mistral": "llama"}.get(arch, arch)
    print(arch, "gguf-q8-0", assert_same_model(model, loaded, ids))


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_reads_the_q4_k_m_model_quantkit_wrote(tiny_models, text_file, tmp_path, arch):
    """GPTQ on llama.cpp's Q4_K_M mixture: Q4_K and Q6_K blocks, the embedding quantized too."""
    from quantkit.finalization.finalize import CalibrationOptions

    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    model, loaded, ids = both_ways(tiny_models(arch), tmp_path / "m.gguf", "gguf-q4-k-m", text_file.read_text(), options)
    print(arch, "gguf-q4-k-m", assert_same_model(model, loaded, ids))


@pytest.mark.parametrize("recipe", ["gguf-q4-0", "gguf-q4-1"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # llama.cpp's row order undone, and none to undo
def test_transformers_reads_the_q4_0_and_q4_1_models_quantkit_wrote(tiny_models, text_file, tmp_path, arch, recipe):
    model, loaded, ids = both_ways(tiny_models(arch), tmp_path / "m.gguf", recipe, text_file.read_text())
    print(arch, recipe, assert_same_model(model, loaded, ids))


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason=(
    "transformers' GGUF loader maps neither qwen3.attention.key_length (Qwen3Config's head_dim stays 128) nor "
    "qwen3moe.expert_feed_forward_length (moe_intermediate_size stays 768): its model's shapes are not the file's. "
    "quantkit writes both; llama.cpp computes these files as the in-memory model (Q8_0, max logit difference "
    "0.018 and 0.015, logits spread 0.31 and 0.33: llama.cpp's quantized activations; top-1 agreement 100% and 97%)"))
@pytest.mark.parametrize("arch, extra", [("qwen3", dict(head_dim=64)), ("qwen3_moe", dict(moe_intermediate_size=256))])
def test_transformers_loses_the_widths_it_does_not_read(tiny_models, text_file, tmp_path, arch, extra):
    model, loaded, ids = both_ways(tiny_models(arch, **extra), tmp_path / "m.gguf", "gguf-q8-0", text_file.read_text())
    assert_same_model(model, loaded, ids)
