"""What an algorithm is to the rest of quantkit: one object that says everything the pipeline, the preflight,
finalize, the recipe registry, the CLI, QAT and the exporters ask about it. None of them names an algorithm.

An algorithm is a subclass of `Algorithm` in its own module under `quantkit.algorithms.methods`, registered with
`@register`; `quantkit.algorithms` imports those modules in one list. Each declares, as class attributes:

- `name`: what recipes say (`algorithm: {name: gptq}`), and `Arguments`: its recipe arguments, a frozen
  dataclass that validates itself in `__post_init__` and is the pure function's `args` parameter;
- `quantizer`: it rounds the weights (a recipe's last step), else it transforms the layer before the quantizer;
- `needs_data`: it reads calibration data. A data-free quantizer streams like round-to-nearest: it defines
  `quantize_weight`, and the calibration layer step `quantize_step` runs it where a calibrated recipe needs it
  (after AWQ, with static activation scales);
- `step`: the module of its calibration layer step (`quantkit.calibration.steps.<module>`), or None;
- behaviour the pipeline and the preflight plan for (`staged`, `float_reference`, `calibrates_head`, `learns_ranges`, `qat_ready`,
  `qat_substitute`), and methods with defaults: `refusal` (what it refuses for a scheme), the preflight terms
  (`calibration_bytes`, `device_bytes`, `timed`, `grid_share`, `rows_per_rank`) and the summary (`summary`,
  `summary_lines`).

This module imports no torch: recipes are parsed and checked without it.
"""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from quantkit.grids.schemes import QuantScheme, SchemeError
from quantkit.runtime.registration import Registry


@dataclass(frozen=True)
class NoArguments:
    """An algorithm without recipe arguments."""


