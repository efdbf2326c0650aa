"""compressed-tensors output (vLLM's native format), produced on any device, CPU included.

The weights arrive quantized on the recipe's grid (`QuantizedModel`); compressed-tensors receives their qparams
and packs them: int2-int8 weight-only as pack-quantized (int3 densely, across int32 words), int8 W8A8 as
int-quantized, float8 (per channel or per block) as float-quantized, NVFP4 as nvfp4-pack-quantized, MXFP4 as
mxfp4-pack-quantized, MXFP8 as mxfp8-quantized. The library picks the format from the quantization args, as it
does for LLM Compressor.
`as_loaded` gives the model compressed-tensors' own forward (dequantized weights, activations quantized per
token at run time), so it computes exactly what the reloaded artifact computes.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.offload import as_single_threaded
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
)
from torch import nn

from quantkit.export import ct_compat
from quantkit.export.ct_compat import apply_quantization_config
from quantkit.models import compat, moe
from quantkit.quant.plan import ModulePlan
from quantkit.grids.qparams import QParams
from quantkit.quant.quantized_model import QuantizedModel
from quantkit.quant.registry import Recipe
from quantkit.quant.rotations import online_tensors, transform_config
from quantkit.grids.schemes import ActivationSpec, Granularity, KVCacheSpec, QDtype, QuantScheme, ScaleDtype, WeightSpec
from quantkit.runtime import placement


def unsupported(recipe: Recipe) -> str | None:
    """What the installed compressed-tensors cannot write of this recipe (a format of a newer release), or None."""
    if problem := grid_refusal(recipe.scheme.weights):
        return problem
    if recipe.mixture:
        return (f"{recipe.mixture} is llama.cpp's mixture of GGML types, which GGUF holds; per-tensor types here are "
                "recipes' schemes (--tensor-type REGEX=RECIPE)")
    if compression_format(recipe.scheme) == "pack-quantized":
        return ct_compat.cannot_pack(recipe.scheme.weights.dtype.bits)
    return None


def grid_refusal(spec: WeightSpec) -> str | None:
    """Why compressed-tensors holds no grid like `spec`'s (another format's own), or None."""
    if spec.scale_dtype in (ScaleDtype.FLOAT16, ScaleDtype.K_QUANT):
        return "fp16 and k_quant scales are GGUF's grids (vLLM's kernels take scales in the model's dtype)"
    if spec.scale_dtype is ScaleDtype.MLX_AFFINE:
        return "mlx_affine is MLX's grid (a float bias per group, not an integer zero point)"
    if spec.scale_dtype is ScaleDtype.FLOAT8 and not spec.global_scale:
        return ("FP8 group scales without a global scale are MLX's nvfp4 grid; compressed-tensors' NVFP4 has a "
                "per-tensor global scale (recipe nvfp4-a16)")
    return None


@contextmanager
def packed_zero_points_on_load():
    """Inside: transformers loads asymmetric pack-quantized artifacts. compressed-tensors 0.20 gives a module it
    prepares for loading (on the meta device) an unpacked zero point [out, groups] while the checkpoint holds the
    packed one [ceil(out * bits / 32), groups] (llm-compressor issue #1618); this gives the prepared module the
    packed shape, which its decompression then unpacks. Nothing else changes."""
    from compressed_tensors.compressors.pack_quantized.base import PACK_ZP_STRATS, PackedQuantizationCompressor

    original = PackedQuantizationCompressor.__dict__["compress"]

    def compress(cls, state_dict, scheme):
        zero = state_dict.get("weight_zero_point")
        weights = scheme.weights
        compressed = original.__func__(cls, state_dict, scheme)
        if zero is not None and zero.device.type == "meta" and not weights.symmetric and weights.strategy in PACK_ZP_STRATS:
            rows = -(-zero.shape[0] * weights.num_bits // 32)
            compressed["weight_zero_point"] = torch.empty((rows, *zero.shape[1:]), dtype=torch.int32, device="meta")
        return compressed

    PackedQuantizationCompressor.compress = classmethod(compress)
    try:
        yield
    finally:
        PackedQuantizationCompressor.compress = original


def compression_format(scheme: QuantScheme) -> str:
    spec = scheme.weights
    if spec.dtype is QDtype.FLOAT4:
        return "nvfp4-pack-quantized" if spec.scale_dtype is ScaleDtype.FLOAT8 else "mxfp4-pack-quantized"
    if spec.scale_dtype is ScaleDtype.E8M0:
        return "mxfp8-quantized"
    if spec.dtype.is_float:
        return "float-quantized"
    return "int-quantized" if scheme.activations else "pack-quantized"


def adapt_plan(plan: list[ModulePlan], recipe: Recipe, config) -> list[ModulePlan]:
    """The plan with the recipe's per-tensor schemes (`tensor_types`: recipes' names, `plan.with_tensor_type`), each
    one config group of the artifact. Refused before any work: a scheme whose group does not divide the tensor's
    inputs, one the installed compressed-tensors cannot write, one of another compression format than the recipe's
    (one artifact is packed one way)."""
    from quantkit.errors import FormatError
    from quantkit.quant.plan import with_tensor_type

    if not recipe.tensor_types:
        return plan
    adapted, fmt = [with_tensor_type(entry, recipe) for entry in plan], compression_format(recipe.scheme)
    for before, entry in zip(plan, adapted):
        if entry.scheme is None or entry.scheme == before.scheme:
            continue
        spec = entry.scheme.weights
        if problem := grid_refusal(spec):
            raise FormatError(f"{entry.name}: its tensor type's grid: {problem}")
        if spec.granularity is Granularity.GROUP and entry.in_features % spec.group_size:
            raise FormatError(f"{entry.name}: groups of {spec.group_size} do not divide its {entry.in_features} inputs; "
                              "give it a tensor type with another group size")
        if compression_format(entry.scheme) != fmt:
            raise FormatError(f"{entry.name}: its tensor type is packed as {compression_format(entry.scheme)}, the recipe's "
                              f"tensors as {fmt}; an artifact holds one compression format: choose types packed as {fmt}")
        if (problem := ct_compat.cannot_pack(spec.dtype.bits)) and fmt == "pack-quantized":
            raise FormatError(f"{entry.name}: {problem}")
    return adapted


def loading_caveat(recipe: Recipe) -> str | None:
    """What plain transformers cannot load of what this recipe writes (vLLM serves it), or None."""
    if unsupported(recipe) is not None:
        return None  # not written as compressed-tensors at all
    if (recipe.scheme.weights.is_asymmetric and compression_format(recipe.scheme) == "pack-quantized"
            and ct_compat.sizes_packed_zero_points_unpacked() and not compat.tolerates_quantized_shape_mismatch()):
        import transformers

        return (f"written for vLLM: transformers {transformers.__version__} cannot load asymmetric pack-quantized weights "
                "(it sizes the packed zero points unpacked; llm-compressor issue #1618); `quantkit eval` loads them itself")
    if recipe.scheme.weights.granularity is Granularity.BLOCK and not ct_compat.dequantizes_by_scheme():
        return (f"written for vLLM: transformers with compressed-tensors {ct_compat.version()} cannot run FP8 blocks of a "
                "weight one block wide or not a whole number of blocks (it guesses the layout from the scales; 0.19+ "
                "reads it from the config); `quantkit eval` loads them itself")
    return None


# what transformers 5.23 and 5.24 do with compressed-tensors MoE experts (it dequantizes them into its fused parameters
# while loading), by format, where that is not to load them right; measured on tiny Qwen3-MoE / Mixtral artifacts
_EXPERTS_NOT_LOADED = {
    "int-quantized": "it fails to load int8 W8A8 and W4A8 experts",
    "nvfp4-pack-quantized": "its dequantized NVFP4 experts come out far from the artifact's weights, silently",
    "mxfp8-quantized": "it fails to load MXFP8 experts",
    "pack-quantized asymmetric": "it fails to load experts with zero points",
}


def experts_problem(fmt: str, symmetric: bool) -> str | None:
    """What transformers does wrong with MoE experts of this compressed-tensors format, or None."""
    return _EXPERTS_NOT_LOADED.get(fmt if symmetric or fmt != "pack-quantized" else "pack-quantized asymmetric")


def experts_caveat(model: nn.Module, recipe: Recipe) -> str | None:
    """What plain transformers cannot do with the MoE experts this recipe writes, or None. transformers 5 loads
    compressed-tensors MoE experts by dequantizing them into its fused parameters, and does that right for packed
    symmetric integer, FP8 and MXFP4 experts only."""
    if not moe.experts_modules(model):
        return None
    problem = experts_problem(compression_format(recipe.scheme), recipe.scheme.weights.symmetric)
    if problem is None:
        return None
    import transformers

    return (f"written for vLLM: transformers {transformers.__version__} cannot run this recipe's MoE experts "
            f"({problem}), so neither can `quantkit eval`; int4-weight-only, gptq-w4a16, mxfp4-a16, fp8-static and "
            "float8-dynamic-act-float8-weight write MoE experts both load")


def notes(skeleton: nn.Module, recipe: Recipe) -> list[str]:
    """The summary's caveats: what plain transformers cannot load or run of what this recipe writes."""
    return [note for note in (experts_caveat(skeleton, recipe), loading_caveat(recipe)) if note]


