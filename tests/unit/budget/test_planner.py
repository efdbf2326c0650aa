"""`finalize --target-bpw`: a GGUF type per tensor, from sensitivity measured on the calibration data, meeting the
average bits per weight the file then has."""

import json
import re

import numpy as np
import pytest
import yaml

gguf = pytest.importorskip("gguf")

from quantkit.budget import planner, sensitivity  # noqa: E402
from quantkit.errors import UsageError  # noqa: E402
from quantkit.finalization.finalize import CalibrationOptions, finalize  # noqa: E402
from quantkit.quant import gguf_types, registry  # noqa: E402


@pytest.fixture(scope="module")
def k_model_dir(tmp_path_factory):
    """A tiny float32 Llama whose Linears' inputs are whole K super-blocks (256, 512)."""
    from conftest import make_text
    from quantkit.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "k-llama", make_text(3000), hidden_size=256,
                            intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


# gguf-q4-k-m's recipe rounding to nearest: the plans' files are written in seconds
RECIPE = registry.parse_recipe("k-rtn", {**registry.resolve("gguf-q4-k-m").to_file(), "algorithm": {"name": "rtn"}})


@pytest.fixture(scope="module")
def options(text_file):
    return CalibrationOptions(data=str(text_file), num_samples=8, seq_len=64)


@pytest.fixture(scope="module")
def plans(k_model_dir, options):
    """The plans at 3 and 5 bits per weight, measured once."""
    return {target: planner.plan(k_model_dir, RECIPE, target, options) for target in (3.0, 5.0)}


def file_bits(path) -> tuple[float, dict[str, str]]:
    tensors = gguf.GGUFReader(path).tensors
    size, count = sum(int(t.n_bytes) for t in tensors), sum(int(np.prod(t.shape)) for t in tensors)
    return size * 8 / count, {t.name: t.tensor_type.name for t in tensors}


def test_the_sensitivity_falls_with_the_bits(plans):
    """Every tensor's estimated error is lower in a wider type; every role's gain was measured, positive."""
    measured = plans[5.0].measured
    assert set(measured.errors) == {*(f"model.layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
        "mlp.down_proj")), "lm_head", "token_embd"}
    for name, by_type in measured.errors.items():
        ordered = [by_type[t] for t in sorted(by_type, key=gguf_types.bits_per_weight)]
        assert ordered == sorted(ordered, reverse=True) and ordered[0] > ordered[-1], name
    assert all(kl > 0 for kl in measured.role_kl.values()) and all(g > 0 for g in measured.gains.values())
    assert measured.tokens == 8 * 64


@pytest.mark.parametrize("target", [3.0, 5.0])
def test_the_file_has_the_planned_bits_per_weight(k_model_dir, options, plans, tmp_path, target):
    """The plan meets the target (within one tensor's step on this tiny model); the GGUF file's bits per weight,
    every tensor counted, are the plan's exactly, and each tensor has its planned type."""
    plan = plans[target]
    assert plan.bits_per_weight <= target and target - plan.bits_per_weight < 0.05
    out = tmp_path / "plan.gguf"
    finalize(k_model_dir, out, plan.recipe, calibration=options)
    bits, types = file_bits(out)
    assert bits == pytest.approx(plan.bits_per_weight, abs=1e-9)
    assert types["blk.1.ffn_down.weight"] == plan.types["model.layers.1.mlp.down_proj"]
    assert types["token_embd.weight"] == plan.types["token_embd"] and types["output.weight"] == plan.types["lm_head"]
    assert len(set(plan.types.values())) > 1  # a mixture, not one type


def test_a_wider_budget_estimates_less_error(plans):
    assert plans[5.0].estimated_kl < plans[3.0].estimated_kl
    assert plans[5.0].measured.errors == plans[3.0].measured.errors  # the same measurement: deterministic


def test_overrides_are_fixed_and_counted_first(k_model_dir, options):
    recipe = registry.with_tensor_types(RECIPE, ["ffn_down=q8_0"])
    plan = planner.plan(k_model_dir, recipe, 4.0, options, ("Q2_K", "Q4_K", "Q6_K"))
    assert not any("down_proj" in name for name in plan.types)
    assert plan.recipe.tensor_types[0] == "ffn_down=Q8_0" and plan.bits_per_weight <= 4.0


def test_a_target_below_the_smallest_candidates_is_one_line(k_model_dir, options):
    with pytest.raises(UsageError, match="below what the candidates can reach here"):
        planner.plan(k_model_dir, RECIPE, 2.0, options, ("Q4_K", "Q8_0"))
    with pytest.raises(UsageError, match="measures each tensor.s sensitivity on data: pass --calib-data"):
        planner.plan(k_model_dir, RECIPE, 4.0, CalibrationOptions())


