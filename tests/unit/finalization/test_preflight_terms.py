"""The RAM terms of the preflight that are arithmetic on the plan: GPTQ's staged pass on the CPU
(`preflight.stages_gptq`, `preflight.staged_gptq_bytes`), which holds the largest of its steps, not their sum;
GPTQ calibrating a streamed layer at once (`preflight.layerwise_gptq_bytes`), whose solves overlap the layer held
once and the copies of the stages solved before, not the layer's every copy."""

from quantkit.finalization import preflight
from quantkit.quant import registry
from quantkit.grids.observers import HessianObserver
from quantkit.quant.plan import ModulePlan

HIDDEN, MLP, KV = 4096, 14336, 1024  # Llama-3.1-8B's widths
STEP = "GPTQ's largest step (rows of a batch through the MLP, a Hessian summed, or a stage solved)"


def _llama_layer(*skip: str) -> list[ModulePlan]:
    scheme = registry.resolve("gptq-w4a16").scheme
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, KV), "self_attn.v_proj": (HIDDEN, KV),
              "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (HIDDEN, MLP), "mlp.up_proj": (HIDDEN, MLP),
              "mlp.down_proj": (MLP, HIDDEN)}
    return [ModulePlan(f"model.layers.0.{name}", i, o, scheme) for name, (i, o) in shapes.items() if name not in skip]


def _general(samples=16, batch=8):
    return preflight.calibration_bytes(_llama_layer(), {}, {}, samples, 2048, HIDDEN, 2, batch, held_stage_inputs=True)


def test_a_known_wiring_is_staged_and_a_layer_without_its_down_projection_is_not():
    assert preflight.stages_gptq(_llama_layer())
    assert not preflight.stages_gptq(_llama_layer("mlp.down_proj"))  # an MoE layer's experts: observed layer-wise
    assert not preflight.stages_gptq([])


def test_the_staged_pass_counts_its_largest_step_instead_of_every_stage_at_once():
    general = _general()
    staged = preflight.staged_gptq_bytes(general, _llama_layer(), 16, 2048, 2, 8, held=True)
    assert "Hessians of one layer" not in staged and "one batch's activations in a layer" not in staged
    assert staged[preflight._HIDDEN_STATES] == general[preflight._HIDDEN_STATES]
    assert staged[preflight._HELD_STAGE_INPUTS] == general[preflight._HELD_STAGE_INPUTS]
    # the down projection's solve: its float32 Hessian and factor (14336^2 x 2), and its float32 weight
    assert staged[STEP] == 4 * MLP * (2 * MLP + HIDDEN)
    assert staged[STEP] < general["Hessians of one layer"] + general["one batch's activations in a layer"]


def test_inputs_computed_again_add_a_batch_through_the_mlp_to_the_hessian_sum():
    layer = _llama_layer()
    held = preflight.staged_gptq_bytes(_general(64, 64), layer, 64, 2048, 2, 64, held=True)[STEP]
    recomputed = preflight.staged_gptq_bytes(_general(64, 64), layer, 64, 2048, 2, 64, held=False)[STEP]
    mlp_pass = int(preflight.MLP_PASS_COPIES * 2 * 2048 * MLP * 2)  # 2 rows of the batch's 64 at once (ROW_CHUNK_BYTES)
    solve = 4 * MLP * (2 * MLP + HIDDEN)
    observe = HessianObserver.accumulator_bytes(MLP) + preflight.HESSIAN_CHUNK_COPIES * 4 * 4096 * MLP
    assert held == recomputed == solve == max(solve, mlp_pass, observe + mlp_pass)  # however large the batch


def test_the_mlp_pass_runs_on_a_few_rows_of_a_batch(monkeypatch):
    from quantkit.calibration import true_sequential

    layer = _llama_layer()
    monkeypatch.setattr(true_sequential, "ROW_CHUNK_BYTES", 1 << 40)  # a whole batch of 64 at once
    mlp_pass = int(preflight.MLP_PASS_COPIES * 64 * 2048 * MLP * 2)
    assert preflight.staged_gptq_bytes(_general(64, 64), layer, 64, 2048, 2, 64, held=True)[STEP] == mlp_pass
    recomputed = preflight.staged_gptq_bytes(_general(64, 64), layer, 64, 2048, 2, 64, held=False)[STEP]
    assert recomputed == HessianObserver.accumulator_bytes(MLP) + preflight.HESSIAN_CHUNK_COPIES * 4 * 4096 * MLP + mlp_pass


def _moe_layer(experts=128, hidden=2048, expert_mlp=768) -> list[ModulePlan]:
    """A Qwen3-30B-A3B layer: attention (32 heads of 128, 4 KV heads) and `experts` expert MLPs."""
    scheme = registry.resolve("gptq-w4a16").scheme
    shapes = {"self_attn.q_proj": (hidden, 4096), "self_attn.k_proj": (hidden, 512), "self_attn.v_proj": (hidden, 512),
              "self_attn.o_proj": (4096, hidden)}
    for e in range(experts):
        shapes |= {f"mlp.experts.{e}.gate_proj": (hidden, expert_mlp), f"mlp.experts.{e}.up_proj": (hidden, expert_mlp),
                   f"mlp.experts.{e}.down_proj": (expert_mlp, hidden)}
    return [ModulePlan(f"model.layers.0.{name}", i, o, scheme) for name, (i, o) in shapes.items()]


def test_a_layer_calibrated_at_once_solves_its_experts_stacked_beside_the_layer_held_about_once():
    layer = _moe_layer()
    assert not preflight.stages_gptq(layer)
    copies = int(preflight.CALIBRATED_LAYER_COPIES * (1 << 30))  # a 1 GiB layer's copies
    found = preflight.layerwise_gptq_bytes(1 << 30, 0, layer)
    stacked = preflight.stage_solve_bytes(2048, 2 * 128 * 768)  # every expert's gate and up on one Hessian
    attention = 2048 * (4096 + 512 + 512) + 4096 * 2048  # solved before it
    weights = attention + 3 * 128 * 2048 * 768
    before = int((1 << 30) + (copies - (1 << 30)) * attention / weights)
    assert found[preflight._LAYER_AND_SOLVE] == before + stacked
    assert found[preflight._LAYER_AND_SOLVE] < copies + stacked  # the general estimate: every copy beside the solve
    # the Hessians: their float64 accumulators only (the solve is in the layer's term)
    accumulators = sum(HessianObserver.accumulator_bytes(w) for w in (2048, 4096, 2048)) + 128 * HessianObserver.accumulator_bytes(768)
    assert found[preflight._HESSIANS] == accumulators


def test_a_solve_after_most_of_the_layer_counts_the_copies_already_made_and_never_less_than_all_of_them():
    layer = _llama_layer()
    copies = int(preflight.CALIBRATED_LAYER_COPIES * (1 << 30))
    down = preflight.layerwise_gptq_bytes(1 << 30, 0, layer)[preflight._LAYER_AND_SOLVE]
    done = HIDDEN * (2 * HIDDEN + 2 * KV) + 2 * HIDDEN * MLP  # q, k, v, o, gate and up before the down projection
    weights = done + MLP * HIDDEN
    assert down == int((1 << 30) + (copies - (1 << 30)) * done / weights) + preflight.stage_solve_bytes(MLP, HIDDEN)
    tiny = [ModulePlan("model.layers.0.mlp.down_proj", 8, 8, layer[0].scheme)]  # a solve smaller than the copies
    assert preflight.layerwise_gptq_bytes(1 << 30, 123, tiny)[preflight._LAYER_AND_SOLVE] == copies + 123
