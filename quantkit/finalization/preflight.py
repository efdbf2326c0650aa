"""Preflight: what a finalize will need (peak RAM, device memory, disk) and give (output size), and how long its
quantization takes, before any weight is loaded.

Sizes come from the safetensors headers and the plan: every quantized Linear's bytes in the written files are
the exporter's `weight_bytes`, every other tensor keeps its bytes. Peak RAM is this process's resident size now
(torch, transformers and the recipe's code imported, the calibration tokens read: the fixed cost of any run) plus
the model-dependent terms of the run's phases, or this process's peak so far where that is higher (reading a
large calibration text peaks above what a small model's run adds; it is over by the time the run starts: counting
that peak under the run's work put a Qwen3-30B-A3B layer's estimate 0.7 GiB high):

- streamed (the default, `quantkit.models.streaming`): the larger of two phases that never overlap. The modules
  outside the decoder layers (embeddings, final norm, lm_head) are read for the first layer's calibration inputs,
  released, and read again at the end, when they are written as they are: held once (safetensors maps them, so
  their pages count in the resident size but are not copied; a tensor converted to another dtype or rotated has
  its copy beside it while it is made); the decoder layers are read one at a time, the largest
  STREAMED_LAYER_COPIES times (read, its dequantized weights, its packed tensors being written) and the widest
  Linear's float32 copy while it is packed (PACKING_COPIES), with the calibration work of a layer. On a
  Llama-3.1-8B-shaped checkpoint (16 GB) the measured peak of round-to-nearest was the fixed cost plus the
  embeddings and lm_head (2.1 GB);
- loaded whole (`--in-memory`, torchao, a checkpoint transformers converts): the model held once, plus a
  transient copy of it while transformers loads it and the exporter packs it (the format's LOAD_AND_WRITE_COPIES,
  `export.Hooks`; torchao converts while loading, so its transient is smaller);
- calibration: (loaded whole) the grid integers of every finished layer (one byte per quantized weight, kept until written),
  the calibration hidden states of this rank (one copy, or a layer's inputs and outputs: `resident_copies`), one
  batch's activations inside the widest layer, and the Hessian accumulators of a layer (float64 upper triangles) plus GPTQ's float32 work
  copies; GPTQ on the CPU also holds down_proj's inputs for every batch where they take at most a share of the machine's memory
  (`runtime.placement.holds_stage_inputs`; else they are computed again batch by batch). GPTQ's staged pass on
  the CPU works one stage at a time, so its batch of activations, its Hessian and its solve are never held
  together: the largest of the three counts (`staged_gptq_bytes`; measured within 5% on 8B-shaped layers). GPTQ
  calibrating a streamed layer at once (an MoE layer) solves its stages while the layer is held about once, not
  beside the layer's later copies (`layerwise_gptq_bytes`). AutoRound sums no Hessians: it holds its tuning state
  and one tuning pass's activations instead (`algorithms.methods.autoround.tuning_bytes`; 12.8 GiB estimated against 12.0 measured on a
  Llama-3.1-8B-shaped layer, 8 x 2048 tokens).

The formats' LOAD_AND_WRITE_COPIES were measured with `/usr/bin/time` on Llama models of 20M (float32) to 270M parameters (bf16):
the peak above the fixed cost was 1.8 to 2.8 times the model for compressed-tensors (allocator reuse varies from
run to run), 1.5 to 1.8 times for torchao. `tests/integration/test_preflight.py` checks the estimate against
measured runs. Time is measured, not
modelled: one decoder layer of the same shape, with random weights, quantized by the recipe on this machine
(calibrated recipes on one batch: the phases that run the samples scale to this rank's share, the quantizer's
own work does not), times the layers.
"""

from __future__ import annotations

import copy
import math
import re
import resource
import shutil
import sys
import time
from pathlib import Path

from quantkit import algorithms
from quantkit.algorithms.base import CalibrationSizes
from quantkit.models import sources
from quantkit.quant.plan import ModulePlan
from quantkit.quant.registry import AlgorithmStep, Recipe

STREAMED_LAYER_COPIES = 3
CALIBRATED_LAYER_COPIES = 2.5  # a calibrated layer: read (mapped), the weights it calibrates replaced by their
# quantized values (copies of the mapped pages), and the grid integers kept until written; measured 2.4 on
# Llama-3.1-8B-shaped and 2048 / 7168 layers with GPTQ (the resident size when the down projection's stage starts,
# less the fixed cost and the hidden states)
# A streamed layer is read (mapped, 1 copy) and rounded Linear by Linear: its phase is the larger of
# STREAMED_LAYER_COPIES layers and one layer plus the widest Linear's rounding (`WeightSpec.rounding_copies`).
PACKING_COPIES = 1.0  # float32 copies of the widest Linear while the exporter packs it, on top of the layer's copies:
# measured by the streamed peak of int4-weight-only, FP8 and NVFP4 on Llama layers of widths 2048 / 5632 and
# 4096 / 14336 (the 0.84B's and the 8B's; without it the estimate was 6-17% under)
_LOAD_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


ROTATION_COPIES = 3  # a block of rows in float64, its rotated result, the transform's intermediate


