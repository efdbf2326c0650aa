"""transformers internals quantkit reaches into, each reached here and nowhere else, so that a release that moves one
breaks this module and its tests (tests/unit/test_compat.py), not a finalize halfway through.

The releases handled: 5.17 (what llm-compressor 0.14 pins and GPU images ship) and 5.24 (the dev environment), where
the whole suite runs, and the ones between them, whose sources were read (5.18, 5.20, 5.21, 5.22; not 5.19, 5.23).
Releases before 5.17 are not: 5.0 lacks `conversion_mapping.extract_weight_conversions_for_model`, which splitting
MoE experts needs. What differs:

- applying a checkpoint's weight renamings to one name: `core_model_loading.apply_renamings` from 5.21; before,
  only `rename_source_key`, which with no converters applies the same renamings in the same order (`renamer`);
- `replace_layer_number_by_wildcard`: `distributed.tensor_parallel` up to 5.22, `distributed.parallel_utils` in 5.24;
- tensor parallelism of a loaded model (`distribute_loaded`): 5.17 and 5.18 replace the model's plan by the one given
  and return torch's `DeviceMesh`, 5.20 and later merge the plans and return a mesh manager; the `replicate` style
  (a parameter whole on every rank) is registered from 5.21, and an lm_head the ranks do not divide is split
  from 5.21 (`shards_rows_unevenly`);
- a quantized checkpoint's tensor shaped unlike the parameter prepared for it (compressed-tensors' packed zero
  points): up to 5.22 the loader takes it (asymmetric pack-quantized artifacts reload: 5.17, 5.20, 5.21, 5.22 give
  the in-memory model's logits bit for bit), 5.23 and 5.24 refuse it (`tolerates_quantized_shape_mismatch`).

Imports stay inside the functions: importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable


def weight_conversions(model) -> list:
    """The conversions transformers registers for `model`'s class or model type (what its loader merges per-expert
    checkpoint weights with), unscoped; empty when it has none."""
    from transformers.conversion_mapping import extract_weight_conversions_for_model

    return list(extract_weight_conversions_for_model(model) or [])


def is_weight_converter(conversion) -> bool:
    """Whether a conversion changes tensors (merges, concatenates), not only their names."""
    from transformers.core_model_loading import WeightConverter

    return isinstance(conversion, WeightConverter)


def converter_layout(conversion) -> tuple[list[str], list[str], list[tuple[str, int | None]]]:
    """A `WeightConverter`'s checkpoint-side source patterns, model-side target patterns and (operation, dim) list, as
    the conversion mapping writes them (before transformers compiles the patterns)."""
    operations = [(type(op).__name__, getattr(op, "dim", None)) for op in conversion.operations]
    return list(conversion._original_source_patterns), list(conversion._original_target_patterns), operations


def checkpoint_renamer(model, loading: ModuleType | None = None) -> Callable[[str], str]:
    """A function naming each of `model`'s tensors as its checkpoint names it: the renamings transformers applies
    while loading (Mixtral's checkpoint `block_sparse_moe` is the model's `mlp`), reversed as `save_pretrained` reverses
    them. Base-model prefix changes are left out (quantkit writes the model's own prefix). `loading`:
    transformers' `core_model_loading`, or a stand-in for another release's (tests)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    loading = loading or importlib.import_module("transformers.core_model_loading")
    conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, loading.PrefixChange)]
    renamings = [r for r in (c.reverse_transform() for c in conversions[::-1]) if isinstance(r, loading.WeightRenaming)]
    apply = renamer(loading)
    return lambda name: apply(name, renamings)


def renamer(loading: ModuleType) -> Callable[[str, list], str]:
    """`apply(name, renamings)`: every renaming applied to `name` in turn, by the function `loading` (transformers'
    `core_model_loading`) has for it."""
    if hasattr(loading, "apply_renamings"):  # 5.21 and later
        return loading.apply_renamings
    rename_source_key = loading.rename_source_key  # 5.17 to 5.20: the renamings, then at most one converter (none)
    return lambda name, renamings: rename_source_key(name, renamings, [])[0]


