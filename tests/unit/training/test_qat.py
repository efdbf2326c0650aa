"""QAT fake quantizers see exactly the recipe's grid (atol=0), train, strip and re-prepare in place."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantkit.export.torchao import torchao_config
from quantkit.export.torchao import unsupported as torchao_unsupported
from quantkit.models.architectures import kernel_fused_groups
from quantkit.quant import registry
from quantkit.quant.plan import plan_model
from quantkit.grids import fake_quantize_weight
from quantkit.grids.qparams import fused_global_scales
from quantkit.grids.schemes import Granularity, QDtype, QuantScheme, ScaleDtype, WeightSpec
from quantkit.quant import fake_quant
from quantkit.training import qat

DTYPES = [torch.float32, torch.bfloat16]
RECIPES = [name for name in registry.recipe_names() if qat.qat_ready(registry.resolve(name))]
TORCHAO_RECIPES = [name for name in RECIPES if torchao_unsupported(registry.resolve(name)) is None]  # a torchao PTQ config to compare with
INT_RECIPES = [name for name in TORCHAO_RECIPES if not registry.resolve(name).scheme.weights.dtype.is_float]
EXACT = dict(atol=0, rtol=0)
PLAN_RECIPES = [name for name in RECIPES if registry.resolve(name).mixture is None]  # a mixture's plan: per tensor, below


def _weight(dtype, out=48, inp=256, seed=0, tiny_groups=True):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inp, generator=generator) * 0.05
    if tiny_groups:
        weight[0, :32] = 0  # an all-zero group
        weight[1, :32] = 1e-8  # a group whose scale is clamped to eps: a different eps would show here
    return weight.to(dtype)


def _artifact_grid(weight, spec, global_scale=None):
    """The weight `finalize` writes: FP4 / MX artifacts of a float32 model are bfloat16, so their grid is."""
    if spec.sixteen_bit and weight.dtype == torch.float32:
        return fake_quantize_weight(weight.bfloat16(), spec, global_scale).float()
    return fake_quantize_weight(weight, spec, global_scale)


def _linear(weight, bias=True):
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias).to(weight.dtype)
    linear.weight.data = weight.clone()
    return linear


def _load(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)


def _loss(model, seed=0):
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    return model(input_ids=ids, labels=ids).loss


# ---------------------------------------------------------------- the grid, module by module

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", RECIPES)
def test_fake_quantized_weight_equals_qparams(name, dtype):
    scheme = registry.resolve(name).scheme
    weight = _weight(dtype)
    module = fake_quant.QATLinear(_linear(weight), scheme)
    torch.testing.assert_close(module.fake_quantized_weight(), _artifact_grid(weight, scheme.weights), **EXACT)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "spec",
    [
        WeightSpec(QDtype.INT4, Granularity.GROUP, 32, symmetric=False),
        WeightSpec(QDtype.INT8, Granularity.CHANNEL, symmetric=False, scale_dtype=ScaleDtype.FLOAT32),
        WeightSpec(QDtype.INT4, Granularity.GROUP, 64, scale_dtype=ScaleDtype.FLOAT32),
        WeightSpec(QDtype.FLOAT8, Granularity.CHANNEL, scale_dtype=ScaleDtype.MODEL),
        WeightSpec(QDtype.INT3, Granularity.GROUP, 32),
    ],
    ids=["int4-asym", "int8-asym", "int4-fp32-scale", "fp8-model-scale", "int3"],
)
def test_grids_beyond_the_shipped_recipes_are_exact(spec, dtype):
    weight = _weight(dtype)
    module = fake_quant.QATLinear(_linear(weight), QuantScheme(spec))
    torch.testing.assert_close(module.fake_quantized_weight(), fake_quantize_weight(weight, spec), **EXACT)


def test_configs_use_torchao_where_it_is_exact_and_quantkit_elsewhere():
    from torchao.quantization.qat import Float8FakeQuantizeConfig, IntxFakeQuantizeConfig

    def kinds(name):
        return tuple(type(c).__name__ for c in fake_quant.fake_quantize_configs(registry.resolve(name).scheme))

    assert {name: kinds(name) for name in RECIPES} == {
        "float8-dynamic-act-float8-weight": (Float8FakeQuantizeConfig.__name__,) * 2,
        "fp8-block": ("GroupActivationFakeQuantizeConfig", "GridFakeQuantizeConfig"),
        "int4-asym": ("NoneType", "GridFakeQuantizeConfig"),
        "mxfp4": ("GroupActivationFakeQuantizeConfig", "GridFakeQuantizeConfig"),
        "mxfp4-a16": ("NoneType", "GridFakeQuantizeConfig"),
        "mxfp8": ("GroupActivationFakeQuantizeConfig", "GridFakeQuantizeConfig"),
        "nvfp4-a16": ("NoneType", "GridFakeQuantizeConfig"),
        "nvfp4": ("GroupActivationFakeQuantizeConfig", "GridFakeQuantizeConfig"),
        "quarot-nvfp4": ("GroupActivationFakeQuantizeConfig", "GridFakeQuantizeConfig"),
        "quarot-w4a8": (IntxFakeQuantizeConfig.__name__,) * 2,
        "quarot-w4a8-fp8": (Float8FakeQuantizeConfig.__name__, IntxFakeQuantizeConfig.__name__),
        "w4a8-fp8": (Float8FakeQuantizeConfig.__name__, IntxFakeQuantizeConfig.__name__),
        "int2-weight-only": ("NoneType", IntxFakeQuantizeConfig.__name__),
        "int4-weight-only": ("NoneType", IntxFakeQuantizeConfig.__name__),
        "int8-dynamic-act-int4-weight": (IntxFakeQuantizeConfig.__name__,) * 2,
        "int8-dynamic-act-int8-weight": ("Int8TokenFakeQuantizeConfig", IntxFakeQuantizeConfig.__name__),
        "int8-weight-only": ("NoneType", IntxFakeQuantizeConfig.__name__),
        "mlx-3bit-g64": ("NoneType", "GridFakeQuantizeConfig"),  # MLX's float bias: quantkit's grid exactly
        "mlx-4bit-g64": ("NoneType", "GridFakeQuantizeConfig"),
        "mlx-5bit-g64": ("NoneType", "GridFakeQuantizeConfig"),
        "mlx-6bit-g64": ("NoneType", "GridFakeQuantizeConfig"),
        "mlx-8bit-g64": ("NoneType", "GridFakeQuantizeConfig"),
        "mlx-nvfp4": ("NoneType", "GridFakeQuantizeConfig"),  # FP4 under FP8 scales alone, mx.quantize's ties
        "gguf-q4-0": ("NoneType", "GridFakeQuantizeConfig"),  # fp16 scales: quantkit's grid exactly
        "gguf-q4-1": ("NoneType", "GridFakeQuantizeConfig"),
        "gguf-q8-0": ("NoneType", "GridFakeQuantizeConfig"),
        "gguf-q2-k": ("NoneType", "BlockGridFakeQuantizeConfig"),  # llama.cpp's K search (trained as rtn: training_recipe)
        "gguf-q3-k-m": ("NoneType", "BlockGridFakeQuantizeConfig"),
        "gguf-q4-k-m": ("NoneType", "BlockGridFakeQuantizeConfig"),
        "gguf-q5-k-m": ("NoneType", "BlockGridFakeQuantizeConfig"),
        **{name: ("NoneType", "BlockGridFakeQuantizeConfig") for name in ("gguf-q2-k-s", "gguf-q3-k-s", "gguf-q3-k-l",
                                                                           "gguf-q4-k-s", "gguf-q5-k-s", "gguf-q6-k")},
        "gguf-mxfp4": ("NoneType", "GridFakeQuantizeConfig"),  # the MXFP4 grid, as mxfp4-a16
        "gguf-iq4-nl": ("NoneType", "BlockGridFakeQuantizeConfig"),  # llama.cpp's IQ4 search
    }
    asym = WeightSpec(QDtype.INT4, Granularity.GROUP, 32, symmetric=False)
    assert isinstance(fake_quant.fake_quantize_configs(QuantScheme(asym))[1], fake_quant.GridFakeQuantizeConfig)


def test_model_dtype_scales_follow_a_later_cast():
    scheme = registry.resolve("int4-weight-only").scheme
    module = fake_quant.QATLinear(_linear(_weight(torch.float32)), scheme).to(torch.bfloat16)
    expected = fake_quantize_weight(module.weight.data, scheme.weights)
    torch.testing.assert_close(module.fake_quantized_weight(), expected, **EXACT)


@pytest.mark.parametrize("name", ["grid", *RECIPES])
def test_fake_quantizers_are_straight_through(name):
    if name == "grid":
        configs = [fake_quant.GridFakeQuantizeConfig(WeightSpec(QDtype.INT4, Granularity.GROUP, 32, symmetric=False))]
    else:
        configs = [c for c in fake_quant.fake_quantize_configs(registry.resolve(name).scheme) if c is not None]
    for config in configs:
        weight = _weight(torch.float32).requires_grad_(True)
        grad = torch.randn_like(weight)
        fake_quant.fake_quantizer(config)(weight).backward(grad)
        torch.testing.assert_close(weight.grad, grad, **EXACT)


# ---------------------------------------------------------------- activations vs torchao's PTQ runtime

# Measured max |QAT - PTQ| on this input (max|y| ~5.5): int4 recipes 0 (the runtime dequantizes and calls
# F.linear, as QAT does). int8 recipes: float32 1.4e-6 (act) and 2.5e-6 (weight-only), i.e. 2.6e-7 and 4.6e-7
# of max|y|; bfloat16 0.03125, one bf16 ulp (5.7e-3 of max|y|): torchao multiplies the int8 data and applies
# the scales afterwards, a different rounding order. The bounds leave about 2x headroom.
# No tiny groups here: torchao's intx PTQ clamps scales at float's smallest normal, not at float32 eps as
# quantkit.grids.qparams does, so a group with max|w| < 7.5 * eps (~9e-7) gets a different grid there.
REL_TOL = {torch.float32: 1e-6, torch.bfloat16: 2**-6}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", INT_RECIPES)
def test_prepared_linear_matches_torchao_ptq(name, dtype):
    from torchao.quantization import quantize_

    scheme = registry.resolve(name).scheme
    linear = _linear(_weight(dtype, out=96, tiny_groups=False))
    x = (torch.randn(2, 7, 256, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    with torch.no_grad():
        ours = fake_quant.QATLinear(copy.deepcopy(linear), scheme)(x)
        ptq = copy.deepcopy(linear)
        quantize_(ptq, torchao_config(scheme))
        theirs = ptq(x)
    exact = scheme.weights.dtype is QDtype.INT4
    atol = 0 if exact else REL_TOL[dtype] * theirs.abs().max().item()
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_float8_activations_match_the_runtime_quantizer(dtype):
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    act_config, _ = fake_quant.fake_quantize_configs(registry.resolve("float8-dynamic-act-float8-weight").scheme)
    x = (torch.randn(2, 7, 256, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    theirs = Float8Tensor.from_hp(x, granularity=PerRow()).dequantize()  # the CPU ("torch") quantize kernel
    torch.testing.assert_close(fake_quant.fake_quantizer(act_config)(x), theirs, **EXACT)


def _has_float8_kernels() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _has_float8_kernels(), reason="torchao float8 PTQ needs CUDA 8.9+")
def test_float8_prepared_linear_matches_torchao_ptq_on_cuda():
    # Not yet measured on a GPU; torchao's mslk kernel accumulates fast and returns bfloat16, hence the bound.
    from torchao.quantization import quantize_

    scheme = registry.resolve("float8-dynamic-act-float8-weight").scheme
    linear = _linear(_weight(torch.bfloat16, out=96, tiny_groups=False)).cuda()
    x = torch.randn(2, 7, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ours = fake_quant.QATLinear(copy.deepcopy(linear), scheme)(x)
        ptq = copy.deepcopy(linear)
        quantize_(ptq, torchao_config(scheme))
        theirs = ptq(x)
    torch.testing.assert_close(ours, theirs, atol=2**-6 * theirs.abs().max().item(), rtol=0)


# ---------------------------------------------------------------- a whole model

def _recipe_with_a_skipped_module(name):
    """The recipe with one more module left out, and lm_head (which MLX recipes quantize); FP8 blocks of 16x16 and
    activation groups of 16 (128 fits none of the tiny model's Linears)."""
    recipe = registry.resolve(name)
    if recipe.scheme.weights.granularity is Granularity.BLOCK:
        recipe = dataclasses.replace(recipe, scheme=QuantScheme(
            dataclasses.replace(recipe.scheme.weights, block_shape=(16, 16)),
            dataclasses.replace(recipe.scheme.activations, group_size=16)))
    return dataclasses.replace(recipe, ignore=(*recipe.ignore, "lm_head", "re:layers\\.1\\.mlp\\.up_proj"))


@pytest.mark.parametrize("name", PLAN_RECIPES)
def test_prepare_installs_exactly_the_plan_and_trains(name, tiny_model_dir):
    model = _load(tiny_model_dir)
    plan = plan_model(model, _recipe_with_a_skipped_module(name))
    keys, params = list(model.state_dict()), {n: id(p) for n, p in model.named_parameters()}
    fake_quant.prepare(model, plan)

    assert fake_quant.is_prepared(model)
    assert fake_quant.prepared_schemes(model) == {e.name: e.scheme for e in plan if e.quantized}
    for entry in plan:
        assert isinstance(model.get_submodule(entry.name), fake_quant.QATLinear) is entry.quantized
    assert type(model.lm_head) is nn.Linear and type(model.get_submodule("model.layers.1.mlp.up_proj")) is nn.Linear
    assert list(model.state_dict()) == keys and {n: id(p) for n, p in model.named_parameters()} == params

    weights = {e.name: model.get_submodule(e.name).weight.detach() for e in plan if e.quantized}
    schemes = fake_quant.prepared_schemes(model)
    nvfp4 = {name: weight.bfloat16() for name, weight in weights.items() if schemes[name].weights.global_scale}
    global_scales = fused_global_scales(nvfp4, kernel_fused_groups(list(nvfp4)))  # NVFP4: shared by q/k/v, by gate/up
    for module_name, seen in fake_quant.fake_quantized_weights(model).items():
        entry = next(e for e in plan if e.name == module_name)
        expected = _artifact_grid(weights[module_name], entry.scheme.weights, global_scales.get(module_name))
        torch.testing.assert_close(seen, expected, **EXACT)

    _loss(model).backward()
    prepared = [model.get_submodule(e.name).weight for e in plan if e.quantized]
    assert all(w.requires_grad and w.grad is not None and w.grad.abs().sum() > 0 for w in prepared)
    before = [w.detach().clone() for w in prepared]
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert all(not torch.equal(b, w) for b, w in zip(before, prepared))


def test_group_size_fallbacks_are_per_module(tiny_model_dir):
    model = fake_quant.prepare(_load(tiny_model_dir), plan_model(_load(tiny_model_dir), registry.resolve("int4-weight-only")))
    schemes = fake_quant.prepared_schemes(model)
    assert schemes["model.layers.0.self_attn.q_proj"].weights.group_size == 64  # input 64
    assert schemes["model.layers.0.mlp.down_proj"].weights.group_size == 16  # input 176


def test_bfloat16_model_sees_the_bfloat16_grid(tiny_model_dir):
    model = _load(tiny_model_dir, torch.bfloat16)
    plan = plan_model(model, registry.resolve("int8-dynamic-act-int4-weight"))
    seen = fake_quant.fake_quantized_weights(fake_quant.prepare(model, plan))
    for entry in (e for e in plan if e.quantized):
        weight = model.get_submodule(entry.name).weight.detach()
        torch.testing.assert_close(seen[entry.name], fake_quantize_weight(weight, entry.scheme.weights), **EXACT)


def test_prepare_twice_is_an_error(tiny_model_dir):
    model = _load(tiny_model_dir)
    plan = plan_model(model, registry.resolve("int4-weight-only"))
    fake_quant.prepare(model, plan)
    with pytest.raises(ValueError, match="strip"):
        fake_quant.prepare(model, plan)


def test_strip_restores_plain_linears_with_the_same_weights(tiny_model_dir):
    model = _load(tiny_model_dir)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    fake_quant.prepare(model, plan_model(model, registry.resolve("int8-dynamic-act-int4-weight")))
    fake_quant.strip(model)
    assert not fake_quant.is_prepared(model)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert weights.keys() == dict(model.named_parameters()).keys()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), weights[n], **EXACT)


