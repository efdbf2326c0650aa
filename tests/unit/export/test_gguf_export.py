"""The GGUF exporter: one file whose dequantized tensors are the quantized model's, bit for bit, with llama.cpp's
names, row order, metadata and tokenizer; and the refusals, before any work."""

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from quantkit.errors import DestinationExistsError, FormatError, UsageError  # noqa: E402
from quantkit.export import for_format  # noqa: E402
from quantkit.export.gguf import permute_rows  # noqa: E402
from quantkit.export.gguf_vocab import PRE_TOKENIZERS, pre_tokenizer  # noqa: E402
from quantkit.finalization.finalize import CalibrationOptions, finalize, prepare, quantize_model  # noqa: E402
from quantkit.quant import registry  # noqa: E402
from quantkit.grids.schemes import ScaleDtype  # noqa: E402

GGUF = registry.Format.GGUF


@pytest.fixture(scope="module")
def k_model_dir(tmp_path_factory):
    """A tiny float32 Llama whose Linears' inputs are whole K super-blocks (256, 512), with grouped KV heads."""
    from conftest import make_text
    from quantkit.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "k-llama", make_text(3000), hidden_size=256,
                            intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def read(path) -> tuple[dict, dict]:
    """(metadata fields by name, tensors by name) of a GGUF file, as gguf's reader sees them."""
    reader = gguf.GGUFReader(path)
    return reader.fields, {t.name: t for t in reader.tensors}


def field(fields, name):
    return fields[name].contents()


def dequantized(tensor) -> torch.Tensor:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(values)).float()


def expected_tensors(src, recipe_name: str, options=None) -> tuple[dict[str, torch.Tensor], object]:
    """The in-memory quantized model's tensors under llama.cpp's names and row order."""
    recipe = recipe_name if isinstance(recipe_name, registry.Recipe) else registry.resolve(recipe_name)
    recipe = for_format(recipe, GGUF)
    model = quantize_model(prepare(src, recipe, GGUF, calibration=options), recipe, calibration=options)
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    found = {}
    for key, value in model.state_dict().items():
        value = value.float()
        if key.endswith("q_proj.weight"):
            value = permute_rows(value, config.num_attention_heads)
        elif key.endswith("k_proj.weight"):
            value = permute_rows(value, config.num_key_value_heads)
        found[names.get_name(key, try_suffixes=(".weight", ".bias"))] = value
    return found, config


@pytest.mark.parametrize("recipe, qtype", [("gguf-q8-0", "Q8_0"), ("gguf-q4-0", "Q4_0"), ("gguf-q4-1", "Q4_1")])
def test_every_tensor_dequantizes_to_the_quantized_models(wide_model_dir, tmp_path, recipe, qtype):
    out = tmp_path / "model.gguf"
    finalize(wide_model_dir, out, registry.resolve(recipe))
    fields, tensors = read(out)
    expected, config = expected_tensors(wide_model_dir, recipe)
    assert set(tensors) == set(expected) - ({"output.weight"} if config.tie_word_embeddings else set())
    for name, tensor in tensors.items():
        assert torch.equal(dequantized(tensor).reshape(expected[name].shape), expected[name]), name
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == qtype
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == qtype
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    assert tensors["token_embd.weight"].tensor_type.name == "F32"  # a float32 model's unquantized matrices stay F32
    assert field(fields, "general.file_type") == gguf.LlamaFileType[f"MOSTLY_{qtype}"]


def k_recipe(qtype: str, **fields) -> registry.Recipe:
    """A round-to-nearest recipe on one K grid (llama.cpp's own rounding, as llama-quantize without an imatrix);
    `fields`: more of the recipe's (`ignore`)."""
    from quantkit.quant.gguf_mixtures import k_spec

    weights = {k: v.value if hasattr(v, "value") else v for k, v in vars(k_spec(qtype)).items()
               if k in ("dtype", "granularity", "group_size", "symmetric", "scale_dtype")}
    return registry.parse_recipe(f"rtn-{qtype}", {"scheme": {"weights": weights}, "format": "gguf", "on_indivisible": "skip",
                                                    **fields})


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q3_K"])
def test_k_quants_are_llama_cpps_own_rounding_in_the_file(k_model_dir, tmp_path, qtype):
    """K grids round with llama.cpp's own search (k_grids, held to llama.cpp's bytes by its tests); the file
    dequantizes to the quantized model exactly, every Linear in the K type."""
    out = tmp_path / "model.gguf"
    recipe = k_recipe(qtype)
    finalize(k_model_dir, out, recipe)
    fields, tensors = read(out)
    expected, _ = expected_tensors(k_model_dir, recipe)
    for name, tensor in tensors.items():
        assert torch.equal(dequantized(tensor).reshape(expected[name].shape), expected[name]), name
    linears = [t for name, t in tensors.items() if name.startswith("blk.") and not name.endswith("norm.weight")]
    assert linears and all(t.tensor_type.name == qtype for t in linears)


