"""`finalize --target-bpw B` / `--target-size S`: a type for each tensor, chosen to meet an average of B bits per
weight (or S bytes of tensors) with the least estimated error (`sensitivity.measure`, `solver.solve`). In a GGUF file
the types are GGML types; in a compressed-tensors artifact, recipes' schemes (`gptq-w4a16`, `gptq-w8a16`: each a
config group vLLM runs side by side); in an MLX directory, MLX recipes' bit widths (`mlx-3bit-g64` ... `mlx-8bit-g64`:
per-layer entries of config.json's `quantization`, mlx-lm's mixed bits).

Bits per weight are the artifact's: 8 x the bytes of every tensor it holds (quantized weights with their scales and
zero points, as the format's `weight_bytes` counts them; norms in F32 in GGUF; whatever stays float in the
artifact's dtype) over the model's parameter count, as llama.cpp reports a file's BPW. The tensors the plan decides
are the recipe's quantized Linears (lm_head included unless the recipe ignores it) and, in GGUF, the token
embedding (K types: quantkit rounds it as llama.cpp's K quantizer does), in MLX too where the recipe quantizes it
(mlx-lm's QuantizedEmbedding); a tensor a user's `--tensor-type` names
keeps that type, and its bytes count against the budget first.

The plan is a recipe: the base recipe (its algorithm and calibration; `gguf-q4-k-m`'s GPTQ on K grids by default)
without its mixture, plus one exact `tensor_types` entry per decided tensor. Written with `--save-plan FILE.yaml`,
`-q FILE.yaml` reproduces the artifact without measuring again; quantkit's record in the artifact holds it too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from quantkit.budget import sensitivity, solver
from quantkit.errors import UsageError
from quantkit.export import FORMATS, GGML
from quantkit.grids.schemes import QuantScheme, SchemeError
from quantkit.quant import gguf_types, tensor_types
from quantkit.quant.registry import Format, Recipe, tensor_type_spec
from quantkit.runtime import distributed
from quantkit.runtime.distributed import Context
from quantkit.runtime.progress import QUIET, Progress

DEFAULT_RECIPE = "gguf-q4-k-m"  # the algorithm and calibration of a plan when `-q` is not given: GPTQ on K grids
EMBEDDING = "token_embd"  # the token embedding's name in a plan


@dataclass
class BudgetPlan:
    recipe: Recipe  # the base recipe with the plan's tensor_types
    types: dict[str, str]  # decided tensor -> type
    target_bpw: float
    bits_per_weight: float  # the plan's, by the artifact's tensors (see the module docstring)
    tensor_bytes: int
    parameters: int
    estimated_kl: float
    measured: sensitivity.Sensitivity

    def to_dict(self) -> dict:
        return {"target_bpw": self.target_bpw, "bits_per_weight": round(self.bits_per_weight, 4),
                "tensor_bytes": self.tensor_bytes, "parameters": self.parameters,
                "estimated_kl": self.estimated_kl, "types": self.types,
                "sensitivity": {"errors": self.measured.errors, "gains": self.measured.gains,
                                "role_kl": self.measured.role_kl, "discounts": self.measured.discounts,
                                "seconds": self.measured.seconds,
                                "tokens": self.measured.tokens, "probe_tokens": self.measured.probe_tokens}}


def parse_candidates(text: str | None, fmt: Format) -> tuple[str, ...]:
    """`--candidates q2_k,q4_k,...` (GGUF: GGML types) or `gptq-w4a16,gptq-w8a16` (compressed-tensors: recipes);
    the format's defaults (`Registration.budget_candidates`) when None."""
    if text is None:
        return FORMATS[fmt].budget_candidates
    try:
        found = tuple(dict.fromkeys(tensor_types.type_name(t) for t in text.split(",") if t.strip()))
        for name in found:
            tensor_type_spec(name)
    except SchemeError as exc:
        raise UsageError(f"--candidates: {exc.message}") from exc
    if not found:
        raise UsageError("--candidates is empty; give types separated by commas, e.g. q3_k,q4_k,q6_k (GGUF) or "
                         "gptq-w4a16,gptq-w8a16 (compressed-tensors)")
    ggml = FORMATS[fmt].tensor_types == GGML
    wrong = [t for t in found if tensor_types.is_ggml(t) != ggml or t == gguf_types.FLOAT]
    if wrong:
        examples = ", ".join(FORMATS[fmt].budget_candidates[:2])
        kind = "GGML types (q4_k, q6_k, ...)" if ggml else f"recipes whose schemes it takes ({examples}, ...)"
        raise UsageError(f"--candidates: {wrong[0]} is not a candidate for {fmt.value}, which takes {kind}")
    if not ggml:  # a recipe whose scheme the format does not hold: refused before the sensitivity is measured
        from quantkit.export import exporter
        from quantkit.quant.registry import resolve

        plugin = exporter(fmt)
        for name in found:
            if problem := plugin.unsupported(plugin.for_format(resolve(name))):
                raise UsageError(f"--candidates: {name}: {problem}")
    return found