def experts_load_problem(config: dict) -> str | None:
    """Why plain transformers cannot run the MoE experts of the compressed-tensors artifact whose config.json is
    `config`, or None (not MoE, not compressed-tensors, or a format it loads right)."""
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") != "compressed-tensors":
        return None
    if not any(key in config for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    for group in (quantization.get("config_groups") or {}).values():
        if not any("experts" in target for target in group.get("targets", [])) and group.get("targets") != ["Linear"]:
            continue
        fmt = group.get("format") or quantization.get("format", "")
        problem = experts_problem(fmt, (group.get("weights") or {}).get("symmetric", True))
        if problem:
            return problem
    return None


def weight_bytes(entry: ModulePlan, element_size: int) -> int:
    """Packed grid (int32 words for pack-quantized, else one byte per element), scales, zero points, shape."""
    spec, rows, cols = entry.scheme.weights, entry.out_features, entry.in_features
    fmt = compression_format(entry.scheme)
    if fmt == "pack-quantized":
        grid = rows * -(-cols * spec.dtype.bits // 32) * 4 + 16  # weight_packed + weight_shape
    elif fmt.endswith("fp4-pack-quantized"):
        grid = rows * cols // 2  # two FP4 values per byte
    else:
        grid = rows * cols
    acts = entry.scheme.activations
    return grid + spec.qparam_bytes(rows, cols, element_size) + (4 if acts and acts.calibrated else 0)


_SCALE_DTYPES = {ScaleDtype.FLOAT8: torch.float8_e4m3fn, ScaleDtype.E8M0: torch.uint8}  # as compressed-tensors names them


def _weight_args(spec: WeightSpec) -> QuantizationArgs:
    strategy = {Granularity.GROUP: "tensor_group" if spec.global_scale else "group", Granularity.BLOCK: "block"}
    scale_dtype = _SCALE_DTYPES.get(spec.scale_dtype)
    return QuantizationArgs(
        num_bits=spec.dtype.bits, type="float" if spec.dtype.is_float else "int", symmetric=spec.symmetric,
        strategy=strategy.get(spec.granularity, "channel"), group_size=spec.group_size,
        block_structure=list(spec.block_shape) if spec.block_shape else None,
        scale_dtype=scale_dtype, zp_dtype=scale_dtype,
    )


def _activation_args(spec: ActivationSpec | None) -> QuantizationArgs | None:
    if spec is None:
        return None
    if spec.granularity is Granularity.GROUP:
        strategy = "tensor_group" if spec.global_scale else "group"
    else:
        strategy = "token" if spec.dynamic else "tensor"
    scale_dtype = _SCALE_DTYPES.get(spec.scale_dtype)
    return QuantizationArgs(
        num_bits=spec.dtype.bits, type="float" if spec.dtype.is_float else "int", symmetric=spec.symmetric,
        strategy=strategy, group_size=spec.group_size, dynamic="local" if spec.global_scale else spec.dynamic,
        scale_dtype=scale_dtype, zp_dtype=scale_dtype,
        **({"observer": "static_minmax"} if spec.global_scale else {}),
    )


def quantization_config(plan: list[ModulePlan], recipe: Recipe, experts: tuple[str, str | None] = ((), None)) -> QuantizationConfig:
    """The recipe's scheme targets every Linear; modules with a fallback group size are named exactly
    (an exact name wins over a class in compressed-tensors and vLLM), MoE experts by one `re:` pattern (`experts`:
    their names and `moe.expert_pattern`; it names them in the checkpoint too, and is how transformers finds their
    scheme); modules left out are ignored by name."""
    names, pattern = set(experts[0]), experts[1]
    groups: dict[QuantScheme, list[str]] = {}
    for entry in plan:
        if entry.quantized and entry.scheme != recipe.scheme:
            targets = groups.setdefault(entry.scheme, [])
            target = pattern if entry.name in names else entry.name
            if target not in targets:
                targets.append(target)
    if any(entry.scheme == recipe.scheme for entry in plan):
        groups[recipe.scheme] = ["Linear"]
    config_groups = {
        f"group_{i}": QuantizationScheme(
            targets=targets, weights=_weight_args(scheme.weights), input_activations=_activation_args(scheme.activations)
        )
        for i, (scheme, targets) in enumerate(groups.items())
    }
    ignore = [entry.name for entry in plan if not entry.quantized]
    return QuantizationConfig(config_groups=config_groups, ignore=ignore, kv_cache_scheme=_kv_cache_args(recipe.kv_cache))


def _kv_cache_args(spec: KVCacheSpec | None) -> QuantizationArgs | None:
    """LLM Compressor's `kv_cache_scheme`: static symmetric FP8, per tensor or per attention head."""
    if spec is None:
        return None
    strategy = "attn_head" if spec.granularity is Granularity.HEAD else "tensor"
    return QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=False, strategy=strategy)


def install(model: nn.Module, plan: list[ModulePlan], recipe: Recipe) -> None:
    """Attach compressed-tensors' quantization (schemes, qparam slots, quantized forward) to `model`."""
    ct_compat.compute_as_newer_releases()
    apply_quantization_config(model, quantization_config(plan, recipe, experts_targets(model)))


def experts_targets(model: nn.Module) -> tuple[tuple[str, ...], str | None]:
    """`quantization_config`'s `experts`: every MoE expert projection's name, and the pattern naming them all."""
    return tuple(moe.expert_linears(model)), moe.expert_pattern(model)


def set_qparams(module: nn.Module, qparams: QParams) -> None:
    """Give an installed module its qparams (from any algorithm). Its weight holds the dequantized grid values,
    which compressed-tensors re-quantizes to exactly the grid integers when it packs."""
    module.weight_scale = nn.Parameter(qparams.scale.reshape(module.weight_scale.shape), requires_grad=False)
    if qparams.global_scale is not None:
        module.weight_global_scale.data.copy_(qparams.global_scale.reshape(module.weight_global_scale.shape))  # fused modules share it: copied
    if qparams.zero_point is not None:
        zero = qparams.zero_point.reshape(module.weight_zero_point.shape)
        module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)


