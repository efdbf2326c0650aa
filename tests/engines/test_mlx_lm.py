"""quantkit's MLX directories read by mlx itself (`make test-mlx`; marked `mlx`).

mlx runs in its own environment (mlx[cpu] and mlx-lm: `make test-mlx` builds ~/.cache/quantkit/mlx-venv, MLX_PYTHON
names another), through tests/engines/mlx_worker.py in a subprocess; this module skips, saying so, where that Python
is missing or cannot import mlx_lm.

For tiny random models of each architecture quantkit writes for mlx-lm (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
Gemma2, Gemma3, Phi-3; hidden 128, MLP 256: every group size divides them), in float32 and bfloat16, under MLX's own
affine grid (2 to 8 bits, groups of 32 to 128; round to nearest, GPTQ, AWQ) and a symmetric integer recipe (gptq-w4a16, held as code q + 8 and bias
-8 x scale):

- every quantized tensor (Linears, lm_head, the token embedding) dequantized by `mx.dequantize` from the file (scales
  and biases widened to float32, as quantkit computes a value: the product, then the sum) equals quantkit's in-memory
  preview's weight (`eval -q`'s model) bit for bit, once rounded to the model's dtype (float32 symmetric grids: within
  one float32 unit in the last place: torchao rounds scale x q once, mlx scale x code + bias twice);
- `mlx_lm.utils.load` loads the directory and its logits on a prompt are the preview's within LOGITS_TOLERANCE of
  the largest logit (float32; mlx's CPU kernels dequantize a bfloat16 weight in bfloat16, rounding twice, and sum in
  bfloat16: BF16_LOGITS_TOLERANCE there, and the same weights dequantized by mlx-lm and run in float32 within
  LOGITS_TOLERANCE of quantkit's float32 forward);
- quantkit's round to nearest is `mx.quantize` itself: the same packed words, scales and biases for a float32 weight;
  for bfloat16 the same scales and biases, and codes no farther from the weight than mx.quantize's (mlx rounds onto its
  float32 grid before storing it in bfloat16; quantkit onto the grid as stored); in the nvfp4 mode the same packed
  words and scale bytes in float32, bfloat16 and float16 (mlx divides and chooses the scale in the weight's dtype).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.mlx]

WORKER = Path(__file__).with_name("mlx_worker.py")
DEFAULT_PYTHON = Path.home() / ".cache" / "quantkit" / "mlx-venv" / "bin" / "python"
LOGITS_TOLERANCE = 1e-4  # max |mlx-lm's logit - the preview's| / max |logit|, float32 models
# bfloat16 models: mlx's CPU kernel dequantizes in bfloat16 and sums its products in bfloat16 (`_qmm`): 2.5-6.3% of the
# largest logit from quantkit's bfloat16 logits here, while mlx-lm and transformers agree within 0.7% on the float
# bfloat16 model. So bfloat16 models are first run dequantized in float32, where LOGITS_TOLERANCE holds (measured
# 7e-7), and then on mlx's kernels within this looser bound
BF16_LOGITS_TOLERANCE = 0.1
PROMPT = [1, 5, 9, 20, 33, 7, 44, 61, 3, 18, 27, 90, 12, 8, 71, 40]
SHAPES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
CONFIGS = {  # what an architecture's tiny model needs beyond SHAPES
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, head_dim=32,
                      norm_topk_prob=True),
    "gemma2": dict(head_dim=32, query_pre_attn_scalar=32),
    # a global layer after a sliding one, whose window the prompt outgrows
    "gemma3_text": dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(pad_token_id=0),  # Phi3Config's default pad id is beyond a tiny vocabulary
}
LINEARS = {"phi3": 4}  # quantized Linears a layer holds in mlx-lm (Phi-3: q/k/v and gate/up fused); else 7


@cache
def mlx_python() -> str | None:
    python = os.environ.get("MLX_PYTHON") or str(DEFAULT_PYTHON)
    if not Path(python).is_file():
        return None
    found = subprocess.run([python, "-c", "import mlx.core, mlx_lm"], capture_output=True)
    return python if found.returncode == 0 else None


if mlx_python() is None:
    pytest.skip(f"needs mlx and mlx-lm in {os.environ.get('MLX_PYTHON') or DEFAULT_PYTHON} (MLX_PYTHON): `make test-mlx` "
                "builds that environment and runs these tests", allow_module_level=True)


def worker(*args: str) -> None:
    done = subprocess.run([mlx_python(), str(WORKER), *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def calib_text(tmp_path_factory) -> Path:
    from conftest import make_text

    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(make_text(4000, seed=3))
    return path


@cache
def model_dir(root: Path, model_type: str, dtype: str) -> Path:
    """A tiny random model; `model_type` "qwen3-tied": Qwen3 with its lm_head tied to the embedding."""
    from quantkit.models.tiny import build_tiny_model
    from conftest import make_text

    base, _, tied = model_type.partition("-")
    return build_tiny_model(root / f"{model_type}-{dtype}", make_text(3000), base, dtype=dtype,
                            **SHAPES | CONFIGS.get(base, {}) | ({"tie_word_embeddings": True} if tied else {}))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx-models")
    return lambda model_type, dtype: model_dir(root, model_type, dtype)


def recipe_of(name: str, bits: int | None = None, group: int | None = None):
    """The recipe `name` written as MLX (NAME+R1R2: with fused Hadamard rotations R1 and R2), at `bits` / `group`."""
    from quantkit.quant.registry import Format, Transform, resolve
    from quantkit.export import for_format

    name, _, rotated = name.partition("+")
    if name == "mxfp8-a16":  # MXFP8 weights alone (quantkit's mxfp8 recipe quantizes activations too)
        from quantkit.grids.schemes import QDtype

        recipe = resolve("mxfp4-a16")
        weights = replace(recipe.scheme.weights, dtype=QDtype.FLOAT8)
        return for_format(replace(recipe, name=name, format=Format.MLX, scheme=replace(recipe.scheme, weights=weights)),
                          Format.MLX)
    recipe = resolve(name)
    if rotated:
        recipe = replace(recipe, name=f"{name}+{rotated}", transforms=(Transform(rotations=("R1", "R2")),))
    if bits or group:
        weights = recipe.scheme.weights
        weights = replace(weights, dtype=type(weights.dtype)(f"int{bits or weights.dtype.bits}"),
                          group_size=group or weights.group_size)
        recipe = replace(recipe, name=f"{name}-int{weights.dtype.bits}-g{weights.group_size}",
                         scheme=replace(recipe.scheme, weights=weights))
    return for_format(replace(recipe, format=Format.MLX), Format.MLX)


def preview(src: Path, recipe, calib: Path) -> torch.nn.Module:
    from quantkit.finalization.checks import CalibrationOptions, prepare
    from quantkit.finalization.finalize import quantize_model

    options = CalibrationOptions(data=str(calib), num_samples=8, seq_len=64)
    return quantize_model(prepare(src, recipe, calibration=options), recipe, calibration=options)


def written(src: Path, dst: Path, recipe, calib: Path) -> Path:
    from quantkit.finalization.checks import CalibrationOptions
    from quantkit.finalization.finalize import finalize

    finalize(src, dst, recipe, calibration=CalibrationOptions(data=str(calib), num_samples=8, seq_len=64))
    return dst


CASES = [  # (recipe, bits, group, architecture, dtype)
    ("mlx-4bit-g64", None, None, "llama", "float32"),
    ("mlx-4bit-g64", None, None, "mistral", "float32"),
    ("mlx-4bit-g64", None, None, "qwen2", "float32"),
    ("mlx-4bit-g64", None, None, "qwen3", "float32"),
    ("mlx-4bit-g64", None, None, "llama", "bfloat16"),
    ("mlx-4bit-g64", 2, 32, "qwen3", "float32"),
    ("mlx-4bit-g64", 5, 128, "qwen2", "bfloat16"),
    ("mlx-4bit-g64", 6, 32, "llama", "float32"),
    ("mlx-3bit-g64", None, None, "llama", "bfloat16"),
    ("mlx-8bit-g64", None, None, "qwen3", "bfloat16"),
    ("mlx-gptq-4bit-g64", None, None, "llama", "float32"),
    ("mlx-gptq-4bit-g64", None, None, "qwen2", "bfloat16"),
    ("mlx-awq-4bit-g64", None, None, "llama", "float32"),
    ("mlx-gptq-4bit-g64+R1R2", None, None, "qwen2", "float32"),  # fused rotations: the embedding rotated, then quantized
    ("gptq-w4a16", None, None, "llama", "bfloat16"),
    ("gptq-w4a16", None, None, "qwen3", "float32"),
    ("mxfp4-a16", None, None, "llama", "bfloat16"),  # mlx's mxfp4 mode: quantkit's MXFP4 grid as it is
    ("mxfp4-a16", None, None, "qwen3", "float32"),  # (MX artifacts are bfloat16: a float32 source is written so)
    ("mxfp8-a16", None, None, "qwen2", "bfloat16"),  # mlx's mxfp8 mode
    ("mlx-nvfp4", None, None, "llama", "bfloat16"),  # mlx's nvfp4 mode: FP8 group scales, no global scale
    ("mlx-nvfp4", None, None, "qwen3-tied", "float32"),  # (written in bfloat16, as the MX grids)
    ("mlx-gptq-nvfp4", None, None, "qwen2", "bfloat16"),
    ("mlx-4bit-g64", None, None, "qwen3-tied", "bfloat16"),  # lm_head quantized: the file's embedding is its grid
    ("gptq-w4a16", None, None, "qwen2-tied", "float32"),  # lm_head ignored: mlx-lm's lm_head is the quantized embedding
    ("mlx-4bit-g64", None, None, "qwen3_moe", "float32"),  # experts stacked: mlx-lm's switch_mlp
    ("mlx-gptq-4bit-g64", None, None, "qwen3_moe", "float32"),
    ("mlx-4bit-g64", None, None, "qwen3_moe", "bfloat16"),
    ("mxfp4-a16", None, None, "qwen3_moe", "bfloat16"),  # the experts' uint8 scales stacked too
    ("mlx-4bit-g64", None, None, "gemma2", "float32"),  # tied: the embedding is lm_head; norms x (1 + weight)
    # float32: mlx-lm rounds Gemma3's embedding scale sqrt(hidden) to bfloat16 in every dtype, Hugging Face to the
    # model's (sqrt(128): 11.3125 against 11.3137; 6e-5 of the largest logit here, within LOGITS_TOLERANCE)
    ("mlx-4bit-g64", None, None, "gemma3_text", "float32"),
    ("mlx-4bit-g64", None, None, "gemma3_text", "bfloat16"),
    ("mlx-4bit-g64", None, None, "phi3", "float32"),  # fused qkv_proj and gate_up_proj
]


@pytest.mark.parametrize("name, bits, group, model_type, dtype", CASES,
                         ids=[f"{c[0]}{f'-int{c[1]}-g{c[2]}' if c[1] else ''}-{c[3]}-{c[4]}" for c in CASES])
def test_mlx_reads_what_quantkit_computes(name, bits, group, model_type, dtype, models, calib_text, tmp_path):
    check_mlx_reads(recipe_of(name, bits, group), models(model_type, dtype), model_type, calib_text, tmp_path)


MIXED = [  # (per-tensor types, base recipe, architecture, dtype): mlx-lm's mixed bits, per-layer config entries
    (("down_proj=mlx-8bit-g64", "q_proj=mlx-3bit-g64", "embed_tokens=mlx-6bit-g64", "lm_head=mlx-5bit-g64"),
     "mlx-4bit-g64", "llama", "float32"),
    (("down_proj=mlx-8bit-g64", "v_proj=mlx-5bit-g64", "lm_head=mlx-6bit-g64"), "mlx-gptq-4bit-g64", "qwen3-tied",
     "bfloat16"),  # tied: the file's embedding is lm_head's 6-bit grid, named model.embed_tokens in the config
    (("o_proj=gptq-w4a16", "up_proj=float"), "mlx-4bit-g64", "qwen2", "float32"),  # a symmetric grid; a float layer
    (("down_proj=mlx-8bit-g64",), "mlx-4bit-g64", "qwen3_moe", "float32"),  # one entry per stacked projection
]


@pytest.mark.parametrize("types, base, model_type, dtype", MIXED, ids=[f"{c[1]}-{c[2]}-{c[3]}" for c in MIXED])
def test_mlx_reads_mixed_bits(types, base, model_type, dtype, models, calib_text, tmp_path):
    from quantkit.export import for_format
    from quantkit.quant.registry import Format, resolve, with_tensor_types

    recipe = for_format(with_tensor_types(resolve(base), list(types)), Format.MLX)
    check_mlx_reads(recipe, models(model_type, dtype), model_type, calib_text, tmp_path, mixed=True)


def test_mlx_reads_a_budget_plan(models, calib_text, tmp_path):
    """`--target-bpw 5` for MLX: a mixture of bit widths that mlx-lm loads to quantkit's logits."""
    from quantkit.budget import planner
    from quantkit.export import for_format
    from quantkit.finalization.checks import CalibrationOptions
    from quantkit.quant.registry import Format, resolve

    options = CalibrationOptions(data=str(calib_text), num_samples=8, seq_len=64)
    src = models("llama", "float32")
    plan = planner.plan(src, resolve("mlx-4bit-g64"), 5.0, options, ("mlx-3bit-g64", "mlx-4bit-g64", "mlx-8bit-g64"))
    assert len(set(plan.types.values())) > 1
    print(f"plan {plan.bits_per_weight:.4f} bpw: ", end="")
    check_mlx_reads(for_format(plan.recipe, Format.MLX), src, "llama", calib_text, tmp_path, mixed=True)


