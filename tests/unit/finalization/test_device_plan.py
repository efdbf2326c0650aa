"""The GPU memory plan of a calibrated finalize (`preflight.device_plan`): the mode a budget leads to, the peak, and
the refusal of a budget below what calibrating needs."""

import pytest

from quantkit.algorithms import Algorithm
from quantkit.errors import UsageError
from quantkit.finalization import preflight
from quantkit.runtime.placement import CUDA_CONTEXT_BYTES

GIB = 1 << 30
CALIB = {"one batch's activations in a layer": 2 * GIB, "Hessians of one layer": 3 * GIB}


def _plan(budget, algorithm=Algorithm.GPTQ, awq=False):
    # an 8B's shape: 0.4 GiB a layer, 512 x 2048 tokens of width 4096 in bf16 (8 GiB a copy) in 64 batches
    return preflight.device_plan(layer=GIB // 2, copy=8 * GIB, batches=64, calib=CALIB, algorithm=algorithm, awq=awq,
                                 budget=budget)


def test_hidden_states_stay_on_the_gpu_when_they_fit():
    plan = _plan(80 * GIB)
    assert plan["mode"] == "resident" and plan["peak_bytes"] == plan["resident_bytes"]
    fixed = GIB // 2 + CUDA_CONTEXT_BYTES + 5 * GIB
    assert plan["resident_bytes"] == fixed + 2 * 8 * GIB  # inputs and outputs (GPTQ: the residual stream)


def test_a_smaller_budget_offloads_them_and_the_peak_drops_below_it():
    plan = _plan(22 * GIB)
    assert plan["mode"] == "offloaded" and plan["peak_bytes"] == plan["offloaded_bytes"] <= 22 * GIB
    assert plan["resident_bytes"] > 22 * GIB
    preflight.check_device_budget({"device_plan": plan})  # fits: not refused


def test_awq_holds_more_copies_than_gptq():
    assert _plan(None, awq=True)["resident_bytes"] == _plan(None)["resident_bytes"] + 2 * 8 * GIB
    assert _plan(None)["mode"] == "resident"  # no budget known (no CUDA): as before


def test_a_budget_below_one_layer_s_work_is_refused_naming_the_minimum():
    plan = _plan(4 * GIB)
    with pytest.raises(UsageError, match=r"needs about (\d+\.\d|\d+)GiB of GPU memory .* budget is 4GiB: pass "
                                         r"--max-gpu-memory \d+(\.\d)?GiB or more") as raised:
        preflight.check_device_budget({"device_plan": plan})
    assert "\n" not in str(raised.value)


def test_autoround_is_never_offloaded():
    plan = _plan(22 * GIB, algorithm=Algorithm.AUTOROUND)
    assert plan["offloaded_bytes"] == plan["resident_bytes"] > 22 * GIB
    with pytest.raises(UsageError, match="tunes against"):
        preflight.check_device_budget({"device_plan": plan})