def test_a_mixture_is_llama_cpps_calibrated_by_gptq(k_model_dir, text_file, tmp_path):
    """gguf-q4-k-m: llama.cpp's Q4_K_M types tensor by tensor (attn_v and ffn_down Q6_K where more_bits, the
    output Q6_K, the embedding Q4_K by llama.cpp's rounding), every Linear GPTQ-rounded on its K grid; the file
    dequantizes to the in-memory quantized model exactly (its embedding included)."""
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    out = tmp_path / "q4km.gguf"
    finalize(k_model_dir, out, registry.resolve("gguf-q4-k-m"), calibration=options)
    fields, tensors = read(out)
    types = {name: t.tensor_type.name for name, t in tensors.items()}
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(2)] == ["Q4_K", "Q6_K"]  # more_bits(i, 2): layer 1 only
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(2)] == ["Q4_K", "Q6_K"]
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_up.weight"] == types["blk.0.attn_output.weight"] == "Q4_K"
    expected, _ = expected_tensors(k_model_dir, "gguf-q4-k-m", options)
    for name, tensor in tensors.items():
        assert torch.equal(dequantized(tensor).reshape(expected[name].shape), expected[name]), name
    assert field(fields, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M


def test_the_token_embedding_of_a_calibrated_mixture_takes_llama_cpps_search_under_a_unit_importance(k_model_dir, text_file,
                                                                                               tmp_path):
    """No calibration reaches token_embd (a lookup, not a matrix product). Calibrated, it takes llama.cpp's search
    with an importance matrix of ones (each weight weighted by sqrt(sigma2 + x^2)); without data, llama.cpp's
    reference quantizer, byte for byte as llama-quantize without an imatrix. The two differ on this model."""
    from quantkit.grids.k_grids import quantize_k
    from quantkit.models.loading import load_model

    weight = load_model(k_model_dir).get_input_embeddings().weight.detach().float()
    unit, reference = (quantize_k(weight, gguf.GGMLQuantizationType.Q4_K, imp).ggml_blocks().tobytes()
                       for imp in (torch.ones(weight.shape[1]), None))
    assert unit != reference
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    calibrated, plain = tmp_path / "gptq.gguf", tmp_path / "rtn.gguf"
    finalize(k_model_dir, calibrated, registry.resolve("gguf-q4-k-m"), calibration=options)
    rtn = registry.parse_recipe("rtn", {**registry.resolve("gguf-q4-k-m").to_file(), "algorithm": {"name": "rtn"},
                                        "calibration": None})
    finalize(k_model_dir, plain, rtn)
    assert read(calibrated)[1]["token_embd.weight"].data.tobytes() == unit
    assert read(plain)[1]["token_embd.weight"].data.tobytes() == reference


@pytest.mark.parametrize("qtype, fallback", [("Q4_K", "Q5_0"), ("Q6_K", "Q8_0"), ("Q3_K", "Q4_0"), ("Q5_K", "Q5_1")])
def test_k_quants_fall_back_where_rows_are_not_whole_super_blocks(wide_model_dir, tmp_path, qtype, fallback):
    """As llama.cpp's tensor_type_fallback: a 128-wide input takes blocks of 32, reported; the file dequantizes to
    the quantized model exactly."""
    recipe = k_recipe(qtype)
    plan = {e.name: e for e in prepare(wide_model_dir, recipe, GGUF).plan}
    q_proj = plan["model.layers.0.self_attn.q_proj"]
    if fallback is None:
        assert not q_proj.quantized and "no fallback fits" in q_proj.note
    else:
        assert f"{qtype} -> {fallback}" in q_proj.note
    assert plan["model.layers.0.mlp.down_proj"].scheme.weights.k_quant_type == qtype  # 256 inputs
    out = tmp_path / "m.gguf"
    finalize(wide_model_dir, out, recipe)
    _, tensors = read(out)
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == (fallback or "F32")
    expected, _ = expected_tensors(wide_model_dir, recipe)
    for name, tensor in tensors.items():
        assert torch.equal(dequantized(tensor).reshape(expected[name].shape), expected[name]), name


def test_autoround_on_a_mixture_tunes_the_rounding_on_llama_cpps_k_grids(k_model_dir, text_file, tmp_path):
    """AutoRound on Q4_K_M: each Linear's K grid is llama.cpp's search's, its rounding learned; the file
    dequantizes to the tuned model exactly, and tuning lowers every layer's loss against round to nearest."""
    import yaml

    data = registry.resolve("gguf-q4-k-m").to_file()
    data["algorithm"] = {"name": "autoround", "iters": 20, "batch_size": 4, "samples_per_pass": 2, "seed": 0}
    path = tmp_path / "autoround-q4-k-m.yaml"
    path.write_text(yaml.safe_dump(data))
    recipe = registry.resolve(str(path))
    options = CalibrationOptions(data=str(text_file), num_samples=8, seq_len=32)
    out = tmp_path / "m.gguf"
    result = finalize(k_model_dir, out, recipe, calibration=options)
    _, tensors = read(out)
    expected, _ = expected_tensors(k_model_dir, recipe, options)
    for name, tensor in tensors.items():
        assert torch.equal(dequantized(tensor).reshape(expected[name].shape), expected[name]), name
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q4_K"
    tuning = result.calibration["autoround"]
    assert tuning and all(t["loss_tuned"] < t["loss_rtn"] for t in tuning.values()), tuning


@pytest.mark.parametrize("recipe", ["int4-asym", "gptq-w4a16-asym"])
def test_an_asymmetric_grid_is_q4_1_bit_for_bit(wide_model_dir, text_file, tmp_path, recipe):
    """Zero points with --format gguf: groups of 128 are four Q4_1 blocks each, the minimum an fp16 value (the step
    rounded to 7 significant bits); round to nearest and GPTQ reach the file unchanged."""
    resolved = registry.resolve(recipe)
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32) if resolved.needs_calibration else None
    out = tmp_path / "asym.gguf"
    finalize(wide_model_dir, out, resolved, GGUF, calibration=options)
    _, tensors = read(out)
    expected, _ = expected_tensors(wide_model_dir, recipe, options)
    for name, tensor in tensors.items():
        assert torch.equal(dequantized(tensor).reshape(expected[name].shape), expected[name]), name
    assert tensors["blk.0.ffn_up.weight"].tensor_type.name == "Q4_1"