def replace_layer_number_by_wildcard(name: str) -> str:
    """`model.layers.3.mlp.experts.7.w1.weight` as `model.layers.*.mlp.experts.*.w1.weight`: the keys of transformers'
    tensor-parallel plans."""
    replace = first_found("replace_layer_number_by_wildcard",
                          "transformers.distributed.parallel_utils",  # 5.24
                          "transformers.distributed.tensor_parallel")  # 5.17 to 5.22
    return replace(name)


def first_found(attribute: str, *modules: str) -> Any:
    """`attribute` of the first of `modules` that imports and has it (the places a release may keep it, newest first)."""
    for name in modules:
        try:
            return getattr(importlib.import_module(name), attribute)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {', '.join(modules)} has {attribute}: a transformers release quantkit does not know")


REPLICATE = "replicate"  # the tensor-parallel style that keeps a parameter whole on every rank


def distribute_loaded(model, replicated: list[str]):
    """`model`, loaded whole on every rank of this torchrun, sharded by its family's tensor-parallel plan, the
    parameters named in `replicated` (plan keys: layer numbers as `*`) kept whole on every rank: (the sharded model,
    this rank's device or None, the tensor-parallel device mesh).

    The model's own plan is passed with the additions: 5.17 and 5.18 replace the model's plan by a plan given, 5.20
    and later merge the two (the same plan either way)."""
    from transformers import DistributedConfig

    plan = {**model.tp_plan, **dict.fromkeys(replicated, replicate_style())} if replicated else "auto"
    config, device, mesh = type(model).prepare_distribute_model(DistributedConfig(tp_plan=plan))
    return type(model).maybe_distribute_model(model, config, mesh), device, tensor_parallel_mesh(mesh)


def tensor_parallel_mesh(mesh):
    """The tensor-parallel device mesh in what `prepare_distribute_model` returns: a mesh manager holding one mesh
    per kind of parallelism (5.20 and later), or torch's `DeviceMesh` itself (5.17, 5.18), one-dimensional unless
    several kinds of parallelism share it."""
    if hasattr(mesh, "get_mesh"):
        return mesh.get_mesh("tp")
    return mesh["tp"] if mesh.ndim > 1 else mesh


def replicate_style(styles=None) -> str:
    """`REPLICATE`, registered in `styles` (transformers' `ALL_PARALLEL_STYLES`) where the release lacks it (5.17 to
    5.20) as 5.21 registers it: a `TensorParallelLayer`, whose `shard_param` leaves the parameter as it is."""
    if styles is None:
        styles = first_found("ALL_PARALLEL_STYLES", "transformers.distributed.tensor_parallel")
    if REPLICATE not in styles:
        styles.register(REPLICATE, first_found("TensorParallelLayer", "transformers.distributed.tensor_parallel")())
    return REPLICATE


def shards_rows_unevenly(version: str | None = None) -> bool:
    """Whether transformers' tensor parallelism (`version`, else the installed one) splits a Linear whose output it
    gathers (lm_head) over ranks that do not divide its rows: from 5.21; 5.17 to 5.20 refuse such a model."""
    return _release(version) >= (5, 21)


def causal_lm_model_types() -> list[str]:
    """Every model type transformers has a causal-LM class for."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sdpa_attention() -> tuple[Callable, Callable]:
    """transformers' `sdpa` attention function (its attention-function signature) and the `repeat_kv` that expands
    grouped key / value heads."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    return sdpa_attention_forward, repeat_kv


def tolerates_quantized_shape_mismatch(version: str | None = None) -> bool:
    """Whether transformers' loader (`version`, else the installed one) takes a quantized model's checkpoint tensor
    whatever its shape against the parameter prepared for it: up to 5.22 it does (the quantizer then decompresses what
    it got); 5.23 and later refuse a mismatch except on parameters they quantize themselves. compressed-tensors 0.18+
    prepares asymmetric pack-quantized modules with their zero points sized unpacked (llm-compressor issue #1618), so
    plain transformers loads those artifacts up to 5.22 only."""
    return _release(version) < (5, 23)


def _release(version: str | None) -> tuple[int, ...]:
    from packaging.version import Version

    if version is None:
        import transformers

        version = transformers.__version__
    return Version(version).release
