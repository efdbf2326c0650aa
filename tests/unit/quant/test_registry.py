from pathlib import Path

import pytest
import yaml

from quantkit.errors import RecipeError, RecipeNotFoundError
from quantkit.quant import registry
from quantkit.quant.registry import Format, IndivisiblePolicy
from quantkit.grids.schemes import Granularity, KVCacheSpec, QDtype

RECIPES_DIR = Path(__file__).resolve().parents[3] / "recipes"
SHIPPED = sorted(RECIPES_DIR.rglob("*.yaml"))
CORE = {
    "int4-weight-only", "int8-dynamic-act-int4-weight", "float8-dynamic-act-float8-weight",
    "int8-weight-only", "int8-dynamic-act-int8-weight",
}


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_recipe_is_valid(path):
    recipe = registry.load_recipe_file(path)
    assert recipe.name == path.stem
    assert recipe.description
    assert recipe.scheme.weights.dtype in QDtype


def test_installed_registry_lists_exactly_the_shipped_files():
    assert registry.recipe_names() == sorted(p.stem for p in SHIPPED)
    assert CORE <= set(registry.recipe_names())


def test_core_recipes_mean_their_torchao_namesakes():
    int4 = registry.resolve("int4-weight-only").scheme
    assert (int4.weights.dtype, int4.weights.group_size, int4.activations) == (QDtype.INT4, 128, None)
    w4a8 = registry.resolve("int8-dynamic-act-int4-weight").scheme
    assert (w4a8.weights.group_size, w4a8.activations.dtype, w4a8.activations.symmetric) == (32, QDtype.INT8, False)
    fp8 = registry.resolve("float8-dynamic-act-float8-weight").scheme
    assert fp8.weights.granularity is Granularity.CHANNEL and fp8.activations.dtype is QDtype.FLOAT8


def test_resolve_a_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text((RECIPES_DIR / "int8-weight-only.yaml").read_text())
    recipe = registry.resolve(str(path))
    assert recipe.name == "mine" and recipe.format is Format.COMPRESSED_TENSORS


def test_unknown_name_suggests_close_matches():
    with pytest.raises(RecipeNotFoundError, match=r"did you mean int4-weight-only.*quantkit recipes list"):
        registry.resolve("int4-weight-onyl")


def test_unknown_name_without_close_match_still_names_the_list_command():
    with pytest.raises(RecipeNotFoundError, match="quantkit recipes list") as info:
        registry.resolve("zzz")
    assert "did you mean" not in str(info.value)