def test_autoround_on_an_fp16_minimum_is_refused(tiny_model_dir, tmp_path):
    from dataclasses import replace

    recipe = registry.resolve("gguf-q4-1")
    autoround = replace(recipe, steps=registry.resolve("autoround-w4a16").steps)
    with pytest.raises(FormatError, match="Q4_1's fp16 minimum"):
        finalize(tiny_model_dir, tmp_path / "m.gguf", autoround)


def test_a_gptq_grid_reaches_the_file_unchanged(wide_model_dir, text_file, tmp_path):
    """gptq-w4a16 with --format gguf: groups of 128 with fp16 scales are four Q4_0 blocks each, bit for bit."""
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    out = tmp_path / "gptq.gguf"
    result = finalize(wide_model_dir, out, registry.resolve("gptq-w4a16"), GGUF, calibration=options)
    assert result.recipe.scheme.weights.scale_dtype is ScaleDtype.FLOAT16 and result.output_bytes == out.stat().st_size
    fields, tensors = read(out)
    expected, _ = expected_tensors(wide_model_dir, "gptq-w4a16", options)
    for name, tensor in tensors.items():
        assert torch.equal(dequantized(tensor).reshape(expected[name].shape), expected[name]), name
    assert tensors["blk.0.ffn_up.weight"].tensor_type.name == "Q4_0"
    assert field(fields, "quantkit.recipe") == "gptq-w4a16"
    record = json.loads(field(fields, "quantkit.json"))
    assert record["format"] == "gguf" and record["recipe"]["scheme"]["weights"]["scale_dtype"] == "float16"