def test_stripped_saves_a_plain_checkpoint_and_keeps_parameter_identity(tiny_model_dir, tmp_path):
    model = _load(tiny_model_dir)
    fake_quant.prepare(model, plan_model(model, registry.resolve("int8-dynamic-act-int8-weight")))
    schemes, ids = fake_quant.prepared_schemes(model), [id(p) for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with fake_quant.stripped(model):
        assert not fake_quant.is_prepared(model)
        model.save_pretrained(tmp_path)
    assert fake_quant.prepared_schemes(model) == schemes and [id(p) for p in model.parameters()] == ids

    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    _loss(model).backward()
    optimizer.step()  # built before stripped(): still updates the model's weights
    assert not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight)

    reloaded = _load(tmp_path)
    assert all(type(m) is nn.Linear for m in reloaded.modules() if isinstance(m, nn.Linear))
    torch.testing.assert_close(reloaded.model.layers[0].self_attn.q_proj.weight, before, **EXACT)


def test_calibrated_recipes_are_refused_for_qat():
    from quantkit.errors import UsageError

    for name in ("gptq-w4a16", "fp8-static", "smoothquant-w8a8", "awq-nvfp4-a16"):
        with pytest.raises(UsageError, match="round-to-nearest"):
            qat.check_recipe(registry.resolve(name))
    qat.check_recipe(registry.resolve("int4-weight-only"))
    qat.check_recipe(registry.resolve("nvfp4"))  # only its activations' global scale is calibrated, by finalize
    qat.check_recipe(registry.resolve("gguf-q4-k-m"))  # GPTQ on K grids: trained and converted by rounding (below)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_activations_take_each_tensors_global_scale(dtype):
    """NVFP4 W4A4 QAT: the activations as compressed-tensors' runtime quantizes them, under the tensor's own
    global scale (finalize calibrates the deployed one over the calibration data), the weights on the grid."""
    from quantkit.grids import float_grids
    scheme = registry.resolve("nvfp4").scheme
    linear = _linear(_weight(dtype, out=32, inp=64, tiny_groups=False))
    x = (torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    with torch.no_grad():
        ours = fake_quant.QATLinear(copy.deepcopy(linear), scheme)(x)
    acts = float_grids.fake_quantize_nvfp4(x, float_grids.global_scale(x.abs().amax()))
    expected = F.linear(acts, _artifact_grid(linear.weight.data, scheme.weights), linear.bias)
    torch.testing.assert_close(ours, expected, **EXACT)
    assert not torch.equal(acts, x)


# ---------------------------------------------------------------- llama.cpp's K grids (GGUF mixtures)

K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module")
def k_model_dir(tmp_path_factory):
    """A tiny float32 Llama with whole K super-blocks (hidden 256) and rows that are not (intermediate 352: down_proj
    falls back to blocks of 32), grouped KV heads."""
    from conftest import make_text
    from quantkit.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "k-llama", make_text(2000), hidden_size=256,
                            intermediate_size=352, num_attention_heads=4, num_key_value_heads=2)


