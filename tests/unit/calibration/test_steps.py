"""Pieces of the calibration layer steps: shared observers, the error estimate, shared Hessians, stacked GPTQ, AWQ scoring."""

import pytest
import torch
from torch import nn

from quantkit.algorithms.gptq import gptq_quantize
from quantkit.calibration.hooks import observe
from quantkit.calibration.layer import relative_error, relative_error_factored
from quantkit.calibration.steps.gptq import split_rows
from quantkit.models.architectures import shared_input_leaders
from quantkit.grids.observers import HessianObserver
from quantkit.grids import quantize_weight
from quantkit.quant.registry import resolve

SPEC = resolve("gptq-w4a16").scheme.weights  # int4, symmetric, groups of 128


class _Block(nn.Module):
    """A norm feeding three projections, and a fourth projection on their sum (like q/k/v and o)."""

    def __init__(self, width=16):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        return self.o(self.q(h) + self.k(h) * self.v(h))


def test_modules_fed_the_same_tensor_share_one_observer_counted_once():
    torch.manual_seed(0)
    block = _Block()
    inputs = [((torch.randn(2, 5, 16),), {}) for _ in range(3)]
    modules = {name: getattr(block, name) for name in "qkvo"}
    observers = observe(modules, HessianObserver, block, inputs)
    assert observers["q"] is observers["k"] is observers["v"]
    assert observers["o"] is not observers["q"]
    assert observers["q"].state["count"].item() == 3 * 2 * 5  # each batch once, not three times
    normed = torch.cat([block.norm(args[0]).reshape(-1, 16) for args, _ in inputs])
    torch.testing.assert_close(observers["k"].hessian(), 2 * normed.T @ normed / normed.shape[0])


def test_relative_error_is_the_output_error_ratio():
    torch.manual_seed(0)
    weight, x = torch.randn(64, 32), torch.randn(500, 32) * torch.linspace(0.1, 3, 32)
    qweight = quantize_weight(weight, resolve("int8-weight-only").scheme.weights)
    hessian = 2 * x.T @ x / x.shape[0]
    expected = ((weight - qweight.dequantize(torch.float32)) @ x.T).norm() / (weight @ x.T).norm()
    assert relative_error(weight, qweight, hessian) == pytest.approx(expected.item(), rel=1e-4)


@pytest.mark.parametrize("actorder", [False, True])
def test_the_error_through_gptqs_factor_is_the_error_through_the_damped_hessian(actorder):
    """GPTQ frees the Hessian once its inverse factor is made; the error is then measured through the factor: the
    same as through H + damp I, with dead inputs (H_ii = 0) left out as H leaves them out, in either column order."""
    from quantkit.algorithms.methods.gptq import GPTQArgs
    from quantkit.algorithms.gptq import inverse_hessian

    torch.manual_seed(0)
    weight, x = torch.randn(300, 96), torch.randn(500, 96) * torch.linspace(0.1, 3, 96)
    x[:, [5, 40]] = 0.0  # two dead inputs, whose weight columns would dominate the error if counted
    weight[:, [5, 40]] *= 50
    qweight = quantize_weight(weight, resolve("int8-weight-only").scheme.weights)
    hessian = (2 * x.T @ x / x.shape[0]).double()
    args = GPTQArgs(actorder=actorder)
    factor = inverse_hessian(hessian.float(), args)
    damped = hessian + args.dampening_frac * hessian.diagonal().mean() * torch.eye(96, dtype=torch.float64)
    damped[[5, 40], [5, 40]] = 0.0
    expected = relative_error(weight, qweight, damped.float())
    assert relative_error_factored(weight, qweight, factor) == pytest.approx(expected, rel=1e-4)
    assert relative_error_factored(weight, qweight, factor) == pytest.approx(relative_error(weight, qweight, hessian.float()), rel=0.05)


def test_relative_error_estimate_on_many_rows_is_close():
    torch.manual_seed(0)
    weight, x = torch.randn(2048, 64), torch.randn(500, 64)
    qweight = quantize_weight(weight, resolve("int8-weight-only").scheme.weights)
    hessian = 2 * x.T @ x / x.shape[0]
    exact = ((weight - qweight.dequantize(torch.float32)) @ x.T).norm() / (weight @ x.T).norm()
    assert relative_error(weight, qweight, hessian) == pytest.approx(exact.item(), rel=0.05)


def test_stacked_gptq_equals_one_run_per_module():
    """GPTQ rows are independent given the Hessian: q/k/v quantized together give each module's own result."""
    torch.manual_seed(0)
    weights = [torch.randn(rows, 256) for rows in (96, 32, 32)]
    x = torch.randn(1024, 256) * torch.linspace(0.2, 2, 256)
    hessian = 2 * x.T @ x / x.shape[0]
    stacked = split_rows(gptq_quantize(torch.cat(weights), hessian, SPEC), [96, 32, 32])
    for weight, part in zip(weights, stacked):
        alone = gptq_quantize(weight, hessian, SPEC)
        assert torch.equal(part.scale, alone.scale)
        # only float summation order can differ (matmuls of other shapes); it flips at most a rare near-tie
        assert (part.qdata != alone.qdata).any(dim=1).sum() <= 1