def check_target(target_bpw: float) -> None:
    if not 1.0 <= target_bpw <= 32.0:
        raise UsageError(f"--target-bpw {target_bpw}: give an average of bits per weight between 1 and 32, e.g. 4.5")


def plan(src: Path, recipe: Recipe, target_bpw: float | None, options, candidates: tuple[str, ...] | None = None,
         dtype: str = "auto", trust_remote_code: bool = False, progress: Progress = QUIET,
         target_bytes: int | None = None, fmt: Format | None = None, in_memory: bool = False,
         ctx: Context | None = None) -> BudgetPlan:
    """The budget plan of `src` under `recipe` for `fmt` (the recipe's by default; GGUF or compressed-tensors; see
    the module docstring): `target_bpw` bits per weight, or `target_bytes` of tensors (`--target-size`: the file
    adds its header, the tokenizer and metadata in GGUF); `options`: finalize's CalibrationOptions, whose data the
    sensitivity is measured on. The model is streamed (one decoder layer in memory) unless `in_memory` or it cannot
    be; with a distributed `ctx`, the ranks share the measuring and every rank gets the same plan."""
    from quantkit.finalization.checks import calibration_samples, prepare
    from quantkit.finalization.finalize import open_streamed
    from quantkit.models import loading as models
    from quantkit.models import moe

    fmt = fmt or recipe.format
    candidates = candidates or FORMATS[fmt].budget_candidates
    if target_bpw is not None:
        check_target(target_bpw)
    if not options.data and not recipe.calibration.dataset:
        raise UsageError("a budget plan measures each tensor's sensitivity on data: pass --calib-data FILE")
    base = replace(recipe, mixture=None)
    prepared = prepare(src, base, fmt, trust_remote_code, in_memory=in_memory, dtype=dtype)
    with progress.task("Budget: reading the model and the calibration data"):
        samples = calibration_samples(prepared.src, base, options, trust_remote_code)
        streamed = open_streamed(prepared, trust_remote_code)
        model = streamed.model if streamed is not None else \
            moe.linearize(models.load_model(prepared.src, prepared.dtype or dtype, trust_remote_code)).eval()
        layers = _rotated(model, streamed, prepared.rotator)
        sizing = _Sizing(fmt, base, model)
        decided, members, fixed_bytes, parameters = _decisions(model, prepared.plan, base, candidates, sizing)
        sizes = {name: {t: sum(sizing.candidate_bytes(t, m) for m in members[name]) for t in types}
                 for name, types in decided.items()}
        if target_bpw is None:
            target_bpw = target_bytes * 8 / parameters
        asked = f"--target-bpw {target_bpw}" if target_bytes is None else f"--target-size {target_bytes:,} bytes"
        budget = (int(target_bpw * parameters / 8) if target_bytes is None else target_bytes) - fixed_bytes
        least = fixed_bytes + sum(min(by_type.values()) for by_type in sizes.values())
        if least > budget + fixed_bytes:  # before measuring: the sizes alone decide it
            raise UsageError(f"{asked} is below what the candidates can reach here ({least * 8 / parameters:.3f} bits per "
                             f"weight, {least:,} bytes, with each tensor in its smallest); raise it or add smaller --candidates")
        roles = {name: _role(name) for name in decided}
        smallest = {name: min(by_type, key=by_type.get) for name, by_type in sizes.items()}
    device = ctx.device if ctx is not None else distributed.rank_device(options.device, 0)
    step = base.quantizer
    measured = sensitivity.measure(model, decided, roles, samples, EMBEDDING if EMBEDDING in decided else None,
                                   members, smallest, layers, ctx, device, progress,
                                   lambda w, h, spec: step.algorithm.quantize_with_hessian(w, h, spec, step.arguments))
    choices = [solver.Choice(name, tuple(solver.Option(t, size, measured.errors[name][t]) for t, size in by_type.items()))
               for name, by_type in sizes.items()]
    chosen = solver.solve(choices, budget)
    used, error = solver.total(chosen)
    types = {name: option.type for name, option in chosen.items()}
    planned = tuple(f"^{re.escape(member)}$={t}" for name, t in types.items() for member in members[name])
    result = replace(base, tensor_types=recipe.tensor_types + planned,
                     description=f"quantkit's budget plan: {target_bpw:.4g} bits per weight, {recipe.name}'s algorithm and calibration")
    return BudgetPlan(result, types, target_bpw, (fixed_bytes + used) * 8 / parameters, fixed_bytes + used, parameters,
                      error, measured)