def _k_scheme(qtype: str) -> QuantScheme:
    from quantkit.quant.gguf_mixtures import k_spec

    return QuantScheme(k_spec(qtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_forward_is_the_dequantized_weight_finalize_writes(qtype, dtype):
    """The fake-quantized forward of a Linear under a K type is F.linear on llama.cpp's quantization of its weight
    (`k_grids.quantize_k`: the codes and grid the GGUF file holds), decoded, bit for bit."""
    from gguf import GGMLQuantizationType

    from quantkit.grids.k_grids import quantize_k

    weight = _weight(dtype, out=32, inp=512)
    linear = _linear(weight)
    x = torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(2)).to(dtype)
    written = quantize_k(weight, GGMLQuantizationType[qtype]).dequantize().to(dtype)
    module = fake_quant.QATLinear(copy.deepcopy(linear), _k_scheme(qtype)).train()
    with torch.no_grad():
        torch.testing.assert_close(module(x), F.linear(x, written, linear.bias), **EXACT)
    torch.testing.assert_close(module.fake_quantized_weight(), written, **EXACT)
    assert not torch.equal(written, weight)


def test_k_grid_is_searched_every_n_training_calls_and_at_every_eval_call():
    """Training rounds the current weights on the last grid searched, for `refresh_every` calls; eval searches."""
    from gguf import GGMLQuantizationType

    from quantkit.grids.k_grids import choose_k_qparams, quantize_k, round_k

    spec = _k_scheme("Q4_K").weights
    quantizer = fake_quant.fake_quantizer(fake_quant.BlockGridFakeQuantizeConfig(spec, refresh_every=2)).train()
    first = _weight(torch.float32, out=16, inp=256)
    later = first * 1.5 + 0.01  # a grid searched on `first` does not fit it
    grid = choose_k_qparams(first, GGMLQuantizationType.Q4_K)
    on_grid = lambda w: grid.dequantize(round_k(w, grid))  # noqa: E731
    fresh = lambda w: quantize_k(w, GGMLQuantizationType.Q4_K).dequantize()  # noqa: E731
    torch.testing.assert_close(quantizer(first), fresh(first), **EXACT)
    torch.testing.assert_close(quantizer(later), on_grid(later), **EXACT)  # call 2: the grid of call 1
    assert not torch.equal(on_grid(later), fresh(later))
    torch.testing.assert_close(quantizer(later), fresh(later), **EXACT)  # call 3: searched again
    quantizer(first)
    torch.testing.assert_close(quantizer.eval()(later), fresh(later), **EXACT)


def test_k_fake_quantizer_is_straight_through():
    weight = _weight(torch.float32, out=16, inp=256).requires_grad_(True)
    grad = torch.randn_like(weight)
    fake_quant.fake_quantizer(fake_quant.BlockGridFakeQuantizeConfig(_k_scheme("Q6_K").weights))(weight).backward(grad)
    torch.testing.assert_close(weight.grad, grad, **EXACT)


def test_a_k_grid_config_takes_a_k_grid():
    with pytest.raises(ValueError, match="searched block grid"):
        fake_quant.BlockGridFakeQuantizeConfig(registry.resolve("gguf-q4-0").scheme.weights)
    with pytest.raises(ValueError, match="refresh_every"):
        fake_quant.BlockGridFakeQuantizeConfig(_k_scheme("Q4_K").weights, refresh_every=0)


def test_k_recipes_train_and_convert_by_rounding_on_their_grids():
    """GPTQ on K grids trains as round to nearest on them (llama.cpp's own quantizer); other recipes are unchanged."""
    for name in ("gguf-q2-k", "gguf-q3-k-m", "gguf-q4-k-m", "gguf-q5-k-m"):
        recipe = registry.resolve(name)
        trained = qat.training_recipe(recipe)
        assert [s.name for s in trained.steps] == ["rtn"] and not trained.needs_calibration
        assert (trained.name, trained.scheme, trained.mixture) == (recipe.name, recipe.scheme, recipe.mixture)
    for name in ("gguf-q4-0", "gptq-w4a16", "int4-weight-only"):
        assert qat.training_recipe(registry.resolve(name)) == registry.resolve(name)


def test_a_mixture_trains_each_tensor_on_the_type_finalize_writes(k_model_dir):
    """QAT's plan is finalize's (`checks.prepare`): Q4_K_M's Q4_K, Q6_K on lm_head and where more_bits, down_proj on
    Q4_K's fallback Q5_0 (352 inputs are not whole super-blocks); every fake-quantized weight is the one finalize
    would write for these weights."""
    from quantkit.export.gguf import ggml_type
    from quantkit.finalization.checks import prepare

    recipe = registry.resolve("gguf-q4-k-m")
    model = _load(k_model_dir)
    found = qat.plan(model, recipe)
    assert [(e.name, e.scheme) for e in found] == [(e.name, e.scheme) for e in prepare(k_model_dir, recipe).plan]
    weights = {e.name: model.get_submodule(e.name).weight.detach().clone() for e in found if e.quantized}
    fake_quant.prepare(model, found)
    kinds = {name: ggml_type(scheme.weights).name for name, scheme in fake_quant.prepared_schemes(model).items()}
    assert kinds["lm_head"] == "Q6_K" and kinds["model.layers.0.self_attn.q_proj"] == "Q4_K"
    assert (kinds["model.layers.0.self_attn.v_proj"], kinds["model.layers.1.self_attn.v_proj"]) == ("Q4_K", "Q6_K")
    assert kinds["model.layers.0.mlp.down_proj"] == "Q5_0" and kinds["model.layers.1.mlp.down_proj"] == "Q8_0"
    for name, seen in fake_quant.fake_quantized_weights(model).items():
        scheme = fake_quant.prepared_schemes(model)[name]
        torch.testing.assert_close(seen, fake_quantize_weight(weights[name], scheme.weights), **EXACT, msg=name)


def test_gradients_flow_through_a_mixture_and_the_loss_falls(k_model_dir):
    model = _load(k_model_dir).train()
    fake_quant.prepare(model, qat.plan(model, registry.resolve("gguf-q4-k-m")))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss = _loss(model)
        loss.backward()
        assert all(m.weight.grad.abs().sum() > 0 for m in model.modules() if isinstance(m, fake_quant.QATLinear))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_a_mixtures_token_embedding_trains_on_its_k_grid(k_model_dir):
    """Q4_K_M quantizes token_embd (Q4_K, llama.cpp's rounding: `export.gguf.quantize_embedding`): QAT looks up rows
    of exactly that weight, straight through to the float Parameter; strip() and stripped() give the embedding back."""
    from gguf import GGMLQuantizationType

    from quantkit.grids.k_grids import quantize_k

    recipe = registry.resolve("gguf-q4-k-m")
    model = _load(k_model_dir).train()
    embedding = model.get_input_embeddings()
    spec = qat.embedding(model, recipe)
    assert spec is not None and spec.k_quant_type == "Q4_K"
    assert qat.embedding(model, registry.resolve("gguf-q4-0")) is None  # a single type: token_embd left in float
    fake_quant.prepare(model, qat.plan(model, recipe), spec)
    installed = model.get_input_embeddings()
    assert isinstance(installed, fake_quant.QATEmbedding) and installed.weight is embedding.weight
    written = quantize_k(embedding.weight.detach(), GGMLQuantizationType.Q4_K).dequantize()
    ids = torch.tensor([[0, 5, 17, 3]])
    torch.testing.assert_close(installed(ids), written[ids], **EXACT)
    torch.testing.assert_close(fake_quant.fake_quantized_weights(model)["model.embed_tokens"], written, **EXACT)
    assert not model.config.tie_word_embeddings  # the embedding's gradient comes through its lookup alone
    _loss(model).backward()
    assert embedding.weight.grad is not None and embedding.weight.grad.abs().sum() > 0
    with fake_quant.stripped(model):
        assert type(model.get_input_embeddings()) is torch.nn.Embedding
    assert isinstance(model.get_input_embeddings(), fake_quant.QATEmbedding)
    fake_quant.strip(model)
    assert type(model.get_input_embeddings()) is torch.nn.Embedding and model.get_input_embeddings().weight is embedding.weight
