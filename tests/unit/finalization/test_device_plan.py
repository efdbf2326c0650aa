"""The memory plans of a calibrated finalize: the GPU's (`preflight.device_plan`: the mode a budget leads to, the peak,
the refusal of a budget below what calibrating needs) and the RAM's refusal (`preflight.check_memory`)."""

import pytest

from quantkit import algorithms
from quantkit.algorithms.methods.awq import AWQArgs
from quantkit.errors import UsageError
from quantkit.finalization import preflight
from quantkit.runtime.placement import CUDA_CONTEXT_BYTES

GIB = 1 << 30
CALIB = {"one batch's activations in a layer": 2 * GIB, "Hessians of one layer": 3 * GIB}


def _plan(budget, algorithm=algorithms.get("gptq"), awq=False):
    # an 8B's shape: 0.4 GiB a layer, 512 x 2048 tokens of width 4096 in bf16 (8 GiB a copy) in 64 batches
    return preflight.device_plan(layer=GIB // 2, copy=8 * GIB, batches=64, calib=CALIB, algorithm=algorithm, block_search=awq,
                                 budget=budget)


def test_hidden_states_stay_on_the_gpu_when_they_fit():
    plan = _plan(80 * GIB)
    assert plan["mode"] == "resident" and plan["peak_bytes"] == plan["resident_bytes"]
    fixed = GIB // 2 + CUDA_CONTEXT_BYTES + 5 * GIB
    assert plan["resident_bytes"] == fixed + 2 * 8 * GIB  # inputs and outputs (GPTQ: the residual stream)


def test_gptqs_staged_pass_in_the_inputs_holds_one_copy_and_fits_a_smaller_budget():
    one = preflight.device_plan(layer=GIB // 2, copy=8 * GIB, batches=64, calib=CALIB, algorithm=algorithms.get("gptq"),
                                block_search=False, budget=22 * GIB, copies=1)
    assert one["resident_bytes"] == _plan(None)["resident_bytes"] - 8 * GIB
    assert one["mode"] == "resident" and _plan(22 * GIB)["mode"] == "offloaded"


def test_a_smaller_budget_offloads_them_and_the_peak_drops_below_it():
    plan = _plan(22 * GIB)
    assert plan["mode"] == "offloaded" and plan["peak_bytes"] == plan["offloaded_bytes"] <= 22 * GIB
    assert plan["resident_bytes"] > 22 * GIB
    preflight.check_device_budget({"device_plan": plan})  # fits: not refused


def test_awq_holds_more_copies_than_gptq():
    assert _plan(None, awq=True)["resident_bytes"] == _plan(None)["resident_bytes"] + 2 * 8 * GIB
    assert _plan(None)["mode"] == "resident"  # no budget known (no CUDA): as before


def test_awq_holds_only_the_rows_its_grid_scores():
    """512 x 2048 tokens with grid_tokens 128 x 2048: the blocks' inputs and the float outputs are a quarter of a
    copy each; beside the inputs and the Hessians that is the peak of AWQ with round to nearest (1.75 copies and
    3 GiB, over 2 copies without Hessians), and of AWQ with GPTQ the layer's inputs and outputs with GPTQ's."""
    batches = [range(s, s + 8) for s in range(0, 512, 8)]
    share = algorithms.get("awq").grid_share(AWQArgs(grid_tokens=128 * 2048), batches, 512, 2048)
    assert share == 0.25
    assert algorithms.get("awq").grid_share(AWQArgs(grid_tokens=None), batches, 512, 2048) == 1.0
    assert algorithms.get("awq").grid_share(AWQArgs(grid_tokens=1024 * 2048), batches, 512, 2048) == 1.0  # fewer tokens than the limit
    assert algorithms.get("awq").grid_share(AWQArgs(grid_tokens=2048), batches, 512, 2048) == 64 / 512  # at least a row a batch
    fixed = _plan(None)["resident_bytes"] - 2 * 8 * GIB

    def resident(algorithm, grid_share):
        return preflight.device_plan(layer=GIB // 2, copy=8 * GIB, batches=64, calib=CALIB, algorithm=algorithm,
                                     block_search=True, budget=None, grid_share=grid_share)["resident_bytes"]

    assert resident(algorithms.get("rtn"), share) == fixed + 14 * GIB  # 1.75 copies, with the Hessians
    assert resident(algorithms.get("gptq"), share) == fixed + 16 * GIB  # GPTQ's Hessians after the search
    assert resident(algorithms.get("rtn"), 0.5) == fixed + 20 * GIB  # 1 + 3 x 0.5 copies
    assert resident(algorithms.get("rtn"), 1.0) == _plan(None, awq=True)["resident_bytes"]  # every row: 4 copies


def test_a_budget_below_one_layer_s_work_is_refused_naming_the_minimum():
    plan = _plan(4 * GIB)
    with pytest.raises(UsageError, match=r"needs about (\d+\.\d|\d+)GiB of GPU memory .* budget is 4GiB: pass "
                                         r"--max-gpu-memory \d+(\.\d)?GiB or more") as raised:
        preflight.check_device_budget({"device_plan": plan})
    assert "\n" not in str(raised.value)


