"""What a layer step works on (`Layer`: one decoder layer's turn) and what the run accumulates
(`CalibrationResult`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch
from torch import nn

from quantkit.models.architectures import LayerWiring, kernel_fused_groups, traced_wiring, wiring_of
from quantkit.models.moe import MoEWiring, is_moe_layer, traced_moe_wiring
from quantkit.quant.plan import ModulePlan
from quantkit.grids.qparams import QuantizedWeight, fused_global_scales
from quantkit.quant.registry import Recipe
from quantkit.runtime.distributed import Context

ERROR_ROWS = 256  # output rows the Hessian-weighted error is measured on (evenly spaced): an estimate, cheap


@dataclass
class CalibrationResult:
    qweights: dict[str, QuantizedWeight] = field(default_factory=dict)
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # static activation scales
    kv_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # "<attention>.k_scale" / ".v_scale" -> KV cache scale
    kv_ranges: dict[str, float] = field(default_factory=dict)  # the same names -> largest |key| / |value| seen (the summary's)
    errors: dict[str, float] = field(default_factory=dict)  # relative output error per module
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # per phase
    wall_seconds: float = 0.0  # the whole calibration's: its phases and what none of them counts
    peak_device_bytes: int = 0
    peak_device_reserved_bytes: int = 0  # on a GPU: what torch's allocator reserved at most (its cache included)
    device_outside_allocator_bytes: int = 0  # on a GPU: the most its memory in use exceeded what torch reserved
    gptq_rows: list[int] | None = None  # distributed GPTQ: weight rows each rank solved
    skipped: dict[str, str] = field(default_factory=dict)  # transforms not applied: "smoothquant: q_proj, ..." -> why
    true_sequential: bool = False  # GPTQ ran stage by stage in one pass per layer (`true_sequential`)
    stage_inputs_held: bool | None = None  # and held its stages' inputs (`runtime.placement.holds_stage_inputs`)
    routed_tokens: dict[str, list[int]] = field(default_factory=dict)  # MoE experts module -> tokens routed to each expert
    tuning: dict[str, dict] = field(default_factory=dict)  # AutoRound: decoder layer -> its output loss before/after tuning


@dataclass
class Layer:
    """One decoder layer's turn in the pipeline: everything a layer step reads, and the result it adds to."""

    module: nn.Module  # the decoder layer, on the compute device
    prefix: str  # its qualified name, e.g. "model.layers.3"
    index: int
    inputs: list[tuple]  # (args, kwargs) of this layer's call for each of this rank's calibration batches
    plan: dict[str, ModulePlan]  # the whole model's plan, by qualified module name
    recipe: Recipe
    result: CalibrationResult
    ctx: Context | None = None
    # the float model's hidden states entering this layer, batch by batch, for a step that tunes against the float
    # model (AutoRound); such a step replaces them with the float layer's outputs on them (the next layer's).
    # None: the pipeline does not carry them for this recipe
    float_hidden: list[torch.Tensor] | None = None
    # set by the pipeline: drops what else references `inputs` (a resume checkpoint held back), for `take_inputs`
    release_inputs: Callable[[], None] | None = None
    inputs_read_after_quantizer: bool = False  # a step after the quantizer reads `inputs` (KV cache scales)

    def take_inputs(self, last: bool = False) -> bool:
        """Whether the caller may consume `inputs`: overwrite them in place (GPTQ's staged pass builds the residual
        stream in them) or free them batch by batch (`last`: their last reader, the propagation after the steps or
        the KV cache step). The quantizer may when no step after it reads them; their last reader always may. If
        so, nothing else reads them once this returns."""
        if self.release_inputs is None or (self.inputs_read_after_quantizer and not last):
            return False
        self.release_inputs()
        return True

    @cached_property
    def linears(self) -> dict[str, nn.Module]:
        """This layer's Linear modules the plan quantizes, by qualified name, in module order."""
        named = self.module.named_modules(prefix=self.prefix)
        return {name: m for name, m in named if name in self.plan and self.plan[name].quantized}

    @property
    def wiring(self) -> LayerWiring:
        """The wiring its module names give (`architectures.wiring_of`)."""
        return wiring_of(self.module)

    @cached_property
    def traced_wiring(self) -> LayerWiring | MoEWiring:
        """The wiring with the norms the Linears really read, from one run on the first batch: what folding needs
        (an MoE layer's says which modules read its MoE block's input, `moe.MoEWiring`)."""
        if is_moe_layer(self.module):
            return traced_moe_wiring(self.module, self.inputs[0])
        return traced_wiring(self.module, self.inputs[0])

    def global_scales(self) -> dict[str, torch.Tensor]:
        """NVFP4: each quantized Linear's weight global scale, shared by the Linears a kernel fuses (q/k/v, gate/up:
        `architectures.kernel_fused_groups`), from their weights as they are now. Empty for other grids."""
        weights = {n: m.weight.data for n, m in self.linears.items() if self.plan[n].scheme.weights.global_scale}
        return fused_global_scales(weights, kernel_fused_groups(list(weights)))

    @property
    def distributed(self) -> bool:
        return self.ctx is not None and self.ctx.distributed

    def skip(self, step: str, linears: tuple[str, ...], reason: str) -> None:
        """A transform left these Linears alone (noted once per run, for the summary)."""
        self.result.skipped.setdefault(f"{step}: {', '.join(linears)}", reason)

    def record(self, name: str, qweight: QuantizedWeight, error: float) -> None:
        """Keep a module's qparams and error; its weight becomes the dequantized grid values (the layers after it
        see the quantized output)."""
        module = self.linears[name]
        module.weight.data = qweight.dequantize(module.weight.dtype)
        self.result.qweights[name], self.result.errors[name] = qweight, error


