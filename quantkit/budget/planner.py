"""`finalize --target-bpw B`: a GGUF type for each tensor, chosen to meet an average of B bits per weight with the
least estimated error (`sensitivity.measure`, `solver.solve`).

Bits per weight are the file's: 8 x the bytes of every tensor it holds (quantized blocks with their scales, norms in
F32, whatever stays float in the artifact's dtype) over the model's parameter count, as llama.cpp reports a file's
BPW. The tensors the plan decides are the recipe's quantized Linears (lm_head included unless the recipe ignores
it) and the token embedding (K types: quantkit rounds it as llama.cpp's K quantizer does); a tensor a user's
`--tensor-type` names keeps that type, and its bytes count against the budget first.

The plan is a recipe: the base recipe (its algorithm and calibration; `gguf-q4-k-m`'s GPTQ on K grids by default)
without its mixture, plus one exact `tensor_types` entry per decided tensor. Written with `--save-plan FILE.yaml`,
`-q FILE.yaml` reproduces the artifact without measuring again; quantkit's record in the file holds it too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from quantkit.budget import sensitivity, solver
from quantkit.errors import UsageError
from quantkit.quant import gguf_types, tensor_types
from quantkit.quant.registry import Format, Recipe
from quantkit.runtime.progress import QUIET, Progress

DEFAULT_RECIPE = "gguf-q4-k-m"  # the algorithm and calibration of a plan when `-q` is not given: GPTQ on K grids
DEFAULT_CANDIDATES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
EMBEDDING = "token_embd"  # the token embedding's name in a plan


@dataclass
class BudgetPlan:
    recipe: Recipe  # the base recipe with the plan's tensor_types
    types: dict[str, str]  # decided tensor -> type
    target_bpw: float
    bits_per_weight: float  # the plan's, by the file's tensors (see the module docstring)
    tensor_bytes: int
    parameters: int
    estimated_kl: float
    measured: sensitivity.Sensitivity

    def to_dict(self) -> dict:
        return {"target_bpw": self.target_bpw, "bits_per_weight": round(self.bits_per_weight, 4),
                "tensor_bytes": self.tensor_bytes, "parameters": self.parameters,
                "estimated_kl": self.estimated_kl, "types": self.types,
                "sensitivity": {"errors": self.measured.errors, "gains": self.measured.gains,
                                "role_kl": self.measured.role_kl, "seconds": self.measured.seconds,
                                "tokens": self.measured.tokens, "probe_tokens": self.measured.probe_tokens}}


def parse_candidates(text: str | None) -> tuple[str, ...]:
    """`--candidates q2_k,q4_k,...` as GGML type names (DEFAULT_CANDIDATES when None)."""
    if text is None:
        return DEFAULT_CANDIDATES
    try:
        found = tuple(dict.fromkeys(gguf_types.canonical(t) for t in text.split(",") if t.strip()))
    except ValueError as exc:
        raise UsageError(f"--candidates: {exc.args[0].split(': ', 1)[-1]}") from exc
    if not found:
        raise UsageError("--candidates is empty; give GGML types separated by commas, e.g. q3_k,q4_k,q6_k")
    return found


def check_target(target_bpw: float) -> None:
    if not 1.0 <= target_bpw <= 32.0:
        raise UsageError(f"--target-bpw {target_bpw}: give an average of bits per weight between 1 and 32, e.g. 4.5")


def plan(src: Path, recipe: Recipe, target_bpw: float | None, options, candidates: tuple[str, ...] = DEFAULT_CANDIDATES,
         dtype: str = "auto", trust_remote_code: bool = False, progress: Progress = QUIET,
         target_bytes: int | None = None) -> BudgetPlan:
    """The budget plan of `src` under `recipe` (see the module docstring): `target_bpw` bits per weight, or
    `target_bytes` of tensors (`--target-size`: the file is that and its header, the tokenizer and metadata, a few
    MB at most); `options`: finalize's CalibrationOptions, whose data the sensitivity is measured on."""
    from quantkit.finalization.checks import calibration_samples, prepare
    from quantkit.models import loading as models
    from quantkit.models import moe

    if target_bpw is not None:
        check_target(target_bpw)
    if not options.data and not recipe.calibration.dataset:
        raise UsageError("a budget plan measures each tensor's sensitivity on data: pass --calib-data FILE")
    base = replace(recipe, mixture=None)
    prepared = prepare(src, base, Format.GGUF, trust_remote_code, dtype=dtype)
    with progress.task("Budget: measuring each tensor's sensitivity"):
        samples = calibration_samples(prepared.src, base, options, trust_remote_code)
        model = moe.linearize(models.load_model(prepared.src, prepared.dtype or dtype, trust_remote_code)).eval()
        decided, members, fixed_bytes, parameters = _decisions(model, prepared.plan, base, candidates)
        sizes = {name: {t: sum(gguf_types.tensor_bytes(t, *_shape(model, m)) for m in members[name]) for t in types}
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
        measured = sensitivity.measure(model, decided, roles, samples, EMBEDDING if EMBEDDING in decided else None, members)
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


def _decisions(model: torch.nn.Module, plan, recipe: Recipe, candidates: tuple[str, ...]) -> tuple[dict, dict, int, int]:
    """({tensor: its candidate types}, {tensor: its Linears}, bytes of every other tensor of the file, the parameter
    count). A tensor is a Linear, the token embedding (EMBEDDING), or an MoE layer's experts of one projection,
    named as GGUF stacks them (`blk.N.ffn_down_exps`): they take one type."""
    from quantkit.export.gguf import ggml_type
    from quantkit.models.architectures import expert_projection

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    decided, members, fixed, planned = {}, {}, 0, {}
    for entry in plan:
        names = (entry.name, tensor_types.gguf_name(entry.name) or "")
        fitting = [t for t in candidates if gguf_types.spec(t) is not None and gguf_types.fits(t, entry.in_features)]
        if entry.quantized and fitting and tensor_types.type_for(names, recipe.tensor_types) is None:
            unit = names[1] if expert_projection(entry.name) is not None else entry.name
            decided[unit] = fitting
            members.setdefault(unit, []).append(entry.name)
        else:
            planned[entry.name] = ggml_type(entry.scheme.weights).name if entry.quantized else None
    embedding = model.get_input_embeddings().weight
    k_types = [t for t in candidates if t.endswith("_K") and gguf_types.fits(t, embedding.shape[1])]
    embedding_free = tensor_types.type_for(tensor_types.EMBEDDING_NAMES, recipe.tensor_types) is None
    if not tied and k_types and embedding_free:
        decided[EMBEDDING], members[EMBEDDING] = k_types, [EMBEDDING]
    decided_linears = {m for unit, linears in members.items() if unit != EMBEDDING for m in linears}
    parameters = 0
    for name, param in model.named_parameters():  # a tied lm_head is the embedding's parameter: counted once
        parameters += param.numel()
        owner = name.rpartition(".")[0]
        if param is embedding:
            if EMBEDDING in decided or (tied and "lm_head" in decided_linears):
                continue  # decided: as itself, or as the tied output llama.cpp reads from token_embd
            kind = _embedding_type(recipe, model.config)
        elif name.endswith(".weight") and owner in decided_linears:
            continue
        else:
            kind = planned.get(owner) if name.endswith(".weight") else None
        fixed += gguf_types.tensor_bytes(kind, *param.shape) if kind else _float_bytes(param)
    return decided, members, fixed, parameters


def _embedding_type(recipe: Recipe, config) -> str | None:
    from quantkit.export.gguf import embedding_type

    return embedding_type(recipe, config)


def _float_bytes(param: torch.Tensor) -> int:
    """As the GGUF writer stores a float tensor: 1-D ones in F32, matrices in their dtype (F32, BF16 or F16)."""
    return param.numel() * (4 if param.dim() == 1 else min(param.element_size(), 4))


def _shape(model: torch.nn.Module, name: str) -> tuple[int, int]:
    weight = model.get_input_embeddings().weight if name == EMBEDDING else model.get_submodule(name).weight
    return tuple(weight.shape)


def _role(name: str) -> str:
    """A tensor's role for the sensitivity's gains: GGUF's name without its layer (`ffn_down`, `output`, ...)."""
    if name == EMBEDDING:
        return EMBEDDING
    gguf = tensor_types.gguf_name(name) or name
    return re.sub(r"^blk\.\d+\.", "", gguf)
