"""The pipeline's plan of layer steps, checked before any weight moves."""

import pytest

from quantkit import registry
from quantkit.calibration.pipeline import layer_steps
from quantkit.calibration.steps.static_scales import static_scales_step
from quantkit.errors import UsageError


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
    with pytest.raises(UsageError, match="GPTQ with static activation scales"):
        layer_steps(recipe)