def freeze(model: nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "quantization_scheme"):
            module.quantization_status = QuantizationStatus.FROZEN


def set_input_scale(module: nn.Module, scale: torch.Tensor) -> None:
    """A static activation scale measured on calibration data (NVFP4: the activations' global scale)."""
    target = module.input_global_scale if hasattr(module, "input_global_scale") else module.input_scale
    target.data = scale.reshape(target.shape).to(target.dtype)


def set_kv_scales(model: nn.Module, scales: dict[str, torch.Tensor], prefix: str = "") -> None:
    """Give every cached attention module under `model` (named `prefix`) its measured `k_scale` / `v_scale`, in
    the model's dtype: into the parameters compressed-tensors installed, or new ones where it installed none (it
    does not see transformers 5.24's attention, whose cache argument is `cache`). A missing one is an error."""
    from quantkit.quant.kv_cache import cached_attentions

    for name, module in cached_attentions(model, prefix).items():
        dtype = next(p.dtype for p in module.parameters() if p.is_floating_point())
        for which in ("k_scale", "v_scale"):
            key = f"{name}.{which}"
            if key not in scales:
                raise RuntimeError(f"{key} was not measured")
            target = getattr(module, which, None)
            if target is None:
                module.register_parameter(which, nn.Parameter(scales[key].to(dtype), requires_grad=False))
            else:
                target.data = scales[key].reshape(target.shape).to(target.dtype)