def relative_error(weight: torch.Tensor, qweight: QuantizedWeight, hessian: torch.Tensor | None) -> float:
    """||(W - Q) X|| / ||W X|| through the Hessian (on up to ERROR_ROWS evenly spaced output rows: the exact
    value costs as much as GPTQ itself), else on the weights."""
    if hessian is None:
        delta = weight.float() - qweight.dequantize(torch.float32)
        return (delta.norm() / weight.float().norm().clamp(min=1e-12)).item()
    both = _error_rows(weight, qweight)
    return _ratio((both @ hessian) * both)


def relative_error_factored(weight: torch.Tensor, qweight: QuantizedWeight, factor) -> float:
    """`relative_error` through the damped Hessian that GPTQ's inverse factor stands for (`InverseHessian`:
    (H + damp I)^-1 = U^T U, so x (H + damp I) x^T = ||x U^-1||^2, one triangular solve; dead inputs left out as
    H leaves them out), so that the Hessian can be freed before the solve: for a down_proj that is as large as
    the factor itself (121 MiB at 5632 inputs, 3.3 GB at 28672)."""
    solved = _through_factor(_error_rows(weight, qweight), factor)
    return _ratio(solved * solved)


def relative_error_of_solve(weight: torch.Tensor, row_errors: torch.Tensor, factor) -> float:
    """`relative_error_factored` from the squared output errors GPTQ's solve gave each row (`row_errors`, from
    `gptq_quantize_rows`): only the weight's side, ||W U^-1||^2, is solved for (on the same ERROR_ROWS rows), half
    the work. The same value up to float32 rounding (tested)."""
    rows = _sampled_rows(weight)
    solved = _through_factor(weight[rows].float(), factor)  # W U^-1
    error = row_errors[rows.to(row_errors.device)].double().sum()
    return (error / solved.square().sum(dtype=torch.float64).clamp(min=1e-12)).sqrt().item()


def _through_factor(rows: torch.Tensor, factor) -> torch.Tensor:
    """rows @ U^-1 (float32 rows, modified): dead inputs zeroed, columns in the factor's order, one triangular solve."""
    rows[:, factor.dead.to(rows.device)] = 0.0
    if factor.perm is not None:
        rows = rows[:, factor.perm.to(rows.device)]
    return torch.linalg.solve_triangular(factor.upper, rows, upper=True, left=False)


def _sampled_rows(weight: torch.Tensor) -> torch.Tensor:
    """Up to ERROR_ROWS evenly spaced output rows."""
    return torch.linspace(0, weight.shape[0] - 1, min(ERROR_ROWS, weight.shape[0]), device=weight.device).long()


def _error_rows(weight: torch.Tensor, qweight: QuantizedWeight) -> torch.Tensor:
    """(W - Q) on up to ERROR_ROWS evenly spaced output rows, stacked over W on the same rows (float32)."""
    rows = _sampled_rows(weight)
    picked = weight[rows].float()
    return torch.cat([picked - qweight.dequantize(torch.float32)[rows], picked])


def _ratio(weighted: torch.Tensor) -> float:
    """sqrt(sum of the error rows' terms / sum of the weight rows'), from `_error_rows`' two halves."""
    num, den = weighted.sum(-1).chunk(2)
    return (num.sum() / den.sum().clamp(min=1e-12)).sqrt().item()