class Algorithm:
    """One algorithm. Subclasses set the class attributes and override what differs from these defaults."""

    name: ClassVar[str]
    Arguments: ClassVar[type] = NoArguments
    quantizer: ClassVar[bool] = True  # rounds the weights; False: a transform before the quantizer
    needs_data: ClassVar[bool] = True  # reads calibration data
    step: ClassVar[str | None] = None  # its calibration layer step's module under quantkit.calibration.steps
    staged: ClassVar[bool] = False  # a quantizer run in one staged pass per layer where the layer allows (GPTQ's)
    float_reference: ClassVar[bool] = False  # tunes against the float model's hidden states, kept beside the quantized
    learns_ranges: ClassVar[bool] = False  # learns each group's clipping: scales no fixed-minimum grid holds exactly
    qat_ready: ClassVar[bool] = False  # its rounding is the fake quantizer's: QAT trains on what it writes
    rounds_to_nearest: ClassVar[bool] = False  # what a format that quantizes while loading (torchao) computes itself
    qat_substitute: ClassVar[str | None] = None  # the data-free algorithm a QAT model converts with on a grid it
    # only rounds onto (GPTQ on a K grid: llama.cpp's own rounding, which training saw)
    calibrates_head: ClassVar[bool] = False  # its layer step also calibrates a lone Linear fed the final norm's
    # output (lm_head, where a format quantizes it), without the layer's outputs (the logits)
    searches_blocks: ClassVar[bool] = False  # scores candidate scales on each block's inputs (AWQ)
    per_sample_terms: ClassVar[tuple[str, ...]] = ()  # its preflight memory terms that grow with the samples

    # ---------------------------------------------------------------- the recipe

    def parse_arguments(self, values: dict[str, Any]) -> dict[str, Any]:
        """`values` checked against the arguments' signature and field types (floats given as ints become floats),
        then built so that `__post_init__` checks the ranges; SchemeError names the argument at fault."""
        allowed = inspect.signature(self.Arguments).parameters
        hints = typing.get_type_hints(self.Arguments)
        checked = {}
        for key, value in values.items():
            if key not in allowed:
                choices = ", ".join(sorted(allowed)) or "none"
                raise SchemeError(key, f"unknown argument for {self.name}; allowed: {choices}")
            checked[key] = _typed(key, value, hints[key])
        self.Arguments(**checked)
        return checked

    def arguments(self, values: dict[str, Any]) -> Any:
        """The argument dataclass of a recipe step's checked values, defaults filled in."""
        return self.Arguments(**values)

    def refusal(self, scheme: QuantScheme) -> str | None:
        """Why this algorithm cannot produce `scheme`, or None (checked when a recipe is read)."""
        return None

    # ---------------------------------------------------------------- quantizing

    def quantize_weight(self, weight, spec, args, global_scale=None):
        """A data-free quantizer's pure function: the 2-D weight on `spec`'s grid (a `QuantizedWeight`)."""
        raise NotImplementedError(f"{self.name} needs calibration data; it has no data-free weight function")

    def quantize_with_hessian(self, weight, hessian, spec, args):
        """A quantizer that rounds through its inputs' Hessian: some rows of a weight on `spec`'s grid given the
        (normalised) Hessian, as its layer step would round them. None where it does not use one (what a budget
        plan's sensitivity asks, `budget.sensitivity`)."""
        return None

    # ---------------------------------------------------------------- the preflight (torch-free arithmetic)

    def calibration_bytes(self, terms: dict[str, int], sizes: CalibrationSizes, args) -> dict[str, int]:
        """The calibration memory terms (name -> bytes) with this quantizer's own: the general estimate's, by default."""
        return terms

    def device_bytes(self, terms: dict[str, int]) -> int:
        """What the quantizer holds on the device beside the layer, its Hessians and a batch (its terms' share)."""
        return 0

    def hidden_state_streams(self) -> int:
        """Copies of the calibration hidden states the resume state keeps: the quantized stream, and the float
        model's where the quantizer tunes against it."""
        return 2 if self.float_reference else 1

    def timed(self, args, samples: int, count: int) -> tuple[Any, float]:
        """The arguments to time one layer with (the preflight's timed layer), and the factor from that time to
        the real run's. By default the run itself, factor 1."""
        return args, 1.0

    def report(self, args, num_samples: int, world_size: int) -> dict[str, Any]:
        """Figures of its own for the preflight's report (`--dry-run --json`); `notes`: lines a run prints first."""
        return {}

    def grid_share(self, args, batches: list[range], num_samples: int, seq_len: int) -> float:
        """The share of a rank's rows a block-scoring transform scores (and keeps of its blocks' inputs)."""
        return 1.0

    def rows_per_rank(self, stacked_rows: list[int], world_size: int) -> list[int] | None:
        """Weight rows each rank solves where the quantizer shares a weight's rows out (`--dry-run`), or None."""
        return None

    # ---------------------------------------------------------------- the summary

    def summary(self, result) -> dict[str, Any]:
        """What quantkit.json's calibration summary records of this algorithm's run (`CalibrationResult`)."""
        return {}

    def plan_lines(self, plan: dict[str, Any]) -> list[tuple[str, str]]:
        """(label, text) rows of `--dry-run`'s table, from the plan (`finalize.dry_run`)."""
        return []

    def summary_lines(self, calibration: dict[str, Any]) -> list[tuple[str, str]]:
        """(label, text) rows of the finalize summary, from quantkit.json's calibration summary."""
        return []


@dataclass(frozen=True)
class CalibrationSizes:
    """What the preflight knows of a calibrated run, for an algorithm's memory terms: the first decoder layer's
    quantized Linears (each with `in_features`, `out_features`), this rank's samples, all samples, the sequence
    length, the hidden size, bytes per element of the model's dtype, ranks, the device, attention heads."""

    layer: tuple
    samples: int
    total: int
    seq_len: int
    hidden: int
    element: int
    world_size: int
    device: str
    heads: int


ALGORITHMS: Registry[Algorithm] = Registry("algorithm")


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: one instance of `cls` registered under `cls.name`."""
    ALGORITHMS.register(cls.name)(cls())
    return cls


def _typed(key: str, value: Any, kind: Any) -> Any:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `float | None`: null, or the type
        if value is None:
            return None
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if isinstance(value, bool) and kind is not bool:
        raise SchemeError(key, f"{value!r} is not allowed; expected {kind.__name__}")
    if kind is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, kind):
        raise SchemeError(key, f"{value!r} is not allowed; expected {kind.__name__}")
    return value