def as_loaded(quantized: QuantizedModel) -> nn.Module:
    """Install compressed-tensors' quantization with the model's qparams and input scales (once)."""
    model = quantized.model
    if any(hasattr(module, "quantization_scheme") for module in model.modules()):
        return model
    install(model, quantized.plan, quantized.recipe)
    for name, qparams in quantized.qparams.items():
        set_qparams(model.get_submodule(name), qparams)
    for name, scale in quantized.input_scales.items():
        set_input_scale(model.get_submodule(name), scale)
    if quantized.recipe.kv_cache is not None:
        from quantkit.quant import kv_cache
        set_kv_scales(model, quantized.kv_scales)
        kv_cache.quantize_cache(model)
    freeze(model)
    return model


def write(quantized: QuantizedModel, out_dir: Path, max_shard_size: int | None = None) -> None:
    """Pack and write. Only rank 0 writes, so compressed-tensors must not spread the packing over the ranks
    of an initialised process group (it would wait for ranks that are not there)."""
    placement.check_on_host("the compressed-tensors writer", model=quantized.model, qparams=quantized.qparams,
                            input_scales=quantized.input_scales, kv_scales=quantized.kv_scales)
    transforms = transform_config(quantized.recipe, quantized.model)  # before compression replaces the weights
    online = online_tensors(quantized.recipe, quantized.model)
    model = as_loaded(quantized)
    with as_single_threaded():
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
        with _holding(model, online):
            model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        compressor.update_config(str(out_dir))
    _declare_kv_cache(out_dir / "config.json", quantized.recipe)
    _declare_transforms(out_dir / "config.json", transforms)