def test_the_header_describes_the_model_and_its_tokenizer(wide_model_dir, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "model.gguf"
    finalize(wide_model_dir, out, registry.resolve("gguf-q8-0"))
    fields, _ = read(out)
    config = json.loads((wide_model_dir / "config.json").read_text())
    assert field(fields, "general.architecture") == "llama"
    assert field(fields, "llama.block_count") == config["num_hidden_layers"]
    assert field(fields, "llama.embedding_length") == config["hidden_size"]
    assert field(fields, "llama.feed_forward_length") == config["intermediate_size"]
    assert field(fields, "llama.attention.head_count_kv") == config["num_key_value_heads"]
    assert field(fields, "llama.rope.dimension_count") == config["hidden_size"] // config["num_attention_heads"]
    assert field(fields, "llama.vocab_size") == config["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(wide_model_dir)
    tokens = field(fields, "tokenizer.ggml.tokens")
    assert len(tokens) == config["vocab_size"]
    assert all(tokens[i] == token for token, i in tokenizer.get_vocab().items())
    assert field(fields, "tokenizer.ggml.model") == "gpt2" and field(fields, "tokenizer.ggml.pre") == "gpt-2"
    assert field(fields, "tokenizer.ggml.bos_token_id") == tokenizer.bos_token_id
    assert field(fields, "tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert len(field(fields, "tokenizer.ggml.merges")) > 0
    types = field(fields, "tokenizer.ggml.token_type")
    assert types[tokenizer.bos_token_id] == gguf.TokenType.CONTROL and types[tokenizer.vocab_size - 1] == gguf.TokenType.NORMAL


def test_a_layer_the_block_does_not_divide_stays_in_full_precision(tiny_model_dir, tmp_path):
    """The tiny model's MLP is 176 wide: gptq-w4a16 would shrink down_proj's group to 16, which no GGML block holds;
    the layer is left in float, and reported, as llama.cpp's quantizer leaves such tensors."""
    recipe = for_format(registry.resolve("int4-weight-only"), GGUF)
    plan = {e.name: e for e in prepare(tiny_model_dir, recipe, GGUF).plan}
    down = plan["model.layers.0.mlp.down_proj"]
    assert not down.quantized and "no GGUF block holds groups of 16" in down.note
    assert plan["model.layers.0.mlp.up_proj"].quantized
    finalize(tiny_model_dir, tmp_path / "m.gguf", registry.resolve("int4-weight-only"), GGUF)
    _, tensors = read(tmp_path / "m.gguf")
    assert tensors["blk.0.ffn_down.weight"].tensor_type.name == "F32"
    assert tensors["blk.0.ffn_up.weight"].tensor_type.name == "Q4_0"


@pytest.mark.parametrize("recipe, nearest", [
    ("nvfp4-a16", "MXFP4"), ("fp8-static", "Q8_0"), ("int8-dynamic-act-int8-weight", "Q8_0"),
])
def test_a_scheme_no_type_holds_is_refused_naming_the_nearest(tiny_model_dir, tmp_path, recipe, nearest):
    with pytest.raises(FormatError, match=f"cannot be written as gguf: .*{nearest}"):
        finalize(tiny_model_dir, tmp_path / "m.gguf", registry.resolve(recipe), GGUF)
    assert list(tmp_path.iterdir()) == []


def test_the_destination_is_one_file_named_gguf(tiny_model_dir, tmp_path):
    with pytest.raises(UsageError, match="name DST with .gguf"):
        finalize(tiny_model_dir, tmp_path / "out", registry.resolve("gguf-q8-0"))
    with pytest.raises(UsageError, match="pass --format gguf"):
        finalize(tiny_model_dir, tmp_path / "out.gguf", registry.resolve("int8-weight-only"))
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(DestinationExistsError, match="is a directory"):
        finalize(tiny_model_dir, tmp_path / "dir.gguf", registry.resolve("gguf-q8-0"), overwrite=True)
    out = tmp_path / "m.gguf"
    finalize(tiny_model_dir, out, registry.resolve("gguf-q8-0"))
    with pytest.raises(DestinationExistsError, match="already exists"):
        finalize(tiny_model_dir, out, registry.resolve("gguf-q8-0"))
    before = out.stat().st_size
    finalize(tiny_model_dir, out, registry.resolve("gguf-q4-0"), overwrite=True)
    assert out.stat().st_size < before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.gguf", "m.gguf"]  # no temporary directory left


def test_an_architecture_llama_cpp_is_not_told_about_is_refused(tmp_path):
    from conftest import make_text
    from quantkit.models.tiny import build_tiny_model

    src = build_tiny_model(tmp_path / "olmo2", make_text(800), "olmo2", num_hidden_layers=1)
    with pytest.raises(FormatError, match="quantkit writes GGUF for gemma2, .* models, not .olmo2."):
        finalize(src, tmp_path / "m.gguf", registry.resolve("gguf-q8-0"))


def test_fp16_and_k_quant_scales_are_gguf_only():
    for fmt in (registry.Format.COMPRESSED_TENSORS, registry.Format.TORCHAO):
        from quantkit.export import check_supported
        for recipe in ("gguf-q4-0", "gguf-q4-k-m"):
            refused = "fp16 and k_quant scales are GGUF's grids" if fmt is registry.Format.COMPRESSED_TENSORS else ""
            with pytest.raises(FormatError, match=f"{refused}.*; use --format gguf"):
                check_supported(registry.resolve(recipe), fmt)


def test_pre_tokenizers_are_named_from_tokenizer_json():
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    assert pre_tokenizer({"pre_tokenizer": byte_level}) == "gpt-2"
    for pattern, name in PRE_TOKENIZERS.items():
        split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
        sequence = {"type": "Sequence", "pretokenizers": [split, {**byte_level, "use_regex": False}]}
        assert pre_tokenizer({"pre_tokenizer": sequence}) == name
    with pytest.raises(FormatError, match="not one quantkit can name for llama.cpp"):
        pre_tokenizer({"pre_tokenizer": {"type": "Whitespace"}})


def test_a_unigram_tokenizer_is_refused_not_written_wrong(tmp_path):
    """(SentencePiece-style BPE tokenizers are written as llama.cpp's `llama` model: test_gguf_vocab.py.)"""
    from quantkit.export.gguf_vocab import describe_tokenizer

    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram"}}))
    with pytest.raises(FormatError, match="the tokenizer is a Unigram model"):
        describe_tokenizer(None, tmp_path, 100)


def test_llama_row_order_is_llama_cpps():
    """Within each head, the rows of the rotary halves interleave (convert_hf_to_gguf's LlamaModel.permute)."""
    rows = torch.arange(8).reshape(8, 1)
    assert permute_rows(rows, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize("arch, extra", [
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, head_dim=64, norm_topk_prob=True)),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
])
def test_moe_experts_are_stacked_as_llama_cpp_reads_them(tmp_path, arch, extra):
    """An MoE block's experts go into one tensor per projection, [experts, rows, columns] (blk.N.ffn_*_exps), each
    expert's blocks those of its quantized Linear; the router stays F32; the expert count is in the header."""
    from conftest import make_text
    from quantkit.models.tiny import build_tiny_model

    src = build_tiny_model(tmp_path / arch, make_text(2000), arch, num_hidden_layers=1, hidden_size=256,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, **extra)
    out = tmp_path / "moe.gguf"
    finalize(src, out, registry.resolve("gguf-q8-0"))
    fields, tensors = read(out)
    recipe = for_format(registry.resolve("gguf-q8-0"), GGUF)
    model = quantize_model(prepare(src, recipe, GGUF), recipe)
    arch_name = field(fields, "general.architecture")
    assert field(fields, f"{arch_name}.expert_count") == 4 and field(fields, f"{arch_name}.expert_used_count") == 2
    experts = [name for name, _ in model.named_modules() if name.endswith(".experts")]
    assert len(experts) == 1
    block = model.get_submodule(experts[0])
    for projection, gguf_name in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
        tensor = tensors[f"blk.0.{gguf_name}.weight"]
        assert tensor.tensor_type.name == "Q8_0"
        experts = [block.get_submodule(str(i)) for i in range(4)]
        linears = [expert.projections()[("gate", "up", "down").index(projection)] for expert in experts]
        expected = torch.stack([linear.weight.float() for linear in linears])
        assert torch.equal(dequantized(tensor).reshape(expected.shape), expected), gguf_name
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"


@pytest.mark.parametrize("spec_args, qtype", [(("int4", True), "Q4_0"), (("int4", False), "Q4_1"), (("int8", True), "Q8_0")])
def test_legacy_blocks_are_packed_a_block_of_rows_at_a_time(spec_args, qtype, monkeypatch):
    """The legacy types' codes and bytes (`gguf.pack`) come out the same whatever the block of rows they are
    worked in (`ggml_blocks.row_blocks`), and gguf decodes them to the grid's values."""
    from gguf import GGMLQuantizationType, quants

    from quantkit.export import gguf as gguf_export
    from quantkit.grids import ggml_blocks
    from quantkit.grids import quantize_weight
    from quantkit.grids.schemes import Granularity, QDtype, WeightSpec

    weight = (torch.randn(9, 128, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    spec = WeightSpec(QDtype(spec_args[0]), Granularity.GROUP, 32, symmetric=spec_args[1], scale_dtype=ScaleDtype.FLOAT16)
    qweight = quantize_weight(weight, spec)
    values = qweight.dequantize(torch.bfloat16)
    kind, whole = gguf_export.pack(values, qweight.qparams)
    assert kind.name == qtype
    monkeypatch.setattr(ggml_blocks, "ROW_BLOCK_ELEMENTS", 2 * 128)
    assert np.array_equal(gguf_export.pack(values, qweight.qparams)[1], whole)
    decoded = quants.dequantize(whole, GGMLQuantizationType[qtype]).reshape(9, 128)
    assert torch.equal(torch.from_numpy(decoded).float(), qweight.dequantize(torch.float32))


FLOAT_TYPES = ("F32", "F16", "BF16")


def recorded_types(path) -> tuple[dict[str, str], dict[str, str | None]]:
    """(GGML type of each tensor the file holds, by llama.cpp's name; the type its embedded quantkit.json records
    for each: a quantized Linear's file type is its plan's, so recorded as 'quantized'; a tensor the format quantizes
    itself, its recorded type; a full-precision one, None)."""
    fields, tensors = read(path)
    info = json.loads(field(fields, "quantkit.json"))
    coverage = info["modules"]["coverage"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    recorded = {f"{module}.weight": "quantized" for module in info["modules"]["quantized"]}
    recorded.update({t["tensor"]: t["type"] for t in coverage.get("quantized_by_format", [])})
    recorded.update({t["tensor"]: None for t in coverage["full_precision"]})
    return ({name: t.tensor_type.name for name, t in tensors.items()},
            {names.get_name(key, try_suffixes=(".weight", ".bias")): kind for key, kind in recorded.items()})


@pytest.mark.parametrize("recipe, tied", [("gguf-q4-k-m", False), ("gguf-q8-0", False), ("gguf-q4-0", False),
                                          ("rtn-Q4_K", True), ("gguf-q4-k-m", True)])
def test_the_recorded_coverage_is_the_files_tensor_types(k_model_dir, text_file, tmp_path_factory, tmp_path, recipe, tied):
    """quantkit.json's coverage (which the finalize summary prints) agrees with the file, tensor by tensor: every
    tensor the file holds in a quantized type is recorded quantized (a mixture's token embedding, Q4_K, and a tied
    one, in lm_head's type where lm_head is quantized, else the mixture's output type, with that type), every float one as full precision
    (gguf-q8-0 / gguf-q4-0: the embedding and the ignored lm_head)."""
    from conftest import make_text
    from quantkit.models.tiny import build_tiny_llama

    src = k_model_dir
    if tied:
        src = build_tiny_llama(tmp_path_factory.mktemp("models") / "k-llama-tied", make_text(3000), hidden_size=256,
                               intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                               tie_word_embeddings=True)
    resolved = k_recipe("Q4_K", ignore=[]) if recipe == "rtn-Q4_K" else registry.resolve(recipe)
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32) if resolved.needs_samples else None
    finalize(src, tmp_path / "m.gguf", resolved, calibration=options)
    held, recorded = recorded_types(tmp_path / "m.gguf")
    assert set(recorded) - set(held) == ({"output.weight"} if tied else set())  # tied: llama.cpp reads token_embd
    assert set(held) <= set(recorded)
    for name, kind in held.items():
        if kind in FLOAT_TYPES:
            assert recorded[name] is None, f"{name}: {kind} in the file, recorded as {recorded[name]}"
        else:
            assert recorded[name] in ("quantized", kind), f"{name}: {kind} in the file, recorded as {recorded[name]}"
    embedding = {("gguf-q4-k-m", False): "Q4_K", ("gguf-q8-0", False): "F32", ("gguf-q4-0", False): "F32",
                 ("rtn-Q4_K", True): "Q4_K", ("gguf-q4-k-m", True): "Q6_K"}[recipe, tied]
    assert held["token_embd.weight"] == embedding
    assert ("output.weight" in held) is not tied


def test_the_quantized_tensors_outside_the_plan_are_the_embeddings_the_writer_quantizes():
    """`quantized_tensors` names the token embedding where the writer quantizes it: a mixture's base type, a tied
    one in a quantized lm_head's type (the mixture's output type, Q6_K, else the recipe's); else nothing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.export import gguf as gguf_export
    from quantkit.quant.plan import plan_model

    def stored(recipe, width=256, **config):
        config = AutoConfig.for_model("llama", hidden_size=width, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100, **config)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        recipe = for_format(recipe, GGUF)
        plan = gguf_export.adapt_plan(plan_model(skeleton, recipe), recipe, config)
        return gguf_export.quantized_tensors(skeleton, plan, recipe)

    assert stored(registry.resolve("gguf-q4-k-m")) == {"model.embed_tokens.weight": "Q4_K"}
    assert stored(registry.resolve("gguf-q2-k")) == {"model.embed_tokens.weight": "Q2_K"}
    assert stored(registry.resolve("gguf-q4-k-m"), tie_word_embeddings=True) == {"model.embed_tokens.weight": "Q6_K"}
    assert stored(k_recipe("Q4_K", ignore=[]), tie_word_embeddings=True) == {"model.embed_tokens.weight": "Q4_K"}
    assert stored(k_recipe("Q4_K"), tie_word_embeddings=True) == stored(k_recipe("Q4_K", ignore=[])) == {}
    assert stored(registry.resolve("gguf-q8-0")) == stored(registry.resolve("gguf-q8-0"), tie_word_embeddings=True) == {}
    assert stored(registry.resolve("gguf-q4-k-m"), width=128) == {}  # rows not whole super-blocks: left float


@pytest.mark.parametrize("recipe, qtype", [("gguf-iq4-nl", "IQ4_NL"), ("gguf-iq4-xs", "IQ4_XS")] + [
    (f"gguf-{name.lower().replace('_', '-')}", name) for name in ("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")])
def test_i_quants_are_llama_cpps_grids_in_the_file(k_model_dir, text_file, tmp_path, recipe, qtype):
    """IQ4_NL by llama.cpp's own search (round to nearest), IQ4_XS and the codebook types by GPTQ on their grids: the
    file dequantizes, in gguf's own dequantization, to the quantized model exactly, every Linear in the type (most of
    them, for the recipes that are llama.cpp's named mixtures: IQ3_XXS, IQ2_XXS, IQ1_M)."""
    from collections import Counter

    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    out = tmp_path / "model.gguf"
    finalize(k_model_dir, out, registry.resolve(recipe), calibration=options)
    fields, tensors = read(out)
    expected, _ = expected_tensors(k_model_dir, recipe, options)
    for name, tensor in tensors.items():
        assert torch.equal(dequantized(tensor).reshape(expected[name].shape), expected[name]), name
    linears = [t for name, t in tensors.items() if name.startswith("blk.") and not name.endswith("norm.weight")]
    kinds = Counter(t.tensor_type.name for t in linears)
    assert linears and kinds.most_common(1)[0][0] == qtype, kinds
    if registry.resolve(recipe).mixture is None:
        assert set(kinds) == {qtype}, kinds
    assert field(fields, "general.file_type") == gguf.LlamaFileType[f"MOSTLY_{qtype}"]


def test_iq4_xs_falls_back_to_iq4_nl_where_rows_are_not_whole_super_blocks(wide_model_dir, tmp_path):
    """As llama.cpp's tensor_type_fallback: IQ4_XS on a 128-wide input is IQ4_NL, reported."""
    out = tmp_path / "model.gguf"
    recipe = registry.parse_recipe("rtn-iq4-xs", {"scheme": {"weights": {
        "dtype": "iq4_nl", "granularity": "group", "group_size": 32, "scale_dtype": "k_quant"}}, "format": "gguf",
        "on_indivisible": "skip"})
    result = finalize(wide_model_dir, out, recipe)
    _, tensors = read(out)
    expected, _ = expected_tensors(wide_model_dir, recipe)
    for name, tensor in tensors.items():
        assert torch.equal(dequantized(tensor).reshape(expected[name].shape), expected[name]), name
    linears = {n: t for n, t in tensors.items() if n.startswith("blk.") and "norm" not in n}
    assert {n: t.tensor_type.name for n, t in linears.items()} == {
        n: "IQ4_XS" if int(t.shape[0]) % 256 == 0 else "IQ4_NL" for n, t in linears.items()}  # shape[0]: the inputs
    assert "IQ4_NL" in {t.tensor_type.name for t in linears.values()}
    assert any("IQ4_XS -> IQ4_NL" in (e.note or "") for e in result.plan)


def test_tensor_type_overrides_give_each_tensor_its_type(k_model_dir, text_file, tmp_path):
    """--tensor-type on a mixture calibrated by GPTQ: the last match wins, on quantkit's or GGUF's names, over
    the mixture's types; `ignore`d lm_head and the embedding take theirs too; `float` leaves a Linear in full
    precision; the file dequantizes to the in-memory quantized model exactly."""
    recipe = registry.with_tensor_types(registry.resolve("gguf-q4-k-m"), [
        "ffn_down=Q8_0", r"^blk\.1\.ffn_down$=q5_k", "layers.0.self_attn.q_proj=iq4_xs", "k_proj=float",
        "^output$=q5_k", "token_embd=q2_k"])
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    out = tmp_path / "mixed.gguf"
    finalize(k_model_dir, out, recipe, calibration=options)
    _, tensors = read(out)
    types = {name: t.tensor_type.name for name, t in tensors.items()}
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(2)] == ["Q8_0", "Q5_K"]
    assert types["blk.0.attn_q.weight"] == "IQ4_XS" and types["blk.1.attn_q.weight"] == "Q4_K"
    assert types["blk.0.attn_k.weight"] == "F32" and types["output.weight"] == "Q5_K" and types["token_embd.weight"] == "Q2_K"
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(2)] == ["Q4_K", "Q6_K"]  # the mixture's, no override
    expected, _ = expected_tensors(k_model_dir, recipe, options)
    for name, tensor in tensors.items():
        assert torch.equal(dequantized(tensor).reshape(expected[name].shape), expected[name]), name


def test_tensor_types_matching_nothing_are_noted_and_other_formats_refuse_them(tiny_model_dir):
    recipe = registry.with_tensor_types(registry.resolve("gguf-q4-0"), ["ffn_dwn=q8_0"])
    prepared = prepare(tiny_model_dir, recipe, GGUF)
    assert any("ffn_dwn=Q8_0 matches no tensor" in note for note in prepared.coverage["notes"])
    with pytest.raises(UsageError, match="use --format gguf"):
        prepare(tiny_model_dir, recipe, registry.Format.COMPRESSED_TENSORS)


def test_a_token_embedding_override_outside_the_k_types_is_refused(k_model_dir):
    recipe = registry.with_tensor_types(registry.resolve("gguf-q4-0"), ["token_embd=q4_0"])
    with pytest.raises(FormatError, match="token_embd takes a K type"):
        prepare(k_model_dir, recipe, GGUF)


# ---- llama.cpp's other K mixtures, and MXFP4


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory):
    """A tiny float32 Llama of 8 layers (n/8 = 1), 4 query heads on one KV head (GQA 4), K super-block widths."""
    from conftest import make_text
    from quantkit.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "deep-llama", make_text(3000), hidden_size=256,
                            intermediate_size=512, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=8)


