"""quantkit/models/compat.py: each reach into transformers' internals works the way each release it handles (5.17 to 5.24)
lays it out. Each branch is tested whichever transformers is installed: with the installed release's own objects, and
with a stand-in laid out as the other release lays them out (made of the installed release's objects)."""

import ast
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers.core_model_loading as loading
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.models import compat
ROOT = Path(__file__).resolve().parents[3]


def _apply_renamings(source_key, weight_renamings):
    """transformers 5.21's `apply_renamings`, for a release that lacks it."""
    for renaming in weight_renamings:
        source_key, _ = renaming.rename_source_key(source_key)
    return source_key


# transformers' `core_model_loading` as each release lays out what the renamer uses
RELEASES = {
    "5.17": SimpleNamespace(PrefixChange=loading.PrefixChange, WeightRenaming=loading.WeightRenaming,
                            rename_source_key=loading.rename_source_key),
    "5.21": SimpleNamespace(PrefixChange=loading.PrefixChange, WeightRenaming=loading.WeightRenaming,
                            apply_renamings=getattr(loading, "apply_renamings", _apply_renamings)),
    "installed": loading,
}


def _mixtral_on_meta():
    config = AutoConfig.for_model("mixtral", hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                  vocab_size=128, num_local_experts=4, num_experts_per_tok=2, intermediate_size=96)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("release", RELEASES)