def test_a_k_type_falls_back_where_a_tensors_rows_are_not_whole_super_blocks(tmp_path, options):
    """An MLP of width 384 (a Qwen3-MoE expert's, here dense): ffn_down's rows are not whole 256-weight super-blocks,
    so a K candidate is its llama.cpp fallback there (Q2_K / Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0),
    as the file writes it, instead of Q8_0 alone: a low target is reached, and the file holds the plan's types."""
    from conftest import make_text
    from quantkit.models.tiny import build_tiny_llama

    src = build_tiny_llama(tmp_path / "w384", make_text(3000), hidden_size=256, intermediate_size=384,
                           num_attention_heads=4, num_key_value_heads=2)
    plan = planner.plan(src, RECIPE, 3.0, options)
    downs = {name: kind for name, kind in plan.types.items() if name.endswith("down_proj")}
    assert downs and set(downs.values()) <= {"Q4_0", "Q5_0", "Q5_1", "Q8_0"} and "Q8_0" not in downs.values()
    out = tmp_path / "plan.gguf"
    finalize(src, out, plan.recipe, calibration=options)
    bits, types = file_bits(out)
    assert bits == pytest.approx(plan.bits_per_weight, abs=1e-9)
    assert {types[f"blk.{n.split('.')[2]}.ffn_down.weight"] for n in downs} == set(downs.values())


def test_the_saved_plan_repeats_the_file_without_measuring(k_model_dir, options, tmp_path, monkeypatch):
    """finalize --target-bpw --save-plan, then -q plan.yaml: the same tensors, byte for byte, and no measuring."""
    from typer.testing import CliRunner

    from quantkit.cli.main import app

    (tmp_path / "k-rtn.yaml").write_text(yaml.safe_dump(RECIPE.to_file()))
    data = ["--calib-data", options.data, "--num-samples", "8", "--seq-len", "64"]
    first = CliRunner().invoke(app, ["finalize", str(k_model_dir), str(tmp_path / "a.gguf"), "-q", str(tmp_path / "k-rtn.yaml"),
                                     "--target-bpw", "4.0",
                                     "--candidates", "q3_k,q4_k,q6_k",
                                     "--save-plan", str(tmp_path / "plan.yaml"), "--report", str(tmp_path / "plan.html"),
                                     "--quiet", *data])
    assert first.exit_code == 0, first.output
    assert "model.layers.1.mlp.down_proj" in (tmp_path / "plan.html").read_text()
    assert yaml.safe_load((tmp_path / "plan.yaml").read_text())["tensor_types"]
    monkeypatch.setattr(sensitivity, "measure", lambda *a, **k: pytest.fail("measured again"))
    again = CliRunner().invoke(app, ["finalize", str(k_model_dir), str(tmp_path / "b.gguf"), "-q",
                                     str(tmp_path / "plan.yaml"), "--quiet", *data])
    assert again.exit_code == 0, again.output
    a, b = gguf.GGUFReader(tmp_path / "a.gguf").tensors, gguf.GGUFReader(tmp_path / "b.gguf").tensors
    assert [t.name for t in a] == [t.name for t in b]
    assert all(t.tensor_type == u.tensor_type and np.array_equal(t.data, u.data) for t, u in zip(a, b))