def test_modules_reading_one_input_share_a_hessian():
    names = [f"layers.0.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    leaders = shared_input_leaders(names)
    assert leaders["layers.0.self_attn.v_proj"] == leaders["layers.0.self_attn.k_proj"] == "layers.0.self_attn.q_proj"
    assert leaders["layers.0.mlp.up_proj"] == "layers.0.mlp.gate_proj"
    assert leaders["layers.0.mlp.down_proj"] == "layers.0.mlp.down_proj"


MOE = {  # tiny configs (tests/unit/models/test_moe.py's)
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, shared_expert_intermediate_size=64),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, head_dim=16),
}


@pytest.mark.parametrize("model_type", MOE)
def test_moe_experts_share_hessians_at_run_time_as_the_dry_run_plans(model_type):
    """`observe` shares one observer among the Linears fed one tensor (calibrating, every expert reads every token:
    all the experts' gates and ups); the dry run's `shared_input_leaders`, which counts the Hessians the run holds
    and the rows GPTQ stacks, groups them alike."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.calibration.hooks import capture_inputs, observer_groups
    from quantkit.models import moe
    from quantkit.quant.plan import plan_model

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=128, experts_implementation="eager", **MOE[model_type])
    model = moe.linearize(AutoModelForCausalLM.from_config(config).eval())
    layer = model.model.layers[0]
    layer.mlp.experts.all_tokens = True  # every expert sees every token, as calibration runs them
    plan = [e for e in plan_model(model, resolve("gptq-w4a16")) if e.quantized and e.name.startswith("model.layers.0.")]
    modules = {e.name: model.get_submodule(e.name) for e in plan}
    inputs = capture_inputs(model, model.model.layers, [torch.randint(0, 128, (2, 16))], torch.device("cpu"))
    groups = observer_groups(observe(modules, HessianObserver, layer, inputs))
    leaders = shared_input_leaders(list(modules))
    assert sorted(sorted(g) for g in groups) == sorted(sorted(n for n in modules if leaders[n] == leader)
                                                       for leader in set(leaders.values()))
    experts = [n for n in modules if ".experts." in n]
    assert len({leaders[n] for n in experts}) == 1 + len(experts) // 3  # one for the gates and ups, one per down


def test_awq_error_through_the_hessian_equals_running_the_linear():
    """For a block that is one Linear, tr(dW H dW^T) is the summed squared output error of the candidate."""
    from quantkit.algorithms.awq import awq_scales, hessian_error, scaled_candidate
    from quantkit.calibration.steps.awq import block_error

    torch.manual_seed(0)
    linear = nn.Linear(256, 64, bias=False)
    x = torch.randn(3, 40, 256) * torch.linspace(0.1, 4, 256)
    calls = [((batch[None],), {}) for batch in x]
    reference = [linear(*args) for args, _ in calls]
    observer = HessianObserver()
    for args, _ in calls:
        observer.update(args[0])
    xtx = observer.xtx()
    spec = resolve("awq-w4a16").scheme.weights
    for ratio in (0.0, 0.5):
        scales = awq_scales(x.abs().mean((0, 1)), ratio)
        with torch.no_grad():
            by_running = block_error(linear, calls, reference, [linear], [spec], scales)
        by_hessian = hessian_error(linear.weight.data, scaled_candidate(linear.weight.data, spec, scales), xtx)
        assert by_hessian == pytest.approx(by_running, rel=1e-4)


@pytest.mark.parametrize("actorder", [False, True])
def test_gptqs_own_row_errors_give_the_error_through_its_factor(actorder):
    """The solve's per-row sums of squared scaled rounding errors are ||(W - Q) U^-1||^2 (W - Q = err U): the error
    the pipeline reports from them equals the one measured through the factor (dead inputs and actorder included)."""
    import dataclasses

    from quantkit.algorithms.methods.gptq import GPTQArgs
    from quantkit.algorithms.gptq import gptq_quantize_rows, inverse_hessian
    from quantkit.calibration.layer import relative_error_of_solve

    torch.manual_seed(1)
    weight, x = torch.randn(300, 96), torch.randn(500, 96) * torch.linspace(0.1, 3, 96)
    x[:, [5, 40]] = 0.0
    args = GPTQArgs(actorder=actorder, block_size=32)
    factor = inverse_hessian(2 * x.T @ x / x.shape[0], args)
    spec = resolve("gptq-w4a16").scheme.weights
    row_errors = torch.zeros(300)
    qweight = gptq_quantize_rows(weight, factor, dataclasses.replace(spec, group_size=32), args, row_errors=row_errors)
    assert relative_error_of_solve(weight, row_errors, factor) == pytest.approx(
        relative_error_factored(weight, qweight, factor), rel=1e-4)