class StreamWriter:
    """The artifact written group of modules by group of modules (a streamed finalize): each decoder layer's
    packed tensors go to the output shards as soon as the layer is quantized, so no more than one layer is
    ever held, and the written files equal `write`'s for the same model."""

    def __init__(self, model: nn.Module, plan: list[ModulePlan], recipe: Recipe, out_dir: Path,
                 max_shard_size: int | None = None, expected_bytes: int | None = None):
        from quantkit.export.shards import ShardWriter

        ct_compat.compute_as_newer_releases()
        self.model, self.recipe, self.out_dir = model, recipe, Path(out_dir)
        self.config = quantization_config(plan, recipe, experts_targets(model))
        self.transforms = transform_config(recipe, model)  # before compression replaces the weights
        self.online = online_tensors(recipe, model)  # written with the layer they belong to
        self.planned = {entry.name for entry in plan if entry.quantized}
        self.names = {module: name for name, module in model.named_modules()}
        self.stored_name = moe.checkpoint_renamer(model)  # as save_pretrained renames (Mixtral's mlp: block_sparse_moe)
        self.shards = ShardWriter(out_dir, max_shard_size, expected_bytes)

    def add(self, modules: list[nn.Module], qparams: dict[str, QParams], input_scales: dict[str, torch.Tensor],
            kv_scales: dict[str, torch.Tensor] | None = None) -> None:
        """Pack `modules` (and everything inside them), whose planned Linears hold their dequantized grid values,
        with their qparams (and KV cache scales), and hand their tensors to the shards."""
        from compressed_tensors.compressors.base import compress_module

        placement.check_on_host("the compressed-tensors writer", modules=modules, qparams=qparams, input_scales=input_scales,
                                kv_scales=kv_scales or {})
        inside = [sub for module in modules for sub in module.modules()]
        apply_quantization_config(self.model, self.config, allowed_modules=inside)
        for sub in inside:
            name = self.names[sub]
            if name not in self.planned:
                continue
            if name not in qparams:
                raise RuntimeError(f"{name} is planned for quantization but has no qparams")
            set_qparams(sub, qparams[name])
            if name in input_scales:
                set_input_scale(sub, input_scales[name])
            sub.quantization_status = QuantizationStatus.FROZEN
            with as_single_threaded():
                compress_module(sub)
        if self.config.kv_cache_scheme is not None:
            for module in modules:
                set_kv_scales(module, kv_scales or {}, self.names[module])
        tensors, seen = {}, set()
        for module in modules:
            prefix = self.names[module]
            for key, value in module.state_dict(prefix=f"{prefix}." if prefix else "", keep_vars=True).items():
                if id(value) not in seen:
                    seen.add(id(value))
                    tensors[key] = value.detach()
            tensors.update({key: value for key, value in self.online.items() if key.startswith(f"{prefix}.")})
        self.shards.add({self.stored_name(key): value for key, value in tensors.items()})

    def finish(self) -> None:
        """The shards (and their index), config.json with the quantization config, generation_config.json."""
        with as_single_threaded():
            compressor = ModelCompressor.from_pretrained_model(self.model)
        self.shards.finish()
        self.model.config.save_pretrained(self.out_dir)
        if getattr(self.model, "generation_config", None) is not None and self.model.can_generate():
            self.model.generation_config.save_pretrained(self.out_dir)
        compressor.update_config(str(self.out_dir))
        _ignore_as_stored(self.out_dir / "config.json", self.stored_name)
        _declare_kv_cache(self.out_dir / "config.json", self.recipe)
        _declare_transforms(self.out_dir / "config.json", self.transforms)