@pytest.mark.parametrize("args, message", [
    (["-q", "int4-weight-only", "--format", "torchao", "--target-bpw", "4"], "a torchao artifact takes one scheme"),
    (["-q", "int4-weight-only", "--target-bpw", "4", "--candidates", "q4_k"], "not a candidate for compressed-tensors"),
    (["--target-bpw", "0.5"], "between 1 and 32"),
    (["--target-bpw", "4", "--candidates", "q4_k,q9"], "neither a GGML type"),
    (["-q", "gguf-q4-0", "--candidates", "q4_k"], "go with --target-bpw"),
    (["--target-bpw", "4", "--report", "plan.txt"], "named .html"),
    (["--target-bpw", "4", "--target-size", "1MB"], "not both"),
    (["--target-size", "lots"], "--target-size"),
    (["--target-bpw", "4", "--save-plan", "plan.txt"], "is named .yaml"),
    ([], "pass -q RECIPE"),
])
def test_bad_budget_options_are_one_line(tiny_model_dir, tmp_path, args, message):
    from typer.testing import CliRunner

    from quantkit.cli.main import app

    result = CliRunner().invoke(app, ["finalize", str(tiny_model_dir), str(tmp_path / "x.gguf"), *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x.gguf").exists()


def test_an_moe_layers_experts_take_one_type_each_projection(tmp_path, text_file):
    """Qwen3-MoE: the experts of a projection are one decision (GGUF stacks them), named as GGUF does; the file
    holds each stack in its planned type and meets the plan's size; a --tensor-type splitting a stack is refused."""
    from conftest import make_text
    from quantkit.errors import FormatError
    from quantkit.finalization.finalize import prepare
    from quantkit.models.tiny import build_tiny_model

    src = build_tiny_model(tmp_path / "moe", make_text(2000), "qwen3_moe", num_hidden_layers=1, hidden_size=256,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=256, head_dim=64, norm_topk_prob=True)
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    plan = planner.plan(src, RECIPE, 4.0, options, ("Q2_K", "Q4_K", "Q8_0"))
    assert {"blk.0.ffn_gate_exps", "blk.0.ffn_up_exps", "blk.0.ffn_down_exps"} <= set(plan.types)
    assert not any(".experts." in name for name in plan.types)
    out = tmp_path / "moe.gguf"
    finalize(src, out, plan.recipe, calibration=options)
    bits, types = file_bits(out)
    assert bits == pytest.approx(plan.bits_per_weight, abs=1e-9)
    assert types["blk.0.ffn_down_exps.weight"] == plan.types["blk.0.ffn_down_exps"]
    gptq = registry.parse_recipe("k-gptq", {**RECIPE.to_file(), "algorithm": {"name": "gptq"}})
    discounts = planner.plan(src, gptq, 4.0, options, ("Q2_K", "Q4_K", "Q8_0")).measured.discounts
    assert {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "attn_q", "output"} <= set(discounts)  # experts too
    split = registry.with_tensor_types(RECIPE, [r"experts\.0\.down_proj=q8_0"])
    with pytest.raises(FormatError, match="blk.0.ffn_down_exps: its experts would take different types"):
        prepare(src, split, registry.Format.GGUF)


def test_an_moe_plan_in_float16_counts_the_routers_as_the_file_stores_them(tmp_path, text_file):
    """GGUF keeps an MoE router (ffn_gate_inp) in F32 whatever the dtype: a float16 plan counts it so, and the file
    of a float16 run has the plan's bits per weight (counted at 2 bytes, a plan overshot its target by the routers'
    second half: 32 KiB on a 4-layer model of 8 experts and hidden 512)."""
    from conftest import make_text
    from quantkit.models.tiny import build_tiny_model

    src = build_tiny_model(tmp_path / "moe", make_text(2000), "qwen3_moe", num_hidden_layers=1, hidden_size=256,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=256, head_dim=64, norm_topk_prob=True)
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    plan = planner.plan(src, RECIPE, 4.0, options, ("Q2_K", "Q4_K", "Q8_0"), dtype="float16")
    out = tmp_path / "moe.gguf"
    finalize(src, out, plan.recipe, dtype="float16", calibration=options)
    bits, types = file_bits(out)
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert bits == pytest.approx(plan.bits_per_weight, abs=1e-9)


def test_a_target_size_is_the_files_tensors(k_model_dir, options, tmp_path):
    """--target-size: the tensors' bytes at most the size, within one tensor's step."""
    size = 700_000
    plan = planner.plan(k_model_dir, RECIPE, None, options, ("Q2_K", "Q3_K", "Q4_K", "Q6_K"), target_bytes=size)
    assert size * 0.97 < plan.tensor_bytes <= size
    assert plan.target_bpw == pytest.approx(size * 8 / plan.parameters)


def test_a_compressed_tensors_plan_mixes_schemes_that_plain_transformers_loads(wide_model_dir, options, tmp_path):
    """compressed-tensors: the candidates are recipes' schemes (int4 groups, int8 channels); the artifact's tensors
    take the plan's bytes exactly, its config holds one group per scheme, and plain transformers loads it to the
    logits of quantkit's in-memory quantized model."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from quantkit.finalization.finalize import prepare, quantize_model

    recipe = registry.resolve("int4-weight-only")
    plan = planner.plan(wide_model_dir, recipe, 13.0, options, ("int4-weight-only", "int8-weight-only"))
    assert set(plan.types.values()) == {"int4-weight-only", "int8-weight-only"} and plan.bits_per_weight <= 13.0
    out = tmp_path / "mixed"
    finalize(wide_model_dir, out, plan.recipe, calibration=options)
    stored = 0
    for path in out.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            stored += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    assert stored == plan.tensor_bytes
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert sorted(g["weights"]["num_bits"] for g in groups.values()) == [4, 8]
    eight = next(g for g in groups.values() if g["weights"]["num_bits"] == 8)
    assert set(eight["targets"]) >= {n for n, t in plan.types.items() if t == "int8-weight-only"}  # and siblings
    ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    expected = quantize_model(prepare(wide_model_dir, plan.recipe), plan.recipe)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, expected(ids).logits, atol=1e-4)


@pytest.mark.parametrize("target", [12.25, 12.75, 13.25, 13.75])
def test_a_compressed_tensors_plan_gives_vllms_fused_siblings_one_scheme(wide_model_dir, options, target):
    """vLLM runs q/k/v as one layer (qkv_proj) and gate/up as one (gate_up_proj), each of one scheme: a plan decides
    each group together, and the file's config gives its members one config group."""
    from quantkit.models.architectures import kernel_fused_groups

    plan = planner.plan(wide_model_dir, registry.resolve("int4-weight-only"), target, options,
                        ("int4-weight-only", "int8-weight-only"))
    planned = (text.rsplit("=", 1) for text in plan.recipe.tensor_types)  # ^escaped-name$=type, one per Linear
    types = {re.sub(r"\\(.)", r"\1", pattern[1:-1]): kind for pattern, kind in planned}
    linears = list(types)
    groups = [g for g in kernel_fused_groups(linears) if len(g) > 1]
    assert len(groups) == 4 and all({types[m] for m in group} == {types[group[0]]} for group in groups)
    assert set(types.values()) == {"int4-weight-only", "int8-weight-only"}


def test_the_streamed_measurement_holds_one_layer_and_measures_what_the_loaded_model_does(k_model_dir, options, plans,
                                                                                         monkeypatch):
    """The sensitivity pass reads one decoder layer at a time (a streamed model: the others stay on the meta
    device) and measures what it measures with the whole model in memory."""
    from quantkit.models.streaming import StreamedModel

    held = []
    load = StreamedModel.load

    def counting(self, module):
        load(self, module)
        held.append(sum(next(layer.parameters()).device.type != "meta" for layer in self.layers))

    monkeypatch.setattr(StreamedModel, "load", counting)
    planner.plan(k_model_dir, RECIPE, 5.0, options)
    assert len(held) == 2 and max(held) == 1  # the tiny model's two decoder layers, one at a time
    monkeypatch.setattr(StreamedModel, "load", lambda *a: pytest.fail("streamed"))
    loaded = planner.plan(k_model_dir, RECIPE, 5.0, options, in_memory=True)  # --in-memory: loaded whole
    for name, by_type in plans[5.0].measured.errors.items():
        assert loaded.measured.errors[name] == pytest.approx(by_type, rel=1e-5), name
    assert loaded.types == plans[5.0].types


def test_a_rotated_recipe_is_measured_on_the_rotated_model(k_model_dir, options, plans):
    """A recipe's fused rotations (R1 + R2) change every tensor's rounding error: the plan measures the model as
    the calibrated run will quantize it, streamed (layers rotated as they are read) or loaded whole alike."""
    rotated = registry.parse_recipe("k-rtn-rot", {**RECIPE.to_file(),
                                                  "transforms": [{"type": "hadamard", "rotations": ["R1", "R2"]}]})
    streamed = planner.plan(k_model_dir, rotated, 5.0, options)
    loaded = planner.plan(k_model_dir, rotated, 5.0, options, in_memory=True)
    unrotated = plans[5.0].measured.proxies
    for name, by_type in loaded.measured.proxies.items():
        assert streamed.measured.proxies[name] == pytest.approx(by_type, rel=1e-4), name
    changed = [name for name in unrotated if name != "token_embd"
               and streamed.measured.proxies[name]["Q4_K"] != pytest.approx(unrotated[name]["Q4_K"], rel=1e-3)]
    assert len(changed) > len(unrotated) // 2, changed


def test_a_gptq_plan_discounts_each_roles_errors_by_what_gptq_saves(k_model_dir, options, plans):
    """The recipe's GPTQ rounds through its inputs' Hessian: each Linear role's estimated errors are round to
    nearest's times GPTQ's error over rounding's (measured on the middle decoder layer and lm_head, below 1); the
    token embedding, which no calibration reaches, keeps rounding's estimate. A round-to-nearest plan has none."""
    gptq = registry.parse_recipe("k-gptq", {**RECIPE.to_file(), "algorithm": {"name": "gptq"}})
    plan = planner.plan(k_model_dir, gptq, 5.0, options)
    measured, rounded = plan.measured, plans[5.0].measured
    assert rounded.discounts == {}
    linear_roles = set(measured.gains) - {"token_embd"}
    assert set(measured.discounts) == linear_roles
    assert all(0 < d < 1 for d in measured.discounts.values()), measured.discounts
    for name, by_type in measured.errors.items():
        role = planner._role(name)
        expected = {t: measured.gains[role] * measured.discounts.get(role, 1.0) * p for t, p in measured.proxies[name].items()}
        assert by_type == pytest.approx(expected, rel=1e-9), name
    assert plan.to_dict()["sensitivity"]["discounts"] == measured.discounts