LINEAR_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def eight_layer_types(base: str, **rules: list[str]) -> dict[str, str]:
    """tensor name -> type of the 8-layer model: `base` everywhere but the roles `rules` lists per layer, output Q6_K."""
    types = {f"blk.{i}.{role}.weight": rules.get(role, [base] * 8)[i] for i in range(8) for role in LINEAR_ROLES}
    return {**types, "token_embd.weight": base, "output.weight": "Q6_K"}


MIXTURE_FILES = {  # recipe -> (its file type, every quantized tensor's type on the 8-layer GQA-4 model)
    "gguf-q2-k-s": ("Q2_K_S", eight_layer_types("Q2_K", attn_v=["Q4_K"] * 8, ffn_down=["Q4_K"] + ["Q2_K"] * 7)),
    "gguf-q3-k-s": ("Q3_K_S", eight_layer_types("Q3_K")),
    "gguf-q3-k-l": ("Q3_K_L", eight_layer_types("Q3_K", attn_v=["Q5_K"] * 8, ffn_down=["Q5_K"] * 8,
                                                attn_output=["Q5_K"] * 8)),
    "gguf-q4-k-s": ("Q4_K_S", eight_layer_types("Q4_K", attn_v=["Q5_K"] * 4 + ["Q4_K"] * 4,
                                                ffn_down=["Q5_K"] + ["Q4_K"] * 7)),
    "gguf-q5-k-s": ("Q5_K_S", eight_layer_types("Q5_K")),
    "gguf-q6-k": ("Q6_K", eight_layer_types("Q6_K")),
    "gguf-mxfp4": ("MXFP4_MOE", {**eight_layer_types("MXFP4"), "token_embd.weight": "Q8_0", "output.weight": "Q8_0"}),
    "gguf-iq2-m": ("IQ2_M", {**eight_layer_types("IQ2_S", attn_v=["Q4_K"] * 8, ffn_down=["IQ3_S"] + ["IQ2_S"] * 7,
                                                 attn_output=["IQ3_S"] * 8),
                             "token_embd.weight": "IQ3_S", "output.weight": "Q5_K"}),
    "gguf-iq3-m": ("IQ3_M", eight_layer_types("IQ3_S", attn_v=["Q4_K"] * 8, ffn_down=["Q4_K"] + ["IQ3_S"] * 7,
                                              attn_output=["Q4_K"] * 8)),
}