def estimate(prepared, recipe: Recipe, options, world_size: int, dst: str | Path | None, dtype: str = "auto",
             measure_time: bool = False, trust_remote_code: bool = False) -> dict:
    """The preflight report (`finalize --dry-run`, and the check a real run makes before loading). A model that
    `prepare` found streamable (`prepared.loading` is None) is estimated as streamed."""
    from quantkit import data
    from quantkit.export import exporter

    headers = sources.tensor_headers(prepared.src)
    size = lambda name: _LOAD_DTYPE_BYTES.get(dtype) or sources.DTYPE_BYTES[headers[name][0]]  # noqa: E731
    numel = {name: _numel(shape) for name, (_, shape) in headers.items()}
    quantized = _quantized_in_checkpoint(prepared, headers, trust_remote_code)
    write = exporter(prepared.format)
    model_bytes = sum(numel[n] * size(n) for n in headers)
    output_bytes = sum(write.weight_bytes(quantized[n], size(n)) if n in quantized else numel[n] * size(n) for n in headers)
    output_bytes += _other_files(prepared.src)
    config = _config(prepared.src)
    hidden, layers = config.get("hidden_size", 0), max(1, config.get("num_hidden_layers", 1))
    element = max((size(n) for n in headers), default=4) if dtype == "auto" else _LOAD_DTYPE_BYTES[dtype]

    _import_run_modules(recipe)
    fixed = resident_bytes()
    streamed = prepared.loading is None
    ram = {_FIXED: fixed}
    outside_layers = {}  # streamed: the phase that holds the modules outside the decoder layers instead of a layer
    if streamed:
        per_layer = _layer_bytes(headers, numel, size)
        rest = model_bytes - sum(per_layer.values())
        copied = prepared.rotator is not None or dtype not in ("auto", _stored_dtype(headers))
        largest = max((numel[n] * size(n) for n in headers if not _LAYER.search(n)), default=0) if copied else 0
        outside_layers["embeddings, final norm and lm_head (read at the start and at the end, held once)"] = rest + largest
        layer = max(per_layer.values(), default=0)
        first = _first_layer(prepared.plan)
        rounding = 0 if recipe.needs_calibration else rounding_bytes(first)
        packing = int(PACKING_COPIES * 4 * max((e.in_features * e.out_features for e in first), default=0))
        copies = CALIBRATED_LAYER_COPIES * layer if recipe.needs_calibration else max(STREAMED_LAYER_COPIES * layer, layer + rounding)
        ram[_STREAMED_LAYER] = int(copies) + packing
    else:
        ram["model and its transient copy while loading and writing"] = int(write.LOAD_AND_WRITE_COPIES * model_bytes)
    if prepared.rotator is not None:  # float64 copies of CHUNK_ROWS rows of the widest weight (`algorithms.rotation`)
        from quantkit.algorithms.rotation import CHUNK_ROWS

        widest = max((shape[-1] for _, shape in headers.values() if len(shape) == 2), default=0)
        ram["rotations (float64 blocks of rows)"] = ROTATION_COPIES * 8 * CHUNK_ROWS * widest
    device = None
    gpu = None
    work_dir = None
    shares = None
    reported = {}
    learning = None
    recomputed = False  # GPTQ on the CPU computing its stages' inputs twice, where holding them would take too much
    if prepared.rotator is not None and prepared.rotator.learning is not None:
        num_samples, seq_len = options.sizes(recipe)  # the ones given, else the recipe's
        count = min(options.batch_size, num_samples)
        learning = learning_bytes(config, -(-count // world_size), seq_len, model_bytes)
        ram["learning the rotations (activations for the backward pass, rotated weights)"] = learning
    if recipe.needs_calibration:
        num_samples, seq_len = options.sizes(recipe)
        batches = [data.rank_batches(num_samples, options.batch_size, r, world_size) for r in range(world_size)]
        shares = [sum(map(len, rank)) for rank in batches]
        quantizer = recipe.quantizer.algorithm
        held = quantizer.staged and _holds_stage_inputs(
            options.device, stage_input_bytes(prepared.plan, max(shares), seq_len, hidden, element))
        recomputed = quantizer.staged and options.device == "cpu" and not held
        calib = calibration_bytes(prepared.plan, quantized, numel, max(shares), seq_len, hidden, element, options.batch_size,
                                  held)
        search = next((s for s in recipe.before_quantizer if s.algorithm.searches_blocks), None)  # AWQ's
        block_search = search is not None
        staged = stages_gptq(prepared.plan)
        staged_alone = quantizer.staged and not block_search
        if options.device == "cpu" and staged_alone and staged:
            calib = staged_gptq_bytes(calib, prepared.plan, max(shares), seq_len, element, options.batch_size, held)
        grid_share = 1.0 if not block_search else search.algorithm.grid_share(search.arguments, batches[shares.index(max(shares))],
                                                                     num_samples, seq_len)
        copy = calib[_HIDDEN_STATES] // 2
        copies = resident_copies(recipe, staged)
        if options.device == "cpu":  # AWQ's search holds its blocks' scored rows beside the inputs
            calib[_HIDDEN_STATES] = int(copy * (max(copies, 1 + 3 * grid_share) if block_search else copies))
        sizes = CalibrationSizes(tuple(_first_layer(prepared.plan)), max(shares), num_samples, seq_len, hidden, element,
                                 world_size, options.device, config.get("num_attention_heads", 1))
        calib = quantizer.calibration_bytes(calib, sizes, recipe.quantizer.arguments)
        reported = quantizer.report(recipe.quantizer.arguments, num_samples, world_size)
        streams = quantizer.hidden_state_streams()  # of hidden states in the resume state
        if streamed:  # each layer's grid integers are written with it
            calib.pop("grid integers of finished layers")
            outside_layers[_HIDDEN_STATES] = calib[_HIDDEN_STATES]
        ram.update(calib)
        if streamed and staged_alone and not staged:  # the solves overlap the layer's copies (`layerwise_gptq_bytes`)
            del ram[_STREAMED_LAYER]
            ram.update(layerwise_gptq_bytes(layer, packing, prepared.plan))
        work_dir = _work_dir_bytes(headers, numel, size, quantized, shares, seq_len, hidden, element, streams)
        if options.device != "cpu":
            gpu = device_plan(
                layer=max(_layer_bytes(headers, numel, size).values(), default=model_bytes // (layers + 2)),
                copy=copy, batches=-(-max(shares) // options.batch_size), calib=calib,
                algorithm=quantizer, block_search=block_search, positions=2 * max(shares) * seq_len * _head_dim(config) * element,
                budget=options.max_device_bytes or free_device_bytes(options.device), grid_share=grid_share,
                copies=copies)
            device = gpu["peak_bytes"]
            if gpu["mode"] == "offloaded" and block_search:
                ram[_AWQ_OFFLOADED] = int(calib[_HIDDEN_STATES] * grid_share)
    if learning is not None and options.device != "cpu":  # the whole model on the device while it learns
        device = max(device or 0, model_bytes + learning)
    if sum(outside_layers.values()) > sum(ram.values()) - fixed:
        ram = {next(iter(ram)): fixed, **outside_layers}
    # what this process did before (reading the calibration text) may have peaked higher than the run's work adds
    ram[_FIXED] = max(fixed, peak_resident_bytes() - (sum(ram.values()) - fixed))
    free = _free_disk(dst) if dst is not None else None
    needed = output_bytes + (work_dir or 0)
    report = {
        "model_bytes": model_bytes,
        "output_bytes": output_bytes,
        "streamed": streamed,
        "peak_ram_bytes": sum(ram.values()),
        "peak_ram_breakdown": ram,
        "peak_device_bytes": device,
        "device_plan": gpu,
        "work_dir_bytes": work_dir,
        "disk_needed_bytes": needed,
        "free_disk_bytes": free,
        "fits_on_disk": None if free is None else needed <= free,
        "ranks": world_size,
        "samples_per_rank": shares,
    }
    report.update(reported)  # the quantizer's own figures (AutoRound: passes a step)
    if measure_time:
        report["time"] = time_estimate(prepared, recipe, options, max(shares) if shares else 0, layers,
                                       dtype if dtype != "auto" else _stored_dtype(headers), trust_remote_code, recomputed)
    return report


def _quantized_in_checkpoint(prepared, headers: dict, trust_remote_code: bool) -> dict[str, ModulePlan]:
    """Each quantized Linear's weight by its name in the checkpoint: the model's name, unless transformers renames
    it while loading (Mixtral's experts are under `block_sparse_moe` on disk; a meta skeleton says how)."""
    from quantkit.models import loading as models
    from quantkit.models import moe
    by_name = {f"{e.name}.weight": e for e in prepared.plan if e.quantized}
    if any(name not in headers for name in by_name):
        skeleton = moe.linearize(models.meta_model(models.load_config(prepared.src, trust_remote_code), trust_remote_code))
        by_name = {checkpoint: by_name[name] for name, checkpoint in moe.checkpoint_names(skeleton, list(by_name)).items()}
    return {name: entry for name, entry in by_name.items() if name in headers}


def calibration_bytes(plan: list[ModulePlan], quantized: dict[str, ModulePlan], numel: dict[str, int], samples: int,
                      seq_len: int, hidden: int, element: int, batch_size: int,
                      held_stage_inputs: bool = False) -> dict[str, int]:
    """What calibration adds to the model in RAM (see the module docstring); with `held_stage_inputs`, GPTQ's
    down-projection inputs for every sample (`stage_input_bytes`)."""
    layer = _first_layer(plan)
    stages = _hessian_stages(layer)
    outer = max((max(e.out_features, e.in_features) for e in layer), default=hidden)
    solve = max((stage_solve_bytes(width, rows) for width, rows in stages), default=0)
    found = {
        "grid integers of finished layers": sum(numel[n] for n in quantized),
        _HIDDEN_STATES: 2 * samples * seq_len * hidden * element,
        "one batch's activations in a layer": 3 * min(samples, batch_size) * seq_len * outer * 4,
        _HESSIANS: hessian_accumulator_bytes(stages) + solve,
    }
    if held_stage_inputs:
        found[_HELD_STAGE_INPUTS] = stage_input_bytes(plan, samples, seq_len, hidden, element)
    return found


def stage_solve_bytes(width: int, rows: int) -> int:
    """A GPTQ solve of the `rows` weight rows stacked on one `width`-input Hessian: the float32 Hessian and its
    factor, and STACKED_SOLVE_BYTES a weight."""
    return 4 * width * 2 * width + STACKED_SOLVE_BYTES * rows * width


def hessian_accumulator_bytes(stages: list[tuple[int, int]]) -> int:
    from quantkit.grids.observers import HessianObserver

    return sum(HessianObserver.accumulator_bytes(width) for width, _ in stages)


def layerwise_gptq_bytes(layer: int, packing: int, plan: list[ModulePlan]) -> dict[str, int]:
    """The streamed layer (`layer` bytes, `packing` while it is packed) and GPTQ's solves, for GPTQ calibrating a layer at once (not staged: an MoE layer, a
    wiring without stages), where the general estimate adds the layer's CALIBRATED_LAYER_COPIES and the largest
    solve. They do not overlap: the Hessians of the whole layer are summed first, then its stages are solved in
    order, each stage's quantized weights replacing its own (a copy beside the mapped ones), and the grid integers
    are kept until the layer is written. While stage s solves, the layer is held once plus the extra copies of the
    stages before it; the full CALIBRATED_LAYER_COPIES only once every solve is done. On a Qwen3-30B-A3B layer
    the stacked solve of its 128 experts' gates and ups (two thirds of the layer, after attention's 3%) is the
    peak: the general estimate counted 2.5 layers beside it (+42% over the measured 5.94 GiB)."""
    stages = _hessian_stages(_first_layer(plan))
    weights = sum(width * rows for width, rows in stages) or 1
    copies = int(CALIBRATED_LAYER_COPIES * layer)
    extra = copies - layer  # the replaced weights' copies, the grid integers
    done = 0
    peak = copies
    for width, rows in stages:
        peak = max(peak, int(layer + extra * done / weights) + stage_solve_bytes(width, rows))
        done += width * rows
    return {_LAYER_AND_SOLVE: peak + packing, _HESSIANS: hessian_accumulator_bytes(stages)}


STACKED_SOLVE_BYTES = 10  # a GPTQ solve, per weight of the Linears stacked on one Hessian: the stacked copy in the
# model's dtype, its float32 work copy, the int8 grid integers and their transposed copy (10.0 measured on the
# gates and ups of a Qwen3-30B-A3B layer's 128 experts, 196608 x 2048, which share one Hessian), beside the
# float32 Hessian and its factor (2 x 4 x in x in)
MLP_PASS_COPIES = 2.3  # a batch through the MLP on the CPU, in the MLP's width x the batch's tokens x the model's
# element: the gate and up outputs and act(gate) beside their product (which the staged pass keeps); the growth
# of the resident size over the held inputs, measured with 8 x 2048 tokens on Llama layers of widths 2048 / 7168
# and 4096 / 14336 (bf16)
HESSIAN_CHUNK_COPIES = 3  # summing a Hessian: float32 copies of a chunk of tokens beside the float64 accumulator
# (2.6 measured on an 8B's down projection)


def stages_gptq(plan: list[ModulePlan]) -> bool:
    """Whether GPTQ runs its staged pass (`calibration.true_sequential`) on this model's layers: a wiring it knows
    has every Linear of its stages quantized in the first layer (`calibration.steps.gptq.can_stage`; the run also
    checks the staged computation against the layer's forward)."""
    from quantkit.models.architectures import WIRINGS

    layer = _first_layer(plan)
    if not layer:
        return False
    prefix = layer[0].name.split(".0.")[0] + ".0."
    names = {e.name[len(prefix):] for e in layer}
    return any(all(n in names for stage in w.stages for n in stage if n) for w in WIRINGS)


def staged_gptq_bytes(calib: dict[str, int], plan: list[ModulePlan], samples: int, seq_len: int, element: int,
                      batch_size: int, held: bool) -> dict[str, int]:
    """`calibration_bytes` for GPTQ's staged pass on the CPU, which works one stage at a time: on top of the
    hidden states (and the down projection's held inputs) it holds the largest of three steps, never two at once,
    where the general estimate adds every stage's Hessian and a float32 batch of activations. The steps: rows of
    a batch through the MLP (MLP_PASS_COPIES), summing the widest Hessian (its float64 upper triangle and float32
    chunks of tokens, with the MLP pass where the inputs are computed again), and a stage's solve. The MLP pass runs
    on `true_sequential.ROW_CHUNK_BYTES` of the down projection's input at once, not on a batch (`RowChunks`)."""
    from quantkit.calibration.true_sequential import chunk_rows
    from quantkit.grids.observers import HESSIAN_CHUNK_TOKENS, HessianObserver

    stages = _hessian_stages(_first_layer(plan))
    widest = max(width for width, _ in stages)
    tokens = min(samples, batch_size, chunk_rows(seq_len, widest, element)) * seq_len  # the MLP's pass: a few rows
    mlp_pass = int(MLP_PASS_COPIES * tokens * widest * element)
    observe = HessianObserver.accumulator_bytes(widest) + HESSIAN_CHUNK_COPIES * 4 * min(HESSIAN_CHUNK_TOKENS, tokens) * widest
    if not held:
        observe += mlp_pass
    # a stage's solve: the float32 Hessian and its inverse factor (2 x in x in) and the weight's float32 work copy
    # (rows x in); measured 2.05 x in x in on an 8B's down projection (rows x in is a quarter of it there)
    solve = max(4 * width * (2 * width + rows) for width, rows in stages)
    found = {k: v for k, v in calib.items() if k not in ("one batch's activations in a layer", _HESSIANS)}
    found[_STAGED_STEP] = max(mlp_pass, observe, solve)
    return found


def _hessian_stages(layer: list[ModulePlan]) -> list[tuple[int, int]]:
    """(inputs, rows) of each Hessian a layer's GPTQ sums: the modules reading one input share it
    (`shared_input_leaders`), and their weights are solved on it stacked."""
    from quantkit.models.architectures import shared_input_leaders

    leaders = shared_input_leaders([e.name for e in layer])
    stages: dict[str, list[int]] = {}
    for e in layer:
        stages.setdefault(leaders[e.name], [e.in_features, 0])[1] += e.out_features
    return [(width, rows) for width, rows in stages.values()]


def stage_input_bytes(plan: list[ModulePlan], samples: int, seq_len: int, hidden: int, element: int) -> int:
    """What GPTQ's staged pass holds at once where it holds its stages' inputs (`runtime.placement.holds_stage_inputs`):
    the widest Linear's (the MLP down projection's) for every sample; attention's output, held before it, is freed
    first."""
    return samples * seq_len * max((e.in_features for e in _first_layer(plan)), default=hidden) * element


_FIXED = "fixed (this process: python, torch, transformers, the calibration tokens)"
_STREAMED_LAYER = "one decoder layer (read, quantized, packed)"
_LAYER_AND_SOLVE = "one decoder layer with GPTQ's largest solve beside it, or read, quantized and packed"
_HESSIANS = "Hessians of one layer"
_HIDDEN_STATES = "calibration hidden states (this rank)"
_STAGED_STEP = "GPTQ's largest step (rows of a batch through the MLP, a Hessian summed, or a stage solved)"
_HELD_STAGE_INPUTS = "GPTQ's stage inputs (the MLP down projection's), held for every batch on the CPU"


IN_FLIGHT_BATCHES = 4  # offloaded: a batch read, the next one being copied in, an output, the one being copied out


def device_plan(layer: int, copy: int, batches: int, calib: dict[str, int], algorithm: algorithms.Algorithm, block_search: bool,
                budget: int | None, positions: int = 0, grid_share: float = 1.0, copies: int = 2) -> dict:
    """Where the calibration hidden states live on a GPU with `budget` bytes (None: not known), and the peak that
    follows. `copy`: one copy of this rank's hidden states (every batch); `calib`: `calibration_bytes`' terms;
    `grid_share`: the share of the rows AWQ's grid keeps (`awq_grid_share`); `copies`: of the hidden states a
    layer holds resident (`resident_copies`).

    - resident (the fastest): every batch's hidden states on the GPU. A layer holds one copy (its outputs replace
      its inputs as they are made), or its inputs beside its outputs (`resident_copies`); AWQ, while it searches,
      its inputs and the scored rows of the attention's and the MLP's block inputs and of one block's float
      outputs (at 8B with 512 x 2048 tokens, when its propagation held two copies: 20121 MiB measured, 0.93x this
      estimate with copies=2);
    - offloaded (`calibration.offload`): they wait in pinned CPU memory and move batch by batch, overlapped with the
      compute; the GPU holds IN_FLIGHT_BATCHES batches (AWQ: a group of GROUP_BYTES, and its outputs, as well).

    The rotary embeddings of every batch (`positions`: cos and sin) are the same for every layer and stay on the GPU.

    The layer, its Hessians and work copies, and one batch's activations are on the GPU either way: with the CUDA
    context, that is the least any budget can be: the offloaded peak."""
    from quantkit.calibration.offload import GROUP_BYTES
    from quantkit.runtime.placement import CUDA_CONTEXT_BYTES

    fixed = layer + CUDA_CONTEXT_BYTES + calib.get("one batch's activations in a layer", 0) + calib.get(_HESSIANS, 0) + positions
    fixed += calib.get(_HELD_STAGE_INPUTS, 0)
    fixed += algorithm.device_bytes(calib)
    batch = -(-copy // max(1, batches))
    resident = fixed + copies * copy
    if block_search:  # the search: the scored rows with the block's Hessians; after it, the inputs and outputs (and the
        # quantizer's Hessians: only GPTQ's stay; GPTQ's are counted as the bound on AWQ's o and down ones)
        hessians = calib.get(_HESSIANS, 0)
        after = resident - (0 if algorithm.staged else hessians)
        resident = max(after, fixed + int((1 + 3 * grid_share) * copy))
    offloaded = fixed + IN_FLIGHT_BATCHES * batch + (2 * min(GROUP_BYTES, int(grid_share * copy)) if block_search else 0)
    if algorithm.float_reference:  # tunes against the float model's hidden states, kept beside them
        offloaded = resident
    mode = "resident" if budget is None or resident <= budget else "offloaded"
    return {"mode": mode, "peak_bytes": resident if mode == "resident" else offloaded, "resident_bytes": resident,
            "offloaded_bytes": offloaded, "budget_bytes": budget}


def resident_copies(recipe: Recipe, staged: bool) -> int:
    """Copies of the calibration hidden states a layer holds where they are not offloaded (`Layer.take_inputs`): one,
    as GPTQ's staged pass builds the residual stream in the layer's inputs and the propagation after the other steps
    frees each batch's inputs once its outputs are made; two for GPTQ's staged pass when KV cache scales read the
    inputs after it, and for AutoRound (its own pass keeps them)."""
    quantizer = recipe.quantizer.algorithm
    if quantizer.float_reference:
        return 2
    if quantizer.staged and staged and recipe.kv_cache is not None:
        return 2
    return 1


def _head_dim(config: dict) -> int:
    """The attention heads' width (the rotary embeddings' cos and sin per token)."""
    heads = config.get("num_attention_heads") or 1
    return config.get("head_dim") or config.get("hidden_size", 0) // heads


def check_device_budget(report: dict) -> None:
    """Refuse, before anything is loaded, a GPU budget below what calibrating needs at the least."""
    from quantkit.errors import UsageError

    plan = report.get("device_plan")
    if plan is None or plan["budget_bytes"] is None or plan["peak_bytes"] <= plan["budget_bytes"]:
        return
    what = ("one decoder layer, its statistics and a few batches of activations" if plan["offloaded_bytes"] < plan["resident_bytes"]
            else "every batch's hidden states, which this recipe's algorithm tunes against")
    raise UsageError(f"calibrating needs about {_gib(plan['peak_bytes'])} of GPU memory ({what}) and the budget is "
                     f"{_gib(plan['budget_bytes'])}: pass --max-gpu-memory {_gib(plan['peak_bytes'])} or more (a larger "
                     "GPU), or fewer --num-samples or a shorter --seq-len")


def _gib(size: int) -> str:
    """Bytes as GiB, rounded up to a tenth (what to pass to --max-gpu-memory)."""
    return f"{math.ceil(size / (1 << 30) * 10) / 10:g}GiB"


def free_device_bytes(device: str) -> int | None:
    """The GPU's free memory now (the default budget), or None where it cannot be known (no CUDA)."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    index = torch.device(device).index
    return torch.cuda.mem_get_info(index if index is not None else torch.cuda.current_device())[0]


def learning_bytes(config: dict, samples: int, seq_len: int, model_bytes: int) -> int:
    """Learning rotations (`calibration.learned_rotations`), one step of `samples` x `seq_len` tokens per rank: per
    decoder layer and token the float32 activations autograd keeps (about 12 of the hidden size, 5 of the MLP's,
    and a row of attention weights per head), the logits three times (with their float copy and gradient), and two
    copies of the weights (rotated, fake-quantized)."""
    hidden, layers = config.get("hidden_size", 0), max(1, config.get("num_hidden_layers", 1))
    mlp = config.get("intermediate_size") or 4 * hidden
    per_token = 12 * hidden + 5 * mlp + config.get("num_attention_heads", 1) * seq_len
    return 4 * samples * seq_len * (layers * per_token + 3 * config.get("vocab_size", 0)) + 2 * model_bytes


def _holds_stage_inputs(device: str, held_bytes: int) -> bool:
    import torch

    from quantkit.runtime import placement

    return placement.holds_stage_inputs(torch.device(device), held_bytes)


def rounding_bytes(layer: list[ModulePlan]) -> int:
    """What rounding the layer's widest Linear to nearest holds at once (`WeightSpec.rounding_copies`)."""
    return int(max((e.scheme.weights.rounding_copies * 4 * e.in_features * e.out_features for e in layer), default=0))


def _layer_bytes(headers, numel, size) -> dict[int, int]:
    """Bytes of each decoder layer's tensors (in the dtype they are loaded in), by layer index."""
    found: dict[int, int] = {}
    for name in headers:
        match = _LAYER.search(name)
        if match:
            found[int(match.group(1))] = found.get(int(match.group(1)), 0) + numel[name] * size(name)
    return found


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _first_layer(plan: list[ModulePlan]) -> list[ModulePlan]:
    quantized = [e for e in plan if e.quantized and ".0." in e.name]
    if not quantized:
        return []
    prefix = quantized[0].name.split(".0.")[0] + ".0."
    return [e for e in quantized if e.name.startswith(prefix)]


def _work_dir_bytes(headers, numel, size, quantized, shares, seq_len, hidden, element, streams: int = 1) -> int:
    """`--resume`'s work directory at its largest: every layer's grid integers (one byte each) and qparams, the
    layers' other tensors, and one layer's hidden states per rank (two while the next replaces them; `streams` 2
    where the float model's are saved beside them: AutoRound)."""
    layer_tensors = [n for n in headers if ".layers." in n]
    grids = sum(numel[n] + quantized[n].scheme.weights.qparam_bytes(quantized[n].out_features, quantized[n].in_features, size(n))
                if n in quantized else numel[n] * size(n) for n in layer_tensors)
    return grids + 2 * streams * sum(shares) * seq_len * hidden * element


RECOMPUTED_STAGE_INPUTS_COST = 1.3  # GPTQ's staged pass with its inputs computed twice, against held: forward and
# Hessian sums of one Llama-3.1-8B layer, bf16, 2 x 2 x 2048 tokens, 2 threads (scripts/bench_large_checkpoint.py)


def time_estimate(prepared, recipe: Recipe, options, samples: int, layers: int, dtype: str, trust_remote_code: bool,
                  recomputed: bool = False) -> dict:
    """One decoder layer of the model's shape, random weights, quantized by the recipe here; times the layers.
    `recomputed`: the run computes GPTQ's stage inputs twice (its one timed batch holds them), which costs
    RECOMPUTED_STAGE_INPUTS_COST times the phases that run the samples."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.models import loading as models
    from quantkit.models import moe

    config = copy.deepcopy(models.load_config(prepared.src, trust_remote_code))
    config.num_hidden_layers = 1
    vocab = config.vocab_size
    config.vocab_size, config.pad_token_id = 256, None
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    torch.manual_seed(0)
    model = moe.linearize(AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                                           trust_remote_code=trust_remote_code).eval())
    plan = one_layer_plan(prepared.plan, model)
    # and R4's hooks in place for the timed layer
    rotations = _rotation_seconds(prepared, recipe, model, layers, vocab, plan, options)
    if not recipe.needs_calibration:
        quantizer, args = recipe.quantizer.algorithm, recipe.quantizer.arguments
        started = time.perf_counter()
        for entry in (e for e in plan if e.quantized):
            quantizer.quantize_weight(model.get_submodule(entry.name).weight.data, entry.scheme.weights, args).dequantize()
        per_layer = time.perf_counter() - started
        return {"seconds": round(per_layer * layers + (rotations or 0.0), 1), "one_layer_seconds": round(per_layer, 3),
                "layers": layers, **_rotated(rotations), "note": "quantization only; loading and writing the weights are not included"}
    from quantkit.calibration import calibrate

    count = min(samples, options.batch_size)  # one batch, timed by phase
    ids = torch.randint(0, 256, (count, options.sizes(recipe)[1]))
    timed, scale = _timed(recipe, samples, count)
    started = time.perf_counter()
    result = calibrate(model, plan, timed, ids, torch.device(options.device), options.batch_size)
    total = time.perf_counter() - started
    # GPTQ's solve and rounding, AutoRound's steps: the same for any number of samples
    measured = result.seconds.get("quantize", 0.0)
    steps = [t["seconds_per_step"] for t in result.tuning.values()]  # AutoRound: a step without the warm-up
    fixed = sum(steps) * scale if steps else measured
    per_layer = fixed + (total - measured) * samples / count * (RECOMPUTED_STAGE_INPUTS_COST if recomputed else 1.0)
    return {"seconds": round(per_layer * layers + (rotations or 0.0), 1), "one_layer_seconds": round(per_layer, 3),
            "layers": layers, **_rotated(rotations),
            "measured": {"samples": count, "seconds": round(total, 3), "quantize_seconds": round(fixed, 3)},
            "note": "calibration only; loading and writing the weights are not included"}


def one_layer_plan(plan: list[ModulePlan], model) -> list[ModulePlan]:
    """The run's plan (`prepared.plan`, as the format holds it: GGUF's mixture types for this layer of the real
    model's depth, llama.cpp's fallbacks for rows that are not whole K super-blocks) for the Linears of the
    one-layer `model` the time is measured on, each with the shape it has there (its lm_head's vocabulary is small)."""
    from dataclasses import replace

    from torch import nn

    by_name = {entry.name: entry for entry in plan}
    return [replace(by_name[name], in_features=m.in_features, out_features=m.out_features)
            for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def _rotation_seconds(prepared, recipe: Recipe, model, layers: int, vocab: int, plan, options) -> float | None:
    """The recipe's rotations of the one-layer `model` timed here (which leaves R4's hooks on it, so the timed
    calibration runs them), times the layers, plus the embeddings' and lm_head's at the real vocabulary size
    (from the rate per weight element of the layer's rotation); learned ones, their learning too
    (`_learning_seconds`); None without rotations."""
    if prepared.rotator is None:
        return None
    from quantkit.models import architectures
    from quantkit.quant.rotations import Rotator

    rotator = Rotator.of(recipe, model.config)
    layer = architectures.decoder_layers(model)[0]
    elements = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    head_share = 2 * vocab * model.config.hidden_size / max(1, elements)  # the embeddings and lm_head, in layers
    learning = _learning_seconds(rotator, model, plan, recipe, options) if rotator.learning is not None else 0.0
    started = time.perf_counter()
    rotator.rotate_layer(layer, 0)
    one = time.perf_counter() - started
    rest = head_share * one if rotator.r1 is not None else 0.0
    return one * layers + rest + learning * (layers + head_share / 2)  # a learning step computes lm_head, not the embeddings


TIMED_LEARNING_STEPS = 3


def _learning_seconds(rotator, model, plan, recipe: Recipe, options) -> float:
    """One decoder layer's share of learning the rotations: TIMED_LEARNING_STEPS steps of one batch on the one-layer
    `model` (the first a warm-up), times the recipe's steps; `rotator` then has the learned matrices."""
    import dataclasses

    import torch

    from quantkit.calibration.learned_rotations import learn_rotations
    from quantkit.quant.registry import Learning

    transform = rotator.learning
    timed = dataclasses.replace(transform, learn=Learning(TIMED_LEARNING_STEPS, transform.learn.learning_rate))
    rotator.learning = timed
    num_samples, seq_len = options.sizes(recipe)
    count = min(options.batch_size, num_samples)  # a step's batch
    ids = torch.randint(0, model.config.vocab_size, (count, seq_len))
    summary = learn_rotations(model, rotator, plan, recipe, ids, torch.device(options.device), options.batch_size)
    return summary["seconds_per_step"] * transform.learn.steps  # the median step after the first


def _rotated(rotations: float | None) -> dict:
    return {"rotations_seconds": round(rotations, 3)} if rotations is not None else {}


def _timed(recipe: Recipe, samples: int, count: int) -> tuple[Recipe, float]:
    """The recipe to time one layer with, and the factor from its time to the real run's (`Algorithm.timed`:
    AutoRound times a few of its steps)."""
    import dataclasses

    step = recipe.quantizer
    args, scale = step.algorithm.timed(step.arguments, samples, count)
    changed = {k: v for k, v in dataclasses.asdict(args).items() if getattr(step.arguments, k) != v}
    timed = dataclasses.replace(recipe, steps=(*recipe.before_quantizer, AlgorithmStep(step.name, {**step.args, **changed})))
    return timed, scale


def check_disk(report: dict, dst: str | Path) -> None:
    """Refuse, before any work, a DST whose file system cannot hold the output (and the resume state)."""
    from quantkit.errors import UsageError

    if report["fits_on_disk"] is False:
        raise UsageError(
            f"{dst} needs about {_gb(report['disk_needed_bytes'])} (output"
            f"{' and the resume state' if report['work_dir_bytes'] else ''}) but its file system has "
            f"{_gb(report['free_disk_bytes'])} free; free some space or choose another DST"
        )


_AWQ_OFFLOADED = "AWQ's attention and MLP inputs, offloaded to CPU memory"
# the peak RAM terms that grow with the calibration samples (`check_memory`)
_PER_SAMPLE = (_HIDDEN_STATES, _HELD_STAGE_INPUTS, _AWQ_OFFLOADED)


def _per_sample_terms() -> set[str]:
    """The terms that grow with the samples: the general ones and every algorithm's own (`per_sample_terms`)."""
    return {*_PER_SAMPLE, *(t for name in algorithms.names() for t in algorithms.get(name).per_sample_terms)}


def check_memory(report: dict, available: int | None = None) -> None:
    """Refuse, before any weight is loaded, a calibrated run whose estimated peak RAM is more than the machine has
    (`memory_shortfall`)."""
    from quantkit.errors import UsageError

    shortfall = memory_shortfall(report, available)
    if shortfall:
        raise UsageError(shortfall)


def memory_shortfall(report: dict, available: int | None = None) -> str | None:
    """Why a calibrated run cannot fit the machine (`available`: what the system could still give, plus what this
    process holds already), naming the --num-samples whose calibration activations would fit; None when it can.
    Judged on what the run cannot do without, the fixed cost and the terms that grow with the samples (hidden
    states, held inputs), not on the whole estimate: its other terms err on the safe side (GPTQ at 8B: +9%), and a
    run that would fit must not be refused."""
    shares = report.get("samples_per_rank")
    if not shares:
        return None
    if available is None:
        import psutil

        available = psutil.virtual_memory().available + peak_resident_bytes()
    breakdown = report["peak_ram_breakdown"]
    fixed = next(iter(breakdown.values()), 0)  # the process's own (python, torch, transformers): listed first
    terms = _per_sample_terms()
    growing = sum(v for k, v in breakdown.items() if k in terms)
    if fixed + growing <= available:
        return None
    per_sample = growing / max(1, max(shares))
    fits = int((available - fixed) // per_sample) * len(shares) if per_sample else 0
    advice = (f"pass --num-samples {fits} or fewer (or a shorter --seq-len)" if fits >= len(shares) else
              "even one sample does not fit: use a machine with more memory")
    return (f"the calibration activations alone need about {_gb(fixed + growing)} of RAM and this machine has "
            f"{_gb(available)} available; {advice}")


def _gb(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size / 1e3:.1f} kB"


def _numel(shape: list[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def _other_files(src: Path) -> int:
    """Config, tokenizer and the like: copied beside the weights."""
    return sum(f.stat().st_size for f in Path(src).iterdir()
               if f.is_file() and not f.name.endswith(".safetensors") and not f.name.endswith(".index.json"))


def _config(src: Path) -> dict:
    from quantkit.models.loading import read_config_json

    config = read_config_json(src)
    return config.get("text_config", config) if "hidden_size" not in config else config


def _stored_dtype(headers: dict) -> str:
    """The dtype most of the checkpoint's floating-point tensors are stored in (what `--dtype auto` loads)."""
    kinds = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    stored = [kinds[d] for d, _ in headers.values() if d in kinds]
    return max(set(stored), key=stored.count) if stored else "float32"


def _import_run_modules(recipe: Recipe) -> None:
    """What a real run imports before its peak, so that this process's size is the run's fixed cost."""
    import compressed_tensors  # noqa: F401
    import safetensors.torch  # noqa: F401

    if recipe.needs_calibration:
        import quantkit.calibration  # noqa: F401
        import quantkit.data  # noqa: F401


def reset_peak_resident() -> None:
    """Start `peak_resident_bytes` afresh from the current size (Linux's clear_refs; elsewhere nothing is reset),
    so that a peak measures one piece of work."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass


def resident_bytes() -> int:
    """This process's resident size now: VmRSS on Linux, else its peak so far (`peak_resident_bytes`)."""
    found = _status_bytes("VmRSS")
    return found if found is not None else peak_resident_bytes()


def peak_resident_bytes() -> int:
    """This process's peak resident size so far: VmHWM on Linux (ru_maxrss would include the memory of a parent
    that forked it, as it survives execve), else ru_maxrss (bytes on macOS)."""
    found = _status_bytes("VmHWM")
    if found is not None:
        return found
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _status_bytes(field: str) -> int | None:
    """A size from /proc/self/status (Linux), None elsewhere."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _free_disk(dst: str | Path) -> int:
    existing = next(p for p in [Path(dst).absolute(), *Path(dst).absolute().parents] if p.exists())
    return shutil.disk_usage(existing).free
