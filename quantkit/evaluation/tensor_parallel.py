"""Tensor-parallel evaluation (`quantkit eval --tp N`): each model sharded over N processes by transformers' own
plan (`from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))` under torchrun; nccl on CUDA,
gloo on CPU), every rank running the same windows and ending with the same (all-gathered) logits.

This module holds the loading, what is refused before any process is launched (options that run in one process,
a family without a plan, heads or activation groups N does not divide, a format that does not shard) and the
per-rank numbers a report gathers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantkit.errors import UnsupportedModelError, UsageError
from quantkit.models import compat


def load(path: Path, dtype: str = "auto", trust_remote_code: bool = False):
    """The model at `path`, sharded over the ranks of this torchrun.

    A full-precision model is sharded as it loads (transformers reads each rank's slices). An artifact whose reader
    says it cannot be (`SHARDS_WHILE_LOADING`: compressed-tensors decompresses on the first forward, through an
    offloading wrapper that transformers' sharded modules break) is loaded whole, made shardable by its reader
    (`before_sharding`: dense weights, activation quantization kept), and then sharded by the same plan, so each rank
    holds the dense model until the shards are cut."""
    from transformers import DistributedConfig

    from quantkit.export import reader_for
    from quantkit.models.loading import load_model

    reader = reader_for(path)
    if reader.SHARDS_WHILE_LOADING:
        return load_model(path, dtype=dtype, trust_remote_code=trust_remote_code,
                          distributed_config=DistributedConfig(tp_plan="auto"))
    model = load_model(path, dtype=dtype, trust_remote_code=trust_remote_code)
    reader.before_sharding(model)
    return shard_loaded(model)


def shard_loaded(model):
    """A whole loaded model (its reader's `before_sharding` done) sharded by its family's plan. A parameter of one
    element (a per-tensor scale: compressed-tensors' input_scale / global scales, a per-tensor KV scale) is
    replicated, not split with its module's weight; per-head KV cache scales keep this rank's heads."""
    per_tensor = [compat.replace_layer_number_by_wildcard(name) for name, p in model.named_parameters() if p.numel() == 1]
    model, local_device, mesh = compat.distribute_loaded(model, per_tensor)
    _keep_local_head_scales(model, mesh)
    return model.to(local_device) if local_device is not None else model


def _keep_local_head_scales(model, mesh) -> None:
    """Per-KV-head cache scales ([heads, 1, 1]) cut to the heads this rank's k_proj / v_proj compute (their
    output rows are split in equal contiguous shares)."""
    from quantkit.quant.kv_cache import cached_attentions

    rank, ranks = mesh.get_local_rank(), mesh.size()
    for module in cached_attentions(model).values():
        for which in ("k_scale", "v_scale"):
            scale = getattr(module, which, None)
            if scale is not None and scale.dim() == 3 and scale.shape[0] > 1:
                share = scale.shape[0] // ranks
                scale.data = scale.data[rank * share:(rank + 1) * share].clone()


def plan_of(config) -> dict[str, str]:
    """The config's tensor-parallel plan (module pattern -> how it is split); empty when its family has none."""
    return dict(getattr(config, "base_model_tp_plan", None) or {})


def families() -> list[str]:
    """The causal-LM model types whose transformers config declares a tensor-parallel plan."""
    from transformers import CONFIG_MAPPING

    from quantkit.models.compat import causal_lm_model_types

    found = []
    for model_type in causal_lm_model_types():
        try:
            config_class = CONFIG_MAPPING[model_type]
        except (KeyError, ImportError):  # a family whose optional dependencies are missing
            continue
        if getattr(config_class, "base_model_tp_plan", None):
            found.append(model_type)
    return sorted(found)


# Config fields the plan splits into equal shares: a rank computes whole attention heads.
HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads")
# Widths that are the input of a row-split Linear (o_proj, down_proj, experts' down_proj): each rank's share
# must hold whole activation groups.
ROW_INPUT_FIELDS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def check_options(recipes: list[str] | None, tasks: object | None) -> None:
    """What tensor-parallel evaluation cannot combine with: in-memory recipe previews and lm-eval tasks, which run
    in one process."""
    if recipes:
        raise UsageError("--tp evaluates saved models; -q previews quantize in one process: finalize the model "
                         "(`quantkit finalize SRC DST -q RECIPE`), then evaluate DST with --tp")
    if tasks:
        raise UsageError("--tasks runs lm-evaluation-harness in one process; drop --tp for task scores (perplexity "
                         "works with --tp)")


def check(path: str | Path, ranks: int, trust_remote_code: bool = False) -> None:
    """Refuse, in one line and before anything is launched, a model that cannot be sharded over `ranks`
    processes: an artifact whose reader says it does not shard (`unsharded`), a family without a tensor-parallel plan,
    a head count the ranks do not divide (or a vocabulary, where transformers needs that), activation groups a rank's
    share of a width would split."""
    from transformers import AutoConfig

    from quantkit.export import reader_for

    problem = reader_for(path).unsharded(Path(path))
    if problem:
        raise UnsupportedModelError(problem)
    from quantkit.models.loading import read_config_json
    from quantkit.quant.rotations import online_groups

    online = online_groups(read_config_json(path)) if Path(path, "config.json").is_file() else {}
    if online:
        raise UnsupportedModelError(
            f"{path}: its online transforms ({', '.join(online)}) rotate whole activations, which a rank's shard of a "
            "Linear does not hold; evaluate it without --tp")
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    config = getattr(config, "get_text_config", lambda: config)()
    if not plan_of(config):
        raise UnsupportedModelError(
            f"{path}: transformers has no tensor-parallel plan for '{config.model_type}' models; evaluate it without --tp, "
            f"or use one of the families that have one: {', '.join(families())}")
    uneven = [f"{name} {getattr(config, name)}" for name in HEAD_FIELDS
              if isinstance(getattr(config, name, None), int) and getattr(config, name) % ranks]
    if uneven:
        raise UsageError(f"{path}: --tp {ranks} does not divide the model's {', '.join(uneven)}; pass a --tp that divides "
                         "them (each rank computes whole attention heads)")
    if config.vocab_size % ranks and not compat.shards_rows_unevenly():
        raise UsageError(f"{path}: --tp {ranks} does not divide the model's vocab_size {config.vocab_size}, and the installed "
                         "transformers splits lm_head's rows in equal shares only (5.21 and later split them unevenly); pass "
                         "a --tp that divides it, or upgrade transformers")
    group = _activation_group(config)
    if group:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        widths = {"attention output": config.num_attention_heads * head_dim}
        widths |= {name: getattr(config, name) for name in ROW_INPUT_FIELDS if isinstance(getattr(config, name, None), int)}
        split = [f"{name} {width}" for name, width in widths.items() if width % (ranks * group)]
        if split:
            raise UsageError(f"{path}: with --tp {ranks} a rank's share of the {', '.join(split)} does not hold whole "
                             f"activation groups of {group}; pass a --tp whose shares do (vLLM has the same limit)")


def _activation_group(config) -> int | None:
    """The group size of a compressed-tensors artifact's grouped input activations (e.g. FP8 block's 128), if any."""
    quantization = getattr(config, "quantization_config", None) or {}
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    sizes = [(group.get("input_activations") or {}).get("group_size") for group in (quantization.get("config_groups") or {}).values()]
    return max((size for size in sizes if size), default=None)


def gather_ints(value: int) -> list[int]:
    """`value` from every rank, in rank order (over the process group transformers set up); [value] alone
    outside a distributed run."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return [int(v) for v in values]