@pytest.mark.parametrize("recipe", list(MIXTURE_FILES))
def test_each_mixture_writes_llama_cpps_types(deep_model_dir, text_file, tmp_path, recipe):
    """Each recipe's file, read back by gguf's GGUFReader, holds llama.cpp's type for every tensor (GPTQ-calibrated
    where the recipe calibrates) and llama.cpp's file type."""
    options = CalibrationOptions(data=str(text_file), num_samples=2, seq_len=32)
    out = tmp_path / "model.gguf"
    finalize(deep_model_dir, out, registry.resolve(recipe), calibration=options, threads=1)
    fields, tensors = read(out)
    file_type, expected = MIXTURE_FILES[recipe]
    assert {name: t.tensor_type.name for name, t in tensors.items() if not name.endswith("norm.weight")} == expected
    assert field(fields, "general.file_type") == gguf.LlamaFileType[f"MOSTLY_{file_type}"]


def test_mxfp4_is_bit_for_bit_the_quantized_model(deep_model_dir, tmp_path):
    """gguf-mxfp4 on a dense model: every MXFP4 tensor of the file, dequantized by gguf's own MXFP4 code, equals the
    in-memory quantized model's exactly (its MXFP4 grid, compressed-tensors' scales). MX weights make the artifact
    bfloat16 (`WeightSpec.sixteen_bit`), which holds FP4 x 2^k exactly but not Q8_0's d x q: the Q8_0 output and
    embedding equal the model's to bfloat16's rounding, which is the model's own dtype."""
    out = tmp_path / "mxfp4.gguf"
    finalize(deep_model_dir, out, registry.resolve("gguf-mxfp4"))
    _, tensors = read(out)
    expected, _ = expected_tensors(deep_model_dir, "gguf-mxfp4")
    assert set(tensors) == set(expected)
    kinds = {name: tensor.tensor_type.name for name, tensor in tensors.items()}
    for name, tensor in tensors.items():
        found = dequantized(tensor).reshape(expected[name].shape)
        if kinds[name] == "Q8_0":
            found = found.to(torch.bfloat16).float()
        assert torch.equal(found, expected[name]), name
    assert sum(kind == "MXFP4" for kind in kinds.values()) == 7 * 8 and kinds["output.weight"] == "Q8_0"