def check_mlx_reads(recipe, src: Path, model_type: str, calib_text: Path, tmp_path: Path, mixed: bool = False) -> None:
    """mlx's dequantization of every quantized tensor is the preview's weight; mlx-lm's logits are the preview's."""
    import json

    out = written(src, tmp_path / "out", recipe, calib_text)
    model = preview(src, recipe, calib_text)
    modules = dict(model.named_modules())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")  # the artifact's: MX grids are 16-bit
    worker("dequantize", out, tmp_path / "dequantized.npz")
    dequantized = np.load(tmp_path / "dequantized.npz")
    names = [n for n in dequantized.files if "@" not in n]
    lm_head = "lm_head" not in recipe.ignore and not model.config.tie_word_embeddings  # tied: the embedding is lm_head
    floats = sum(1 for t in recipe.tensor_types if t.endswith("=float")) * SHAPES["num_hidden_layers"]
    assert "model.embed_tokens" in names and ("lm_head" in names) == lm_head
    assert len(names) == 1 + lm_head + LINEARS.get(model_type, 7) * SHAPES["num_hidden_layers"] - floats
    if mixed:  # per-layer entries: more than one bit width, each a {group_size, bits, mode} mlx-lm passes on
        config = json.loads((out / "config.json").read_text())["quantization"]
        layers = {k: v for k, v in config.items() if isinstance(v, dict)}
        assert layers and all(set(v) == {"group_size", "bits", "mode"} for v in layers.values())
        print(f"bits {sorted({v['bits'] for v in layers.values()} | {config['bits']})}: ", end="")
    for name in names:
        spec = layer_spec(recipe, name)
        symmetric_float32 = spec.symmetric and not spec.dtype.is_float and dtype == "float32"
        ours = preview_weight(modules, name)
        theirs = torch.from_numpy(dequantized[name]).to(ours.dtype)
        if symmetric_float32:  # two float32 roundings of scale x code + bias: within 4 eps of the row's largest value
            bound = 4 * torch.finfo(torch.float32).eps * ours.abs().amax(1, keepdim=True)
            assert ((theirs - ours).abs() <= bound).all(), name
        else:
            assert torch.equal(theirs, ours), name
    worker("logits", out, ",".join(map(str, PROMPT)), tmp_path / "logits.npy")
    theirs = torch.from_numpy(np.load(tmp_path / "logits.npy"))
    with torch.no_grad():
        ours = model(torch.tensor([PROMPT])).logits[0].float()
        wide = model.float()(torch.tensor([PROMPT])).logits[0] if dtype != "float32" else ours
    gap = ((theirs - ours).abs().max() / ours.abs().max()).item()
    print(f"{recipe.name} {model_type} {dtype}: logits max |mlx-lm - quantkit| / max |logit| = {gap:.2e}", end="")
    if dtype != "float32":  # the file's weights, dequantized by mlx-lm and run in float32: quantkit's float32 logits
        worker("wide", out, ",".join(map(str, PROMPT)), tmp_path / "wide.npy")
        wide_gap = ((torch.from_numpy(np.load(tmp_path / "wide.npy")) - wide).abs().max() / wide.abs().max()).item()
        print(f"; both in float32 {wide_gap:.2e}", end="")
        assert wide_gap <= LOGITS_TOLERANCE
    print()
    assert gap <= (LOGITS_TOLERANCE if dtype == "float32" else BF16_LOGITS_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits, group", [(2, 32), (3, 64), (4, 64), (5, 128), (6, 32), (8, 128)])
def test_round_to_nearest_is_mx_quantize(bits, group, dtype, tmp_path):
    from quantkit.export import mlx
    from quantkit.grids import quantize_weight
    from quantkit.grids.mlx_grids import AffineParams
    from quantkit.grids.schemes import Granularity, QDtype, ScaleDtype, WeightSpec

    generator = torch.Generator().manual_seed(bits * group)
    weight = (torch.randn(64, 512, generator=generator) * 0.02).to(dtype)
    spec = WeightSpec(QDtype(f"int{bits}"), Granularity.GROUP, group, symmetric=False, scale_dtype=ScaleDtype.MLX_AFFINE)
    ours = quantize_weight(weight, spec)
    np.savez(tmp_path / "in.npz", w=weight.float().numpy(), **{"w@dtype": str(dtype).split(".")[1], "w@bits": bits,
                                                                  "w@group": group})
    worker("quantize", tmp_path / "in.npz", tmp_path / "out.npz")
    theirs = np.load(tmp_path / "out.npz")
    assert np.array_equal(ours.k.scales.float().numpy(), theirs["w.scales"])
    assert np.array_equal(ours.k.biases.float().numpy(), theirs["w.biases"])
    packed = torch.from_numpy(theirs["w.weight"].view(np.int32)).view(torch.uint32)
    if dtype == torch.float32:
        assert torch.equal(mlx.pack(ours.qdata, bits).view(torch.int32), packed.view(torch.int32))
        return
    grid = AffineParams(ours.k.scales, ours.k.biases, bits, group)
    their_error = (weight.float() - grid.dequantize(mlx.unpack(packed, bits))).abs()
    our_error = (weight.float() - ours.dequantize(torch.float32)).abs()
    assert (our_error <= their_error).all()  # where the codes differ, quantkit's is the nearer one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nvfp4_round_to_nearest_is_mx_quantize(dtype, tmp_path):
    """MLX's nvfp4 grid (recipe mlx-nvfp4): the packed words and the FP8 scale bytes of `mx.quantize(mode="nvfp4")`,
    with an all-zero group, a group whose scale underflows FP8 to zero, one that saturates it, and every FP4 tie."""
    from quantkit.export import mlx
    from quantkit.grids import quantize_weight
    from quantkit.quant.registry import resolve

    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(64, 512, generator=generator) * 0.02
    weight[0, :16], weight[1, :16], weight[3, :16] = 0.0, 1e-6, 1e4 * torch.randn(16, generator=generator)
    weight[2, :16] = torch.tensor([0.25, -0.25, 0.75, -0.75, 1.25, 2.5, 3.5, 5.0, -5.0, -0.1, 0.0, -0.0, 6.0, -3.5, 1.75, -1.75])
    weight = weight.to(dtype)
    spec = resolve("mlx-nvfp4").scheme.weights
    ours = quantize_weight(weight, spec)
    codes, scales = mlx.mx_tensors(ours.dequantize(dtype), ours.qparams)
    np.savez(tmp_path / "in.npz", w=weight.float().numpy(), **{"w@dtype": str(dtype).split(".")[1], "w@bits": 4,
                                                                  "w@group": 16, "w@mode": mlx.mode_of(spec)})
    worker("quantize", tmp_path / "in.npz", tmp_path / "out.npz")
    theirs = np.load(tmp_path / "out.npz")
    assert np.array_equal(scales.numpy(), theirs["w.scales"])
    assert np.array_equal(mlx.pack(codes, 4).view(torch.int32).numpy(), theirs["w.weight"].view(np.int32))


def test_eval_runs_mlx_models_in_mlx_lm(models, calib_text, tmp_path, monkeypatch):
    """`quantkit eval SRC MLX_DIR -q RECIPE`: the MLX row, computed by mlx-lm, scores the same windows as the preview of
    the same recipe and agrees with it (float32: within 1e-5 of the perplexity, and near-zero KL divergence)."""
    from quantkit import evaluate
    from quantkit.evaluation import mlx as engine

    monkeypatch.setenv("QUANTKIT_MLX_PYTHON", mlx_python())
    engine.mlx_python.cache_clear()
    src = models("llama", "float32")
    out = written(src, tmp_path / "out", recipe_of("mlx-4bit-g64"), calib_text)
    reports = evaluate([src, out], str(calib_text), quantize="mlx-4bit-g64", seq_len=64, max_samples=4,
                       kl_divergence=True, device="cpu")
    by_label = {report.label: report for report in reports}
    ours, theirs = by_label[f"{src}+mlx-4bit-g64"], by_label[str(out)]
    assert theirs.runtime.startswith("mlx ") and theirs.format == "mlx 4-bit g64" and theirs.recipe == "mlx-4bit-g64"
    assert theirs.perplexity.windows_digest == ours.perplexity.windows_digest
    assert abs(theirs.perplexity.perplexity / ours.perplexity.perplexity - 1) < 1e-5
    assert theirs.kl_divergence.mean < 1e-3


def preview_weight(modules: dict, name: str) -> torch.Tensor:
    """The preview's weight of the module mlx-lm names `name`: an expert projection's stacked over its experts
    (`mlp.switch_mlp.gate_proj`: `mlp.experts.{0, 1, ...}.gate_proj`)."""
    block, switch, proj = name.rpartition(".switch_mlp.")
    if not switch:
        return modules[name].weight.detach()
    experts = modules[f"{block}.experts"]
    return torch.stack([experts.expert(e).get_submodule(proj).weight.detach() for e in range(experts.num_experts)])


def layer_spec(recipe, name: str):
    """The grid of a layer: its per-tensor type's (the last override matching it), else the recipe's."""
    from quantkit.quant import tensor_types
    from quantkit.quant.registry import tensor_type_spec

    kind = tensor_types.type_for(tensor_types.names_of(name), recipe.tensor_types)
    return (tensor_type_spec(kind) if kind else None) or recipe.scheme.weights
