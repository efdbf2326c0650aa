"""Fused MoE experts split into per-expert Linear modules: the same function, the checkpoint's own names, one
scheme for all experts, routers and gates in full precision, and a refusal where any of that cannot hold."""

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.errors import FormatError, UnsupportedModelError, UsageError
from quantkit.models import moe
from quantkit.quant import registry
from quantkit.quant.plan import coverage, plan_model

MOE = {  # tiny configs; intermediate 96 and hidden 64 share no group size above 32
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, shared_expert_intermediate_size=64),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, head_dim=16),
}


def tiny_moe(model_type: str, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=128, experts_implementation="eager", **MOE[model_type])
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", MOE)
def test_linearized_experts_compute_what_the_fused_ones_do(model_type):
    model = tiny_moe(model_type)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits
        moe.linearize(model)
        ours = model(ids).logits
    assert len(moe.experts_modules(model)) == 2 and not [p for p in model.parameters() if p.dim() >= 3]
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type, names", [("mixtral", ("w1", "w3", "w2")),
                                               ("qwen2_moe", ("gate_proj", "up_proj", "down_proj"))])
def test_experts_take_the_checkpoints_names_and_save_as_the_fused_model_does(model_type, names, tmp_path):
    """The names come from transformers' conversion mapping: saving the per-expert model writes the very keys (and
    tensors) the fused model writes, so transformers' loader merges them back."""
    model = tiny_moe(model_type)
    model.save_pretrained(tmp_path / "fused")
    moe.linearize(model)
    assert moe.experts_modules(model)["model.layers.0.mlp.experts"].names == names
    model.save_pretrained(tmp_path / "linear")
    fused, linear = (load_file(tmp_path / d / "model.safetensors") for d in ("fused", "linear"))
    assert sorted(fused) == sorted(linear) and any(f".experts.3.{names[2]}.weight" in k for k in fused)
    assert all(torch.equal(fused[k], linear[k]) for k in fused)


def test_all_tokens_mode_sends_every_token_to_every_expert_and_keeps_the_output():
    model = moe.linearize(tiny_moe("qwen3_moe"))
    experts = model.model.layers[0].mlp.experts
    seen = []
    handles = [experts.expert(i).projections()[2].register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
               for i in range(experts.num_experts)]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        routed = model(ids).logits
        routed_seen, seen[:] = list(seen), []
        experts.all_tokens = True
        everyone = model(ids).logits
    for handle in handles:
        handle.remove()
    assert sum(routed_seen) == 32 * 2 and seen == [32] * 4  # top-2 of 4 experts; then all 32 tokens each
    torch.testing.assert_close(everyone, routed, rtol=1e-5, atol=1e-6)


def test_plan_quantizes_every_expert_with_one_group_size_and_keeps_routers_and_gates():
    model = moe.linearize(tiny_moe("qwen2_moe", "meta"))
    recipe = registry.resolve("int4-weight-only")
    plan = {e.name: e for e in plan_model(model, recipe)}
    experts = moe.expert_linears(model)
    assert len(experts) == 2 * 4 * 3 and all(plan[n].quantized for n in experts)
    assert {plan[n].scheme.weights.group_size for n in experts} == {32}  # divides 64 and 96
    assert "one group size for all MoE experts" in plan["model.layers.0.mlp.experts.0.up_proj"].note
    assert plan["model.layers.0.mlp.shared_expert.up_proj"].scheme.weights.group_size == 64  # not an expert: its own
    assert plan["model.layers.0.mlp.shared_expert_gate"].note == moe.GATE_NOTE and not plan["model.layers.0.mlp.shared_expert_gate"].quantized
    report = coverage(model, list(plan.values()))
    reasons = {k["tensor"]: k["reason"] for k in report["full_precision"]}
    assert reasons["model.layers.1.mlp.gate.weight"] == moe.GATE_NOTE  # the router (not an nn.Linear)
    assert report["linear_parameters"] - report["quantized_parameters"] == sum(
        e.in_features * e.out_features for e in plan.values() if not e.quantized)


@pytest.mark.parametrize("change", [dict(ignore=("lm_head", r"re:experts\.2\.")), dict(on_indivisible="skip")])
def test_a_recipe_that_leaves_experts_in_full_precision_is_refused(change):
    from quantkit.quant.registry import IndivisiblePolicy

    model = moe.linearize(tiny_moe("mixtral", "meta"))
    recipe = registry.resolve("int4-weight-only")
    if "on_indivisible" in change:
        change = dict(on_indivisible=IndivisiblePolicy.SKIP)
    with pytest.raises(UsageError, match=r"would leave \d+ of 24 MoE expert projections in full precision"):
        plan_model(model, replace(recipe, **change))


def test_fused_experts_of_another_layout_are_refused_not_split_wrongly():
    model = tiny_moe("mixtral", "meta")
    model.model.layers[1].mlp.experts.is_transposed = True  # [in, out] weights: not what LinearExperts computes
    with pytest.raises(UnsupportedModelError, match=r"model.layers.1.mlp.experts .*cannot split.*is_transposed"):
        moe.linearize(model)


def test_a_wrong_split_is_caught_on_real_weights():
    model = tiny_moe("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    experts.forward = lambda x, i, w: torch.zeros_like(x)  # a fused forward the split cannot reproduce
    with pytest.raises(UnsupportedModelError, match="do not compute what the fused module does"):
        moe.linearize(model)


def test_experts_with_their_own_group_size_are_targeted_by_a_pattern_that_also_names_the_checkpoint():
    import re

    from quantkit.export.compressed_tensors import quantization_config

    model = moe.linearize(tiny_moe("mixtral", "meta"))
    recipe = registry.resolve("gptq-w4a16")
    plan = plan_model(model, recipe)
    config = quantization_config(plan, recipe, (tuple(moe.expert_linears(model)), moe.expert_pattern(model)))
    (pattern,) = [t for g in config.config_groups.values() for t in g.targets if t.startswith("re:")]
    for name in ("model.layers.0.mlp.experts.3.w2", "model.layers.1.block_sparse_moe.experts.0.w1"):  # ours, the checkpoint's
        assert re.match(pattern[3:], name)
    assert not re.match(pattern[3:], "model.layers.0.self_attn.o_proj")
    assert not any("experts" in t for g in config.config_groups.values() for t in g.targets if not t.startswith("re:"))


def test_moe_models_are_refused_for_torchao(tmp_path):
    from quantkit.finalization.finalize import prepare
    from quantkit.quant.registry import Format

    tiny_moe("mixtral").save_pretrained(tmp_path)
    with pytest.raises(FormatError, match="mixture-of-experts.*--format compressed-tensors"):
        prepare(tmp_path, registry.resolve("int4-weight-only"), Format.TORCHAO)


def test_checkpoint_names_follow_transformers_renamings():
    """The preflight finds the experts in the checkpoint by these names (Mixtral's block is renamed on load)."""
    model = moe.linearize(tiny_moe("mixtral", "meta"))
    names = moe.checkpoint_names(model, ["model.layers.0.mlp.experts.1.w2.weight", "model.layers.0.self_attn.q_proj.weight"])
    assert names == {"model.layers.0.mlp.experts.1.w2.weight": "model.layers.0.block_sparse_moe.experts.1.w2.weight",
                     "model.layers.0.self_attn.q_proj.weight": "model.layers.0.self_attn.q_proj.weight"}
