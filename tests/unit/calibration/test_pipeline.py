"""The pipeline's plan of layer steps, checked before any weight moves."""

import pytest

from quantkit.calibration.pipeline import layer_steps
from quantkit.calibration.steps.static_scales import static_scales_step
from quantkit.errors import UsageError
from quantkit.quant import registry


def _recipe(tmp_path, algorithm: str, activations: str = ""):
    path = tmp_path / "r.yaml"
    path.write_text(f"scheme: {{weights: {{dtype: int8, granularity: channel}}{activations}}}\n"
                    f"format: compressed-tensors\nalgorithm: {algorithm}")
    return registry.resolve(str(path))


def test_transforms_then_static_scales_then_the_quantizer(tmp_path):
    recipe = _recipe(tmp_path, "[{name: smoothquant}, {name: rtn}]", ", activations: {dtype: int8, dynamic: false}")
    steps = layer_steps(recipe)
    assert len(steps) == 3 and steps[1] is static_scales_step


def test_dynamic_activations_need_no_static_scales():
    steps = layer_steps(registry.resolve("gptq-w4a16"))
    assert len(steps) == 1 and static_scales_step not in steps


def test_gptq_with_static_scales_is_refused_up_front(tmp_path):
    recipe = _recipe(tmp_path, "{name: gptq}", ", activations: {dtype: int8, dynamic: false}")
    with pytest.raises(UsageError, match="GPTQ with calibrated activation scales"):
        layer_steps(recipe)


def _layer_with(outputs_error: float):
    from torch import nn

    from quantkit.calibration.layer import CalibrationResult, Layer
    from quantkit.quant.plan import ModulePlan

    module = nn.Sequential(nn.Linear(4, 4))
    recipe = registry.resolve("gptq-w4a16")
    plan = {"m.0": ModulePlan("m.0", 4, 4, recipe.scheme)}
    result = CalibrationResult(errors={"m.0": outputs_error})
    return Layer(module, "m", 0, [], plan, recipe, result)


def test_a_layer_with_non_finite_outputs_stops_the_run_naming_it():
    import torch

    from quantkit.calibration.pipeline import check_layer
    from quantkit.errors import CalibrationError

    layer = _layer_with(0.1)
    check_layer(layer, [torch.ones(2, 3)])
    with pytest.raises(CalibrationError, match=r"decoder layer m gives non-finite outputs .*\(1 of 6 values\)"):
        check_layer(layer, [torch.tensor([[1.0, float("nan"), 1.0], [1.0, 1.0, 1.0]])])


@pytest.mark.parametrize("error", [1.5, float("nan")])
def test_a_module_whose_error_is_as_large_as_its_output_stops_the_run(error):
    import torch

    from quantkit.calibration.pipeline import check_layer
    from quantkit.errors import CalibrationError

    with pytest.raises(CalibrationError, match="m.0: relative output error"):
        check_layer(_layer_with(error), [torch.ones(2, 3)])