def _rotated(model: torch.nn.Module, streamed, rotator):
    """Where the sensitivity pass reads the layers from: the model as the recipe's rotations leave it (a recipe's
    `transforms`: its fused R1 / R2, as finalize applies them), the streamed model's layers rotated as they are
    read. Learned rotations are learned by the calibrated run itself: the plan is measured on the model unrotated."""
    if rotator is None or rotator.learning is not None:
        return streamed
    if streamed is None:
        rotator.rotate_model(model)
        return None
    return _RotatedLayers(streamed, rotator)


class _RotatedLayers:
    """A streamed model's decoder layers and the modules outside them, rotated as they are read (as finalize's
    `_LayerIO` does)."""

    def __init__(self, streamed, rotator):
        self.streamed, self.rotator = streamed, rotator

    def load(self, module: torch.nn.Module) -> None:
        self.streamed.load(module)
        self.rotator.rotate_layer(module)

    def release(self, module: torch.nn.Module) -> None:
        self.streamed.release(module)

    def load_rest(self) -> None:
        self.streamed.load_rest()
        self.rotator.rotate_rest(self.streamed.model)

    def release_rest(self) -> None:
        self.streamed.release_rest()


class _Sizing:
    """Bytes of a tensor in the artifact of `fmt`, as its exporter counts them (`weight_bytes`)."""

    def __init__(self, fmt: Format, recipe: Recipe, model: torch.nn.Module):
        from quantkit.export import exporter

        from quantkit.models import moe

        self.recipe, self.model, self.exporter, self.registration = recipe, model, exporter(fmt), FORMATS[fmt]
        self.fmt = fmt
        self.element_size = next(model.parameters()).element_size()
        self.routers = set(moe.gates(model)) if self.registration.vectors_float32 else set()

    @property
    def embedding_decided(self) -> bool:
        """Whether the token embedding is a tensor of the plan: in GGUF (K types), in MLX where the recipe quantizes
        it (mlx-lm's QuantizedEmbedding: the candidates' grids), not in a format that keeps it float."""
        if self.registration.tensor_types == GGML:
            return True
        return self.exporter.embedding_weights(self.recipe, self.model.config) is not None

    def embedding_types(self, candidates: tuple[str, ...], columns: int) -> list[str]:
        """The candidates the token embedding may take: GGUF's K types (quantkit rounds it as llama.cpp's K quantizer
        does), MLX's grids whose groups divide it."""
        if self.registration.tensor_types == GGML:
            return [t for t in candidates if t.endswith("_K") and gguf_types.fits(t, columns)]
        return [t for t in candidates if self.fits(t, columns)]

    def fits(self, type_name: str, columns: int) -> bool:
        spec = tensor_type_spec(type_name)
        return spec is not None and tensor_types.fits(spec, type_name, columns)

    def fitting(self, candidates: tuple[str, ...], columns: int) -> list[str]:
        """The candidates a Linear of `columns` inputs may take. In GGUF a K type its rows are not whole super-blocks
        of is its llama.cpp fallback there (Q2_K / Q3_K -> Q4_0, Q4_K -> Q5_0, Q6_K -> Q8_0), as the file writes it:
        an MoE's 384-wide experts get Q4_0 ... Q8_0, not Q8_0 alone."""
        if self.registration.tensor_types == GGML:
            candidates = tuple(dict.fromkeys(t if self.fits(t, columns) else (self.exporter.fallback_type(t) or t)
                                             for t in candidates))
        return [t for t in candidates if self.fits(t, columns)]

    def candidate_bytes(self, type_name: str, name: str) -> int:
        rows, columns = _shape(self.model, name)
        if name == EMBEDDING and self.registration.tensor_types == GGML:
            return gguf_types.tensor_bytes(type_name, rows, columns)
        if name == EMBEDDING:
            return self.planned_bytes(QuantScheme(tensor_type_spec(type_name)), rows, columns)
        return self.planned_bytes(QuantScheme(tensor_type_spec(type_name), self.recipe.scheme.activations), rows, columns)

    def planned_bytes(self, scheme: QuantScheme, rows: int, columns: int) -> int:
        from quantkit.quant.plan import ModulePlan

        return self.exporter.weight_bytes(ModulePlan("", columns, rows, scheme), self.element_size)

    def float_bytes(self, name: str, param: torch.Tensor) -> int:
        """GGUF stores 1-D tensors and MoE routers (ffn_gate_inp) in F32, other matrices in their dtype;
        compressed-tensors everything in its dtype."""
        float32 = self.registration.vectors_float32 and (param.dim() == 1 or name.rpartition(".")[0] in self.routers)
        return param.numel() * (4 if float32 else param.element_size())