def test_autoround_is_never_offloaded():
    plan = _plan(22 * GIB, algorithm=algorithms.get("autoround"))
    assert plan["offloaded_bytes"] == plan["resident_bytes"] > 22 * GIB
    with pytest.raises(UsageError, match="tunes against"):
        preflight.check_device_budget({"device_plan": plan})


def _ram_report(hidden: int) -> dict:
    return {"samples_per_rank": [64, 64], "peak_ram_bytes": int(2 * GIB + hidden),
            "peak_ram_breakdown": {"fixed (this process: python, torch, transformers)": GIB,
                                   "one decoder layer (read, quantized, packed)": GIB,
                                   "calibration hidden states (this rank)": int(hidden)}}


def test_calibration_activations_beyond_the_machine_s_memory_are_refused_naming_the_samples_that_fit():
    preflight.check_memory(_ram_report(8 * GIB), available=12 * GIB)  # 10 GiB: fits
    preflight.check_memory(_ram_report(10.5 * GIB), available=12 * GIB)  # 12.5 estimated, 11.5 it cannot do without
    with pytest.raises(UsageError, match=r"activations alone need about 18.25 GB of RAM .* 12.88 GB available; pass "
                                         r"--num-samples 88 or fewer") as raised:
        preflight.check_memory(_ram_report(16 * GIB), available=12 * GIB)  # 1 + 16 GiB: 11 GiB left, 44 of each rank's 64
    assert "\n" not in str(raised.value)
    assert "even one sample" in preflight.memory_shortfall(_ram_report(16 * GIB), available=GIB)
    assert preflight.memory_shortfall({"samples_per_rank": None}, available=0) is None  # round to nearest: no samples


def test_finalize_refuses_before_reading_a_weight_when_the_activations_cannot_fit(tiny_model_dir, text_file, tmp_path,
                                                                                   monkeypatch):
    import psutil

    from quantkit.finalization.checks import CalibrationOptions
    from quantkit.finalization.finalize import finalize
    from quantkit.models import loading, streaming
    from quantkit.quant.registry import resolve

    def read_weights(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(loading, "load_model", read_weights)
    monkeypatch.setattr(streaming, "open_streamed", read_weights, raising=False)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 0})())
    monkeypatch.setattr(preflight, "peak_resident_bytes", lambda: 400 << 20)  # this process: all there is to spare
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    with pytest.raises(UsageError, match="of RAM and this machine has"):
        finalize(tiny_model_dir, tmp_path / "out", resolve("gptq-w4a16"), calibration=options)
    assert not (tmp_path / "out").exists()


def test_a_layer_holds_one_copy_of_the_hidden_states_but_where_its_inputs_are_read_beside_its_outputs():
    from quantkit.quant import registry

    def copies(name, kv_cache=None, staged=True):
        return preflight.resident_copies(registry.with_kv_cache(registry.resolve(name), kv_cache), staged)

    assert copies("gptq-w4a16") == copies("awq-w4a16") == copies("int8-dynamic-act-int8-weight") == 1
    assert copies("awq-w4a16", "fp8") == copies("gptq-w4a16", "fp8", staged=False) == 1  # the KV step consumes them
    assert copies("gptq-w4a16", "fp8") == 2  # the staged pass's outputs beside the inputs the KV step reads
    assert copies("autoround-w4a16") == 2


def test_the_fixed_cost_is_this_process_now_or_its_peak_so_far_where_that_was_higher(tiny_model_dir, text_file,
                                                                                      monkeypatch):
    """Reading the calibration text can peak above what the run's work adds; it is over before the run starts."""
    from quantkit.finalization.checks import CalibrationOptions, prepare
    from quantkit.quant.registry import resolve

    recipe = resolve("gptq-w4a16")
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    prepared = prepare(tiny_model_dir, recipe, None, calibration=options)

    def estimate(now: int, peak: int) -> dict:
        monkeypatch.setattr(preflight, "resident_bytes", lambda: now)
        monkeypatch.setattr(preflight, "peak_resident_bytes", lambda: peak)
        return preflight.estimate(prepared, recipe, options, 1, None)

    low = estimate(GIB, GIB)
    work = low["peak_ram_bytes"] - GIB
    assert next(iter(low["peak_ram_breakdown"].values())) == GIB and work > 0
    high = estimate(GIB, 100 * GIB)  # an earlier peak above the fixed cost and the work together
    assert high["peak_ram_bytes"] == sum(high["peak_ram_breakdown"].values()) == 100 * GIB
    assert next(iter(high["peak_ram_breakdown"].values())) == 100 * GIB - work
    assert estimate(2 * GIB, GIB)["peak_ram_bytes"] == 2 * GIB + work  # what it holds now, not its peak