@pytest.mark.parametrize("recipe", ["gguf-q3-k-l", "rtn-iq3-m"])
def test_a_mixture_with_new_rules_is_bit_for_bit_the_quantized_model(deep_model_dir, k_model_dir, text_file, tmp_path,
                                                                    recipe):
    """gguf-q3-k-l calibrated by GPTQ (Q3_K, Q5_K, Q6_K; the embedding Q3_K by llama.cpp's rounding), and IQ3_M
    rounded to nearest on the 2-layer model (IQ3_S, Q4_K, Q6_K; the embedding IQ3_S by the i-quant grid's): every
    tensor of the file equals the in-memory model's."""
    options = CalibrationOptions(data=str(text_file), num_samples=2, seq_len=32)
    src, found = deep_model_dir, registry.resolve("gguf-q3-k-l")
    if recipe == "rtn-iq3-m":
        src, found = k_model_dir, registry.parse_recipe(recipe, {**registry.resolve("gguf-iq3-m").to_file(),
                                                                 "algorithm": {"name": "rtn"}})
    out = tmp_path / "mixture.gguf"
    finalize(src, out, found, calibration=options)
    _, tensors = read(out)
    assert {"Q3_K", "IQ3_S"} & {t.tensor_type.name for t in tensors.values()}
    expected, _ = expected_tensors(src, found, options)
    for name, tensor in tensors.items():
        assert torch.equal(dequantized(tensor).reshape(expected[name].shape), expected[name]), name