def _decisions(model: torch.nn.Module, plan, recipe: Recipe, candidates: tuple[str, ...], sizing: _Sizing) -> tuple[dict, dict, int, int]:
    """({tensor: its candidate types}, {tensor: its Linears}, bytes of every other tensor of the artifact, the
    parameter count). A tensor is a Linear, the token embedding (EMBEDDING, GGUF and MLX), or an MoE layer's experts of
    one projection, named as GGUF stacks them (`blk.N.ffn_down_exps`): they take one type (in both formats). Where
    the engine runs kernel-fused siblings as one layer (`fused_siblings_share_a_type`: vLLM's q/k/v and gate/up, an
    MoE layer's experts), they are one tensor too, named by the first of them."""
    from quantkit.models.architectures import expert_projection, kernel_fused_groups

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    decided, members, fixed, planned = {}, {}, 0, {}
    fused = {}
    if sizing.registration.fused_siblings_share_a_type:
        fused = {m: group[0] for group in kernel_fused_groups([e.name for e in plan if e.quantized]) for m in group}
    for entry in plan:
        names = tensor_types.names_of(entry.name)
        fitting = sizing.fitting(candidates, entry.in_features)
        if entry.quantized and fitting and tensor_types.type_for(names, recipe.tensor_types) is None:
            unit = names[1] if expert_projection(entry.name) is not None else fused.get(entry.name, entry.name)
            if fused and expert_projection(entry.name) is not None:  # one FusedMoE layer: its projections together
                unit = re.sub(r"ffn_(gate|up|down)_exps$", "ffn_gate_exps", unit)
            fitting = [t for t in decided.get(unit, fitting) if t in fitting]
            decided[unit] = fitting
            members.setdefault(unit, []).append(entry.name)
        elif entry.quantized:
            planned[entry.name] = entry.scheme
    embedding = model.get_input_embeddings().weight
    k_types = sizing.embedding_types(candidates, embedding.shape[1])
    embedding_free = tensor_types.type_for(tensor_types.EMBEDDING_NAMES, recipe.tensor_types) is None
    if sizing.embedding_decided and not tied and k_types and embedding_free:
        decided[EMBEDDING], members[EMBEDDING] = k_types, [EMBEDDING]
    decided_linears = {m for unit, linears in members.items() if unit != EMBEDDING for m in linears}
    parameters = 0
    for name, param in model.named_parameters():  # a tied lm_head is the embedding's parameter: counted once
        parameters += param.numel()
        owner = name.rpartition(".")[0]
        if param is embedding:
            if EMBEDDING in decided or (tied and "lm_head" in decided_linears):
                continue  # decided: as itself, or (GGUF) as the tied output llama.cpp reads from token_embd
            spec = sizing.exporter.embedding_weights(recipe, model.config)  # a mixture's or an override's, in GGUF
            if tied and "lm_head" in planned and sizing.registration.tied_embedding_on_output_grid:
                spec = planned["lm_head"].weights
            fixed += sizing.planned_bytes(QuantScheme(spec), *param.shape) if spec else sizing.float_bytes(name, param)
        elif name.endswith(".weight") and owner in decided_linears:
            continue
        elif name.endswith(".weight") and owner in planned:
            fixed += sizing.planned_bytes(planned[owner], *param.shape)
        else:
            fixed += sizing.float_bytes(name, param)
    return decided, members, fixed, parameters


def _shape(model: torch.nn.Module, name: str) -> tuple[int, int]:
    weight = model.get_input_embeddings().weight if name == EMBEDDING else model.get_submodule(name).weight
    return tuple(weight.shape)


def _role(name: str) -> str:
    """A tensor's role for the sensitivity's gains: GGUF's name without its layer (`ffn_down`, `output`, ...)."""
    if name == EMBEDDING:
        return EMBEDDING
    gguf = tensor_types.gguf_name(name) or name
    return re.sub(r"^blk\.\d+\.", "", gguf)
