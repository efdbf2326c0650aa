"""AutoRound's peak RAM terms (`algorithms.methods.autoround.tuning_bytes`, which the preflight asks for): what `algorithms.autoround.tune` holds while a tuning
pass runs, and no Hessians. On a Llama-3.1-8B-shaped layer (2 layers, 8 x 2048 tokens, bf16, 2 CPU threads) the
run measured 12.0 GiB at its peak: the estimate that counted GPTQ's Hessians and 36 bytes a weight was 16.8 GiB."""

from quantkit.algorithms.base import CalibrationSizes
from quantkit.algorithms.methods import autoround
from quantkit.finalization import preflight
from quantkit.finalization.finalize import CalibrationOptions, prepare
from quantkit.quant import registry
from quantkit.quant.plan import ModulePlan

HIDDEN, MLP, KV, HEADS = 4096, 14336, 1024, 32  # Llama-3.1-8B's
GIB = 1 << 30


def _llama_layer() -> list[ModulePlan]:
    scheme = registry.resolve("autoround-w4a16").scheme
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, KV), "self_attn.v_proj": (HIDDEN, KV),
              "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (HIDDEN, MLP), "mlp.up_proj": (HIDDEN, MLP),
              "mlp.down_proj": (MLP, HIDDEN)}
    return [ModulePlan(f"model.layers.0.{name}", i, o, scheme) for name, (i, o) in shapes.items()]


def test_an_8b_layer_tuned_on_the_cpu_in_bf16_is_within_a_tenth_of_the_measured_peak():
    sizes = CalibrationSizes(tuple(_llama_layer()), 8, 8, 2048, HIDDEN, 2, 1, "cpu", HEADS)
    terms = autoround.tuning_bytes(sizes, passes=2, pass_samples=4, heads=HEADS, pass_element=2)
    weights = HIDDEN * (2 * HIDDEN + 2 * KV) + 3 * HIDDEN * MLP
    assert terms["AutoRound tuning state of one layer"] == 26 * weights  # float32 groups of the bf16 weights too
    assert terms["AutoRound gradients of a step's passes"] == 4 * 2 * weights  # leaves, two rows, the pass's own
    # the softmax's backward: 3 bf16 score-sized tensors (4 samples x 32 heads x 2048^2) beside 12 hidden-wide ones
    scores = 4 * HEADS * 2048 * 2048 * 2
    assert terms[autoround.PASS] == 3 * scores + 4 * 2048 * 12 * HIDDEN * 2
    # the run's other terms as the 8B's dry run printed them: fixed, the streamed layer, the quantized stream
    total = sum(terms.values()) + int(494.8 * (1 << 20)) + int(1.234 * GIB) + 256 * (1 << 20)
    assert abs(total / (12.0 * GIB) - 1) <= 0.1, total / GIB


def test_short_scores_leave_the_mlps_backward_the_larger():
    short = autoround.pass_bytes(4, 128, HIDDEN, MLP, HEADS, 2)
    tokens = 4 * 128
    assert short == 4 * HEADS * 128 * 128 * 2 + tokens * (12 * HIDDEN + 5 * MLP) * 2
    assert autoround.pass_bytes(4, 128, HIDDEN, MLP, 0, 2) == tokens * (12 * HIDDEN + 5 * MLP) * 2


def test_the_estimate_counts_autorounds_pass_and_no_hessians(wide_model_dir, text_file):
    options = CalibrationOptions(data=str(text_file), num_samples=8, seq_len=32)
    recipe = registry.resolve("autoround-w4a16")
    prepared = prepare(wide_model_dir, recipe, calibration=options)
    breakdown = preflight.estimate(prepared, prepared.recipe, options, 1, None)["peak_ram_breakdown"]
    assert "Hessians of one layer" not in breakdown and "one batch's activations in a layer" not in breakdown
    assert breakdown[autoround.PASS] > 0
