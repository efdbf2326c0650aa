"""The online transforms of an artifact's transform_config, which plain transformers ignores, applied by quantkit's
loader (`quant.rotations.apply_online_transforms`): compressed-tensors' locations, inverses, per-head matrices,
stored matrices, and target matching."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_text
from quantkit.algorithms import hadamard
from quantkit.errors import UnsupportedModelError
from quantkit.models.tiny import build_tiny_model
from quantkit.quant.rotations import StoredRotation, apply_online_transforms, online_groups


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("online") / "llama", make_text(800), "llama", intermediate_size=128)


def _with_groups(model_dir, groups: dict, stored: dict | None = None):
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"transform_config": {"config_groups": groups}}
    if stored:
        save_file({**load_file(model_dir / "model.safetensors"), **stored}, str(model_dir / "model.safetensors"))
    return config


def _group(location: str, targets: list[str], inverse: bool = False, head_dim=None, kind="hadamard", randomize=False):
    return {"type": kind, "head_dim": head_dim, "randomize": randomize, "precision": "torch.float64",
            "apply": [{"targets": targets, "location": location, "inverse": inverse, "ignore": []}]}


def test_a_per_head_output_transform_with_its_inverse_is_applied_to_the_targets_only(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    o = model.model.layers[0].self_attn.o_proj
    x = torch.randn(2, 5, o.in_features)
    with torch.no_grad():
        plain = o(x)
    config = _with_groups(model_dir, {"u": _group("output", ["re:.*layers\\.0\\.self_attn\\.o_proj$"], inverse=True, head_dim=16)})
    hooked = apply_online_transforms(model, model_dir, config)
    assert hooked == ["model.layers.0.self_attn.o_proj"]
    h = hadamard.hadamard_matrix(16)  # ±1 / √16; inverse: its transpose, once per 16 columns
    with torch.no_grad():
        expected = (plain.unflatten(-1, (-1, 16)) @ h.T.float()).flatten(-2)
        torch.testing.assert_close(o(x), expected)


def test_a_stored_input_matrix_is_read_and_shared_by_width(model_dir, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    work = tmp_path / "model"
    shutil.copytree(model_dir, work)
    matrix = hadamard.random_hadamard_matrix(128, 3, normalize=False)
    config = _with_groups(work, {"R4": _group("input", ["re:.*down_proj$"], kind="random-hadamard")},
                          {"model.layers.0.mlp.down_proj.R4_input.weight": matrix})
    model = AutoModelForCausalLM.from_pretrained(work).eval()
    downs = apply_online_transforms(model, work, config)
    assert downs == [f"model.layers.{i}.mlp.down_proj" for i in range(model.config.num_hidden_layers)]
    seen = []
    down = model.model.layers[1].mlp.down_proj
    down.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    x = torch.randn(3, 128)
    down(x)
    torch.testing.assert_close(seen[0], x @ (matrix / 128 ** 0.5).float())


def test_what_it_cannot_apply_exactly_is_refused(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with pytest.raises(UnsupportedModelError, match="randomized permutations"):
        apply_online_transforms(model, model_dir, _with_groups(model_dir, {"v": _group("input", ["Linear"], randomize=True)}))
    with pytest.raises(UnsupportedModelError, match="no stored 128x128 matrix"):
        apply_online_transforms(model, model_dir, _with_groups(
            model_dir, {"R4": _group("input", ["re:.*down_proj$"], kind="random-hadamard")}))


def test_fused_groups_are_not_online():
    fused = {"R1": _group("weight_output", ["re:.*o_proj$"])}
    assert online_groups({"quantization_config": {"transform_config": {"config_groups": fused}}}) == {}
    assert online_groups({}) == {}


def test_a_stored_rotation_computes_in_float32_and_returns_the_input_dtype():
    rotation = StoredRotation(hadamard.hadamard_matrix(8, normalize=False))
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    y = rotation.rotate(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, (x.float() @ hadamard.hadamard_matrix(8).float()).to(torch.bfloat16))


def test_online_transforms_on_experts_loaded_fused_are_refused(tmp_path):
    """transformers loads MoE experts as one fused parameter: no hook on a down projection reaches them, so the
    artifact is refused rather than evaluated without its transform."""
    from transformers import AutoModelForCausalLM

    src = build_tiny_model(tmp_path / "mixtral", make_text(800), "mixtral", num_local_experts=4, num_experts_per_tok=2,
                           num_hidden_layers=1)
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    config = _with_groups(src, {"R4": _group("input", ["re:.*down_proj$", "re:.*w2$"])})
    with pytest.raises(UnsupportedModelError, match="transformers loads its experts fused"):
        apply_online_transforms(model, src, config)