def test_every_release_renames_mixtrals_block_as_its_checkpoint_names_it(release):
    rename = compat.checkpoint_renamer(_mixtral_on_meta(), RELEASES[release])
    assert rename("model.layers.0.mlp.experts.1.w2.weight") == "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    assert rename("model.layers.0.mlp.gate.weight") == "model.layers.0.block_sparse_moe.gate.weight"
    assert rename("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert rename("lm_head.weight") == "lm_head.weight"


def test_the_renamer_uses_the_function_each_release_has():
    newer = compat.renamer(SimpleNamespace(apply_renamings=_apply_renamings, rename_source_key=None))
    assert newer is _apply_renamings
    calls = []
    older = compat.renamer(SimpleNamespace(rename_source_key=lambda key, *args: calls.append(args) or (key + "!", None)))
    assert older("a.b", ["renaming"]) == "a.b!" and calls == [(["renaming"], [])]  # renamings only, no converters


def _distributed_layout(monkeypatch, release: str) -> None:
    """transformers.distributed as `release` keeps `replace_layer_number_by_wildcard`: 5.17 to 5.22 in tensor_parallel
    (parallel_utils absent, or without it), 5.24 in parallel_utils (tensor_parallel without it)."""
    function = SimpleNamespace(replace_layer_number_by_wildcard=lambda name: f"{release}: {name}")
    modules = {"5.17": {"transformers.distributed.parallel_utils": None, "transformers.distributed.tensor_parallel": function},
               "5.22": {"transformers.distributed.parallel_utils": SimpleNamespace(), "transformers.distributed.tensor_parallel": function},
               "5.24": {"transformers.distributed.parallel_utils": function, "transformers.distributed.tensor_parallel": SimpleNamespace()},
               "unknown": {"transformers.distributed.parallel_utils": None, "transformers.distributed.tensor_parallel": None}}[release]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("release", ["5.17", "5.22", "5.24"])
def test_layer_numbers_become_wildcards_wherever_the_release_keeps_the_function(release, monkeypatch):
    _distributed_layout(monkeypatch, release)
    assert compat.replace_layer_number_by_wildcard("model.layers.3.mlp") == f"{release}: model.layers.3.mlp"


def test_a_release_that_keeps_it_elsewhere_is_named_in_the_error(monkeypatch):
    _distributed_layout(monkeypatch, "unknown")
    with pytest.raises(ImportError, match="replace_layer_number_by_wildcard: a transformers release quantkit does not know"):
        compat.replace_layer_number_by_wildcard("model.layers.3.mlp")


def test_the_installed_release_has_what_quantkit_reaches_for():
    assert compat.replace_layer_number_by_wildcard("model.layers.3.mlp.experts.7.w1.weight") == "model.layers.*.mlp.experts.*.w1.weight"
    sdpa, repeat_kv = compat.sdpa_attention()
    assert callable(sdpa) and repeat_kv(torch.zeros(1, 2, 3, 4), 3).shape == (1, 6, 3, 4)
    assert {"llama", "mixtral", "qwen3_moe"} <= set(compat.causal_lm_model_types())
    converters = [c for c in compat.weight_conversions(_mixtral_on_meta()) if compat.is_weight_converter(c)]
    layouts = [compat.converter_layout(c) for c in converters]
    assert ([("MergeModulelist", 0), ("Concatenate", 1)] in [ops for _, _, ops in layouts]
            and [("MergeModulelist", 0)] in [ops for _, _, ops in layouts])


@pytest.mark.parametrize("version, tolerated", [("5.17.0", True), ("5.20.2", True), ("5.22.2", True), ("5.23.0", False),
                                                ("5.24.0", False), ("5.25.0.dev0", False)])
def test_quantized_checkpoints_of_other_shapes_load_up_to_5_22(version, tolerated):
    assert compat.tolerates_quantized_shape_mismatch(version) is tolerated


@pytest.mark.parametrize("version, uneven", [("5.17.0", False), ("5.20.2", False), ("5.21.1", True), ("5.24.0", True)])
def test_lm_heads_the_ranks_do_not_divide_are_split_from_5_21(version, uneven):
    assert compat.shards_rows_unevenly(version) is uneven


class _Styles(dict):
    """A registry of tensor-parallel styles, as transformers' `ALL_PARALLEL_STYLES` registers them."""

    def register(self, key, value):
        self[key] = value


def test_the_replicate_style_is_registered_where_the_release_lacks_it():
    older, newer = _Styles(colwise="colwise"), _Styles(replicate="theirs")
    assert compat.replicate_style(older) == compat.replicate_style(newer) == "replicate"
    assert newer["replicate"] == "theirs"  # 5.21 and later: their own
    layer = older["replicate"]  # 5.17 to 5.20: a layer that shards nothing and installs nothing
    parameter = torch.nn.Parameter(torch.ones(1))
    module = SimpleNamespace(_parameters={"input_scale": parameter})
    layer.shard_param(module, "input_scale", mesh=None)
    assert module._parameters["input_scale"] is parameter
    assert compat.replicate_style() == "replicate"  # the installed release's registry


class _DeviceMesh(SimpleNamespace):
    """torch's DeviceMesh as 5.17 returns it: one or more named dimensions."""

    def __getitem__(self, kind):
        return self.meshes[kind]


@pytest.mark.parametrize("returned, expected", [
    (SimpleNamespace(get_mesh={"tp": "the tp mesh"}.get), "the tp mesh"),  # 5.20 and later: a mesh manager
    (_DeviceMesh(ndim=1), None),  # 5.17, 5.18, tensor parallelism alone: the mesh itself
    (_DeviceMesh(ndim=2, meshes={"tp": "the tp mesh"}), "the tp mesh"),  # 5.17, 5.18, with another kind
])
def test_the_tensor_parallel_mesh_is_found_in_what_each_release_returns(returned, expected):
    assert compat.tensor_parallel_mesh(returned) is (expected or returned)


def _transformers_submodule_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("transformers."):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("transformers.")]
    return found


def test_only_compat_reaches_inside_transformers():
    """Outside compat.py, quantkit imports from transformers' top level only (what transformers exports)."""
    sources = [p for folder in ("quantkit", "cli") for p in (ROOT / folder).rglob("*.py") if p.name != "compat.py"]
    reaches = {str(p.relative_to(ROOT)): found for p in sources if (found := _transformers_submodule_imports(p))}
    assert not reaches, reaches