def test_missing_recipe_file_is_not_parsed_as_a_name(tmp_path):
    with pytest.raises(RecipeNotFoundError, match="does not exist"):
        registry.resolve(str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize(
    "body, field",
    [
        ("scheme: {weights: {dtype: int16, granularity: group, group_size: 32}}\nformat: torchao", "scheme.weights.dtype"),
        ("scheme: {weights: {dtype: int4, granularity: group}}\nformat: torchao", "scheme.weights.group_size"),
        ("scheme: {weights: {dtype: int4, granularity: channel}}\nformat: zip", "format"),
        ("scheme: {weights: {dtype: int4, granularity: channel}}\nformat: torchao\nalgorithm: {name: magic}", "algorithm.name"),
        ("scheme: {weights: {dtype: int4, granularity: channel}}\nformat: torchao\nbogus: 1", "bogus"),
        ("format: torchao", "scheme"),
        ("scheme: {weights: {dtype: int8, granularity: channel}, activations: {dtype: int8, dynamic: false, symmetric: false}}"
         "\nformat: torchao", "scheme.activations.symmetric"),
        ("scheme: {weights: {dtype: int8, granularity: channel}}\nformat: torchao\nalgorithm: {name: gptq, blocksize: 64}",
         "algorithm.blocksize"),
        ("scheme: {weights: {dtype: int8, granularity: channel}}\nformat: torchao\nalgorithm: {name: gptq, actorder: 1}",
         "algorithm.actorder"),
        ("scheme: {weights: {dtype: int8, granularity: channel}}\nformat: torchao\nalgorithm: [{name: gptq}, {name: smoothquant}]",
         "algorithm"),
        ("scheme: {weights: {dtype: int8, granularity: channel}}\nformat: torchao\ncalibration: {num_samples: many}",
         "calibration.num_samples"),
        ("scheme: {weights: {dtype: int8, granularity: channel, observer: best}}\nformat: torchao", "scheme.weights.observer"),
        ("scheme: {weights: {dtype: float8_e4m3fn, granularity: channel, observer: mse}}\nformat: torchao",
         "scheme.weights.observer"),
        ("scheme: {weights: {dtype: int8, granularity: channel}, activations: {dtype: int8, dynamic: false, observer: ema}}"
         "\nformat: torchao", "scheme.activations.observer"),
        ("scheme: {weights: {dtype: int4, granularity: channel, symmetric: maybe}}\nformat: torchao", "scheme.weights.symmetric"),
        ("scheme: {weights: {dtype: int4, granularity: channel}}\nformat: torchao\nkv_cache: int8", "kv_cache"),
        ("scheme: {weights: {dtype: int4, granularity: channel}}\nformat: torchao\nkv_cache: {dtype: int8}", "kv_cache.dtype"),
        ("scheme: {weights: {dtype: int4, granularity: channel}}\nformat: torchao\nkv_cache: {granularity: token}",
         "kv_cache.granularity"),
        ("scheme: {weights: {dtype: int4, granularity: channel}}\nformat: torchao\nkv_cache: {scale: 1}", "kv_cache.scale"),
        # misspelt keys inside the scheme: each would leave its default and write another scheme than asked for
        ("scheme: {weights: {dtype: int4, granularity: channel, symetric: false}}\nformat: torchao", "scheme.weights.symetric"),
        ("scheme: {weights: {dtype: int8, granularity: channel}, activation: {dtype: int8}}\nformat: torchao",
         "scheme.activation: unknown key"),
        ("scheme: {weights: {dtype: int8, granularity: channel}, activations: {dtype: int8, dynamc: false}}\nformat: torchao",
         "scheme.activations.dynamc"),
        ("scheme: {weights: {dtype: int8, granularity: channel}}\nformat: torchao\ncalibration: {num_samples: 0}",
         "calibration.num_samples: 0 is not allowed; use at least 1"),
        ("scheme: {weights: {dtype: int8, granularity: channel}}\nformat: torchao\ncalibration: {seq_len: -5}",
         "calibration.seq_len: -5 is not allowed; use at least 2"),
    ],
)
def test_invalid_recipe_names_the_field(tmp_path, body, field):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(RecipeError, match=field.replace(".", r"\.")):
        registry.resolve(str(path))


def test_invalid_yaml_syntax(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("scheme: [unclosed")
    with pytest.raises(RecipeError, match="not valid YAML"):
        registry.resolve(str(path))


def test_yaml_is_never_executed(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("scheme: !!python/object/apply:os.system ['echo pwned']\nformat: torchao")
    with pytest.raises(RecipeError):
        registry.resolve(str(path))


def test_to_dict_is_json_ready():
    import json

    data = registry.resolve("int4-weight-only").to_dict()
    assert json.loads(json.dumps(data))["scheme"]["weights"]["group_size"] == 128
    assert data["on_indivisible"] == IndivisiblePolicy.SMALLER_GROUP.value


def test_every_algorithm_is_one_object_with_arguments_and_a_way_to_run():
    """An algorithm is one registered object: its argument dataclass (defaults filled in from nothing), and a
    calibration layer step (its own, or the data-free quantizers' one, which needs its weight function)."""
    from quantkit import algorithms
    from quantkit.calibration.steps import step_of

    for name in algorithms.names():
        algorithm = algorithms.get(name)
        assert algorithm.name == name and algorithm.arguments({}) == algorithm.Arguments()
        assert callable(step_of(algorithm)), name
        if algorithm.step is None:  # no step of its own: a data-free quantizer, run weight by weight
            assert algorithm.quantizer and not algorithm.needs_data, name
            assert type(algorithm).quantize_weight is not algorithms.Algorithm.quantize_weight, name


@pytest.mark.parametrize(
    "algorithm, field",
    [("{name: gptq, block_size: 0}", "algorithm.block_size"), ("{name: gptq, dampening_frac: -1}", "algorithm.dampening_frac"),
     ("[{name: awq, grid: 0}, {name: rtn}]", r"algorithm\[0\].grid"),
     ("[{name: smoothquant, alpha: 2}, {name: gptq}]", r"algorithm\[0\].alpha"),
     ("[{name: smoothquant, alpha: true}, {name: gptq}]", r"algorithm\[0\].alpha")],
)
def test_out_of_range_algorithm_arguments_name_the_field(tmp_path, algorithm, field):
    path = tmp_path / "bad.yaml"
    path.write_text(f"scheme: {{weights: {{dtype: int8, granularity: channel}}}}\nformat: compressed-tensors\nalgorithm: {algorithm}")
    with pytest.raises(RecipeError, match=field):
        registry.resolve(str(path))


def test_integer_arguments_for_float_fields_become_floats(tmp_path):
    path = tmp_path / "sq.yaml"
    path.write_text("scheme: {weights: {dtype: int8, granularity: channel}}\nformat: compressed-tensors\n"
                    "algorithm: [{name: smoothquant, alpha: 1}, {name: gptq}]")
    step = registry.resolve(str(path)).steps[0]
    assert step.args == {"alpha": 1.0} and isinstance(step.arguments.alpha, float)


def test_recipes_resolve_without_importing_torch():
    """`quantkit recipes list` stays fast: the registry and the algorithms' arguments import no torch."""
    import subprocess
    import sys

    code = ("import sys, quantkit.quant.registry as r; [r.resolve(n) for n in r.recipe_names()]; "
            "import quantkit.cli.main; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_kv_cache_is_a_recipe_field_or_a_finalize_flag(tmp_path):
    path = tmp_path / "w4-kv.yaml"
    path.write_text("scheme: {weights: {dtype: int4, granularity: group, group_size: 32}}\nformat: compressed-tensors\n"
                    "kv_cache: {granularity: head, observer: minmax}")
    recipe = registry.resolve(str(path))
    assert recipe.kv_cache == KVCacheSpec(granularity=Granularity.HEAD, observer="minmax") and recipe.needs_calibration
    plain = registry.resolve("int4-weight-only")
    assert plain.kv_cache is None and not plain.needs_calibration
    assert registry.with_kv_cache(plain, "fp8").kv_cache == KVCacheSpec()
    assert registry.with_kv_cache(plain, "fp8").needs_calibration
    assert registry.with_kv_cache(recipe, "none").kv_cache is None
    assert registry.with_kv_cache(recipe, None) is recipe
    with pytest.raises(RecipeError, match="--kv-cache 'int8' is not allowed; use fp8, fp8-head or none"):
        registry.with_kv_cache(plain, "int8")


# ---------------------------------------------------------------- transforms: rotations before quantization


def _with_transforms(tmp_path, transforms: str):
    path = tmp_path / "rotated.yaml"
    path.write_text("scheme: {weights: {dtype: int4, granularity: group, group_size: 32}}\nformat: compressed-tensors\n"
                    f"transforms: {transforms}\n")
    return path


def test_transforms_parse_and_name_the_algorithm(tmp_path):
    recipe = registry.resolve(str(_with_transforms(tmp_path, "[{type: random-hadamard, rotations: [R1], seed: 7}]")))
    (transform,) = recipe.transforms
    assert (transform.type.value, transform.rotations, transform.seed) == ("random-hadamard", ("R1",), 7)
    assert recipe.describe_algorithm() == "R1 + rtn" and recipe.fused_rotations == recipe.transforms
    assert registry.resolve("quarot-nvfp4").describe_algorithm() == "R1+R2 + rtn"


def test_an_online_r4_is_its_own_transform_beside_the_fused_ones(tmp_path):
    recipe = registry.resolve(str(_with_transforms(
        tmp_path, "[{type: hadamard, rotations: [R1, R2]}, {type: random-hadamard, rotations: [R4], online: true}]")))
    fused, online = recipe.transforms
    assert recipe.fused_rotations == (fused,) and recipe.online_rotations == (online,)
    assert (online.type.value, online.rotations, online.online) == ("random-hadamard", ("R4",), True)
    assert recipe.describe_algorithm() == "R1+R2+R4 + rtn"


def test_learned_rotations_parse_with_defaults_and_show_only_where_given(tmp_path):
    recipe = registry.resolve(str(_with_transforms(
        tmp_path, "[{type: random-hadamard, rotations: [R1, R2], learn: {steps: 20}}, "
                  "{type: hadamard, rotations: [R4], online: true}]")))
    learned, online = recipe.transforms
    assert learned.learn == registry.Learning(steps=20, learning_rate=1.5) and online.learn is None
    assert recipe.learned_rotations is learned and recipe.needs_samples and not recipe.needs_calibration
    assert recipe.describe_algorithm() == "R1+R2 (learned)+R4 + rtn"
    shown = recipe.to_dict()["transforms"]
    assert shown[0]["learn"] == {"steps": 20, "learning_rate": 1.5} and "learn" not in shown[1]
    assert "learn" not in registry.resolve("quarot-nvfp4").to_dict()["transforms"][0]  # as quantkit.json had it
    assert not registry.resolve("quarot-w4a8").needs_samples
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(recipe.to_file()))
    assert registry.resolve(str(again)).transforms == recipe.transforms
    assert registry.resolve(str(_with_transforms(tmp_path, "[{rotations: [R1], learn: {}}]"))).transforms[0].learn == \
        registry.Learning()


@pytest.mark.parametrize("transforms, message", [
    ("[{type: hadamard, rotations: [R4], online: true, learn: {}}]", "learns fused rotations \\(R1, R2\\) only"),
    ("[{rotations: [R1], learn: 100}]", "learn: is a mapping"),
    ("[{rotations: [R1], learn: {steps: 0}}]", "learn.steps: is an integer >= 1"),
    ("[{rotations: [R1], learn: {learning_rate: -1}}]", "learn.learning_rate: is a number > 0"),
    ("[{rotations: [R1], learn: {epochs: 2}}]", "learn.epochs: unknown key"),
    ("[{rotations: [R1], learn: {}}, {rotations: [R2], learn: {}}]", "learn: is given once"),
])
def test_bad_learned_rotations_are_refused_naming_the_field(tmp_path, transforms, message):
    with pytest.raises(RecipeError, match=message):
        registry.resolve(str(_with_transforms(tmp_path, transforms)))


@pytest.mark.parametrize("transforms, message", [
    ("[{type: hadamard, rotations: [R4]}]", "R4 is applied to activations at run time: give it with online: true"),
    ("[{type: hadamard, rotations: [R1, R4], online: true}]", "R1 is fused into the weights, not online"),
    ("[{type: hadamard, rotations: [R3], online: true}]", "R3 \\(online, inside attention\\) is not supported"),
    ("[{type: hadamard, rotations: [R5]}]", "'R5' is not a rotation"),
    ("[{type: hadamard, rotations: [R1]}, {type: random-hadamard, rotations: [R1]}]", "R1 is given twice"),
    ("[{type: hadamard, seed: 3}]", "random-hadamard's"),
    ("[{type: givens}]", "transforms\\[0\\].type"),
    ("[{type: hadamard, angle: 3}]", "unknown key"),
    ("{type: hadamard}", "is a list"),
])
def test_bad_transforms_are_refused_naming_the_field(tmp_path, transforms, message):
    with pytest.raises(RecipeError, match=message):
        registry.resolve(str(_with_transforms(tmp_path, transforms)))