def test_mxfp4_moe_puts_the_experts_in_mxfp4_and_the_rest_in_q8_0(tmp_path):
    """A Qwen3-MoE in gguf-mxfp4: the stacked experts MXFP4, attention, lm_head and the embedding Q8_0, the router
    F32, as llama-quantize MXFP4_MOE writes it; each expert's blocks dequantize (gguf's MXFP4) to its Linear."""
    from conftest import make_text
    from quantkit.models.tiny import build_tiny_model

    src = build_tiny_model(tmp_path / "moe", make_text(2000), "qwen3_moe", num_hidden_layers=1, hidden_size=256,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=256, head_dim=64, norm_topk_prob=True)
    out = tmp_path / "moe.gguf"
    finalize(src, out, registry.resolve("gguf-mxfp4"))
    fields, tensors = read(out)
    types = {name: t.tensor_type.name for name, t in tensors.items() if "norm" not in name}
    assert types == {"token_embd.weight": "Q8_0", "output.weight": "Q8_0", "blk.0.ffn_gate_inp.weight": "F32",
                     **{f"blk.0.{r}.weight": "Q8_0" for r in ("attn_q", "attn_k", "attn_v", "attn_output")},
                     **{f"blk.0.ffn_{p}_exps.weight": "MXFP4" for p in ("gate", "up", "down")}}
    assert field(fields, "general.file_type") == gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    recipe = for_format(registry.resolve("gguf-mxfp4"), GGUF)
    model = quantize_model(prepare(src, recipe, GGUF), recipe)
    block = model.get_submodule(next(name for name, _ in model.named_modules() if name.endswith(".experts")))
    for index, projection in enumerate(("gate", "up", "down")):
        expected = torch.stack([block.get_submodule(str(i)).projections()[index].weight.float() for i in range(4)])
        tensor = tensors[f"blk.0.ffn_{projection}_exps.weight"]
        assert torch.equal(dequantized(tensor).reshape(expected.shape), expected), projection


def test_mxfp4_is_a_tensor_type_and_mxfp4_recipes_reach_gguf(k_model_dir, tmp_path):
    """`--tensor-type ffn_down=mxfp4` on Q4_0, and mxfp4-a16 with --format gguf (every Linear MXFP4, no mixture)."""
    recipe = registry.with_tensor_types(registry.resolve("gguf-q4-0"), ["ffn_down=mxfp4"])
    finalize(k_model_dir, tmp_path / "a.gguf", recipe)
    _, tensors = read(tmp_path / "a.gguf")
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == "MXFP4"
    assert tensors["blk.1.ffn_up.weight"].tensor_type.name == "Q4_0"
    finalize(k_model_dir, tmp_path / "b.gguf", registry.resolve("mxfp4-a16"), GGUF)
    _, tensors = read(tmp_path / "b.gguf")
    assert {t.tensor_type.name for name, t in tensors.items() if name.startswith("blk.") and "norm" not in name} == {"MXFP4"}


def test_q2_k_s_without_calibration_data_is_refused_in_one_line(k_model_dir, tmp_path):
    """llama.cpp refuses Q2_K_S without an importance matrix: the calibrated recipe without --calib-data, and a
    round-to-nearest recipe on the mixture, are refused before any work, saying to pass --calib-data."""
    with pytest.raises(UsageError, match="pass --calib-data") as raised:
        finalize(k_model_dir, tmp_path / "a.gguf", registry.resolve("gguf-q2-k-s"))
    assert "\n" not in str(raised.value)
    rtn = registry.parse_recipe("rtn-q2-k-s", {**registry.resolve("gguf-q2-k-s").to_file(), "algorithm": {"name": "rtn"}})
    with pytest.raises(UsageError, match="Q2_K_S needs an importance matrix.*pass --calib-data") as raised:
        finalize(k_model_dir, tmp_path / "b.gguf", rtn, calibration=CalibrationOptions(data="unused.txt"))
    assert "\n" not in str(raised.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_blocks_hold_the_grid_bit_for_bit(dtype):
    """`pack` on quantkit's MXFP4 grid (compressed-tensors' scales), over block scales from 2^-120 to 2^100 and an
    all-zero block: gguf's MXFP4 dequantization of the bytes is the in-memory dequantized weight exactly."""
    from quantkit.export.gguf import pack
    from quantkit.grids import quantize_weight
    from quantkit.quant import gguf_types

    torch.manual_seed(0)
    weight = torch.randn(8, 512) * torch.exp2(torch.arange(-120, 100, 220 / 16).floor()).repeat_interleave(32)
    weight[3, 64:96] = 0
    quantized = quantize_weight(weight.to(dtype), gguf_types.spec("mxfp4"))
    values = quantized.dequantize(dtype)
    qtype, data = pack(values, quantized.qparams)
    assert qtype.name == "MXFP4" and data.shape == (8, 512 // 32 * 17)
    assert torch.equal(torch.from_numpy(gguf.quants.dequantize(data, qtype)), values.float())