@contextmanager
def _holding(model: nn.Module, tensors: dict[str, torch.Tensor]):
    """`model` with each of `tensors` (`<module>.<child>.weight`) held as a buffer of a child module, so that
    save_pretrained writes it under that name (the online rotations' matrices), and without them afterwards."""
    added = []
    for key, tensor in tensors.items():
        owner_name, child, attr = key.rsplit(".", 2)
        holder = nn.Module()
        holder.register_buffer(attr, tensor)
        owner = model.get_submodule(owner_name)
        owner.add_module(child, holder)
        added.append((owner, child))
    try:
        yield
    finally:
        for owner, child in added:
            delattr(owner, child)


def _declare_kv_cache(config_file: Path, recipe: Recipe) -> None:
    """The quantization config's `kv_cache_scheme`, which compressed-tensors derives from the attention modules it
    initialised and so leaves out where it saw none (transformers 5.24's attention, whose argument is `cache`)."""
    import json

    if recipe.kv_cache is None:
        return
    config = json.loads(config_file.read_text())
    if not config["quantization_config"].get("kv_cache_scheme"):
        config["quantization_config"]["kv_cache_scheme"] = _kv_cache_args(recipe.kv_cache).model_dump(mode="json")
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _declare_transforms(config_file: Path, found: dict | None) -> None:
    """The fused rotations as the quantization config's `transform_config`, where llm-compressor writes them
    (`quant.rotations.transform_config`)."""
    import json

    if found is None:
        return
    config = json.loads(config_file.read_text())
    config["quantization_config"]["transform_config"] = found
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _ignore_as_stored(config_file: Path, stored_name) -> None:
    """The quantization config's `ignore` under the checkpoint's module names (as `model.save_pretrained` writes
    them: Mixtral's `mlp.gate` is `block_sparse_moe.gate`)."""
    import json

    config = json.loads(config_file.read_text())
    ignore = config.get("quantization_config", {}).get("ignore") or []
    stored = [stored_name(name) for name in ignore]
    if stored != ignore:
        config["quantization_config"]["ignore"] = stored
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- reading (`compressed_tensors_reader`)


def restore_on_load(model: nn.Module, path: Path, config: dict) -> nn.Module:
    """A compressed-tensors artifact as plain transformers loaded it, given what transformers ignores or gets wrong of
    it: FP4 / MX weights decompressed in the model's dtype, the KV cache scales (`kv_cache_scheme`), the online
    transforms of a `transform_config` (R4, `quant.rotations.apply_online_transforms`)."""
    if hasattr(model, "ct_decompress_hook"):
        _match_dequantized_dtype(model)
    if (config.get("quantization_config") or {}).get("kv_cache_scheme"):
        from quantkit.quant import kv_cache
        kv_cache.load_scales(model, Path(path))
    from quantkit.quant.rotations import apply_online_transforms

    apply_online_transforms(model, Path(path), config)
    return model


def _match_dequantized_dtype(model: nn.Module) -> None:
    """compressed-tensors 0.20 decompresses FP4 and MX weights to bfloat16 whatever the model's dtype, so a
    float32 artifact (LLM Compressor's of a float32 model) fails its first forward with a dtype mismatch. Its
    decompression runs in a forward pre-hook on the first call; this hook, registered after it, then gives
    every decompressed weight the model's dtype (bfloat16 values are exact in float32 and float16 holds
    FP4/FP8 grid values times their scales as compressed-tensors computes them in bfloat16) and removes
    itself."""

    def cast(module: nn.Module, args) -> None:
        handle.remove()
        for sub in module.modules():
            weight = getattr(sub, "weight", None) if hasattr(sub, "quantization_scheme") else None
            if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dtype != module.dtype:
                weight.data = weight.data.to(module.dtype)

    handle = model.register_forward_pre_hook(cast)


def decompress(model: nn.Module) -> None:
    """The loaded artifact's weights decompressed in place (compressed-tensors does it in a hook on the first forward:
    dense weights, activation quantization kept) and its offloading wrapper removed, which transformers' sharded modules
    break: what the tensor-parallel plan can then shard."""
    from compressed_tensors.offload import remove_dispatch

    device = next(model.parameters()).device
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    remove_dispatch(model)
