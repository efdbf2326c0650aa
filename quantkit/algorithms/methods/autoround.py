"""AutoRound: learned rounding and clipping per decoder layer (SignSGD), against the float model's outputs."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from quantkit.algorithms.base import Algorithm, CalibrationSizes, register
from quantkit.grids.schemes import QuantScheme, SchemeError


@dataclass(frozen=True)
class AutoRoundArgs:
    """Intel auto-round's defaults (`SignRoundConfig`, llm-compressor's `AutoRoundModifier`)."""

    iters: int = 200  # SignSGD steps per decoder layer
    lr: float | None = None  # the rounding offsets' step size, decayed linearly to 0; None: 1 / iters
    minmax_lr: float | None = None  # the clipping factors' step size; None: lr
    batch_size: int = 8  # calibration samples per step
    samples_per_pass: int = 4  # a step's samples to one forward and backward pass (equal-length samples; else 1).
    # The ranks share a step's passes, so at most batch_size / samples_per_pass ranks tune at once; the artifact
    # depends on it, not on the number of ranks
    minmax_tuning: bool = True  # tune each group's min/max clipping factors (else only the rounding)
    seed: int = 42  # the order samples are drawn in (with the layer's index)
    amp: bool = True  # tune in bfloat16 autocast where the device multiplies bf16 natively (auto-round's `amp`)
    full_range: bool = True  # symmetric grids: auto-round's scales (the larger side of a group's range on qmin);
    # false: the recipe's min-max grid (round-to-nearest's, max|w| / ((qmax - qmin) / 2))

    def __post_init__(self) -> None:
        if self.iters < 1:
            raise SchemeError("iters", f"{self.iters} is not allowed; use at least 1 (e.g. 200), or algorithm rtn for none")
        for name in ("batch_size", "samples_per_pass"):
            if getattr(self, name) < 1:
                raise SchemeError(name, f"{getattr(self, name)} is not allowed; use a positive number of samples")
        for name in ("lr", "minmax_lr"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise SchemeError(name, f"{value} is not allowed; use a positive step size, or leave it out for 1 / iters")

    @property
    def rounding_lr(self) -> float:
        return self.lr if self.lr is not None else 1.0 / self.iters

    @property
    def clipping_lr(self) -> float:
        return self.minmax_lr if self.minmax_lr is not None else self.rounding_lr


BYTES_PER_WEIGHT = 22  # held while the passes run, per weight of the layer (`algorithms.autoround.tune`):
# V and the best V (float32, 4 + 4), the step's fake-quantized weights (float32, 4) and what their fake-quantization
# keeps for its backward pass (the grid values, float32, and the clamp's mask: 4 + 1), the step's gradient sum
# (float32, 4) and round-to-nearest's grid integers (1, kept for the loss it reports); the weights' float32 groups
# beside (GROUPS_BYTES, none for float32 weights: `Groups` takes them as they are); and in the passes'
# dtype, the leaves they take, a gradient row a pass and the pass's own gradients (`tuning_bytes`). Measured
# 32.4 in all (bf16, two passes, without the grid integers and the pass's own gradients) on a hidden-1024 layer.
GROUPS_BYTES = 4
ATTENTION_COPIES = 3  # bf16 score-sized tensors while a tuning pass's backward goes through the CPU
# attention's softmax (`calibration.tuning_attention`): its probabilities, kept from the forward pass, their
# gradient and the scores' gradient
TOKEN_HIDDEN_COPIES = 12  # hidden-wide activations a tuning pass keeps per token for its backward pass
# (norms, projections' inputs and outputs, rotary embeddings, the residual stream); with the score-sized ones, a
# pass of 4 x 2048 tokens through a hidden-1024 layer (16 heads) measured 1.75 GiB at its peak, 1.73 estimated
TOKEN_MLP_COPIES = 5  # MLP-wide ones (gate, up, act(gate), their product, a gradient): the peak where the
# scores are short
TIMED_STEPS = 5  # steps the preflight times on one layer

PASS = "AutoRound activations of a tuning pass (forward and backward)"
FLOAT_HIDDEN = "AutoRound float model's hidden states (before and after the layer, this rank)"
EVERY_RANK = "AutoRound every rank's samples of the layer (inputs and targets)"
PREFIX = "AutoRound"  # every term of its own starts so (`device_bytes`)


@register
class AutoRound(Algorithm):
    name = "autoround"
    Arguments = AutoRoundArgs
    step = "autoround"
    float_reference = True
    learns_ranges = True
    per_sample_terms = (FLOAT_HIDDEN, EVERY_RANK)

    def refusal(self, scheme: QuantScheme) -> str | None:
        """AutoRound learns integer rounding of weights on the float layer's output: no float8 grid, no static
        activation scales."""
        if not scheme.weights.learned_rounding:
            return "autoround learns the rounding of integer weights; float weights and codebook grids use rtn"
        if scheme.activations is not None and scheme.activations.calibrated:
            return ("autoround with static activation scales (or NVFP4's calibrated global scale) is not supported; "
                    "use rtn for these recipes")
        return None

    def calibration_bytes(self, terms: dict[str, int], sizes: CalibrationSizes, args: AutoRoundArgs) -> dict[str, int]:
        """A tuning pass instead of the general estimate's batch of activations, and no Hessians (`tuning_bytes`)."""
        bf16 = amp_bf16(args, sizes.device)
        kept = {k: v for k, v in terms.items() if k not in ("one batch's activations in a layer", "Hessians of one layer")}
        return {**kept, **tuning_bytes(sizes, passes(args, sizes.total), min(args.samples_per_pass, args.batch_size, sizes.total),
                                       sizes.heads if bf16 and sizes.device == "cpu" else 0, 2 if bf16 else sizes.element)}

    def device_bytes(self, terms: dict[str, int]) -> int:
        return sum(v for k, v in terms.items() if k.startswith(PREFIX))

    def report(self, args: AutoRoundArgs, num_samples: int, world_size: int) -> dict[str, Any]:
        """The ranks share out a step's passes, so no more than that many tune at once."""
        count = passes(args, num_samples)
        idle = idle_note(count, world_size)
        return {"autoround_passes_per_step": count, **({"notes": [idle]} if idle else {})}

    def plan_lines(self, plan: dict[str, Any]) -> list[tuple[str, str]]:
        count = plan["preflight"].get("autoround_passes_per_step")
        if not count:
            return []
        idle = idle_note(count, plan["ranks"])
        return [("AutoRound", f"{count} forward and backward passes a step" + (f": {idle}" if idle else ""))]

    def timed(self, args: AutoRoundArgs, samples: int, count: int) -> tuple[AutoRoundArgs, float]:
        """TIMED_STEPS steps are timed; a real step takes min(batch_size, samples) samples, of which one rank
        computes its share (the estimate is one rank's, as if it held every sample of the step)."""
        steps = min(args.iters, TIMED_STEPS)
        return dataclasses.replace(args, iters=steps), args.iters * min(args.batch_size, samples) / min(args.batch_size, count)

    def summary(self, result) -> dict[str, Any]:
        return {"autoround": result.tuning or None}  # per decoder layer: output loss with round-to-nearest and after tuning

    def summary_lines(self, calibration: dict[str, Any]) -> list[tuple[str, str]]:
        tuning = calibration.get("autoround")
        return [("  AutoRound", tuning_line(tuning))] if tuning else []


def passes(args: AutoRoundArgs, num_samples: int) -> int:
    """Forward and backward passes a step (equal-length samples): a step's samples over samples_per_pass."""
    return math.ceil(min(args.batch_size, num_samples) / args.samples_per_pass)


def amp_bf16(args: AutoRoundArgs, device: str) -> bool:
    """Whether the tuning passes run in bfloat16 autocast (`amp` where the device multiplies bf16 natively); on the
    CPU their attention then holds its scores (`calibration.tuning_attention`; sdpa's kernels do not)."""
    import torch

    from quantkit.runtime import precision

    return args.amp and precision.native_bf16(torch.device(device))


def tuning_bytes(sizes: CalibrationSizes, passes: int = 1, pass_samples: int = 1, heads: int = 0,
                 pass_element: int | None = None) -> dict[str, int]:
    """What AutoRound adds: the float model's hidden states before and after the layer (its targets) for this rank's
    samples, the tuning state of one layer's weights, the gradients of a step's `passes` (in the passes' dtype
    `pass_element`: the leaves they take, a row a pass, and the pass being run's own), one pass's activations
    (`pass_bytes`, of `pass_samples` samples; `heads`: the attention heads whose scores it holds, 0 where its
    attention holds none) and, on several ranks, every rank's samples (the layer's inputs and targets) so that each
    step's samples are dealt out evenly. AutoRound sums no Hessians: the general estimate's are not counted beside these."""
    element, hidden, seq_len = sizes.element, sizes.hidden, sizes.seq_len
    weights = sum(e.in_features * e.out_features for e in sizes.layer)
    pass_element = pass_element or element
    per_weight = BYTES_PER_WEIGHT + (GROUPS_BYTES if element < 4 else 0)
    widest = max((max(e.in_features, e.out_features) for e in sizes.layer), default=hidden)
    needs = {FLOAT_HIDDEN: 2 * sizes.samples * seq_len * hidden * element,
             "AutoRound tuning state of one layer": per_weight * weights,
             "AutoRound gradients of a step's passes": (passes + 2) * pass_element * weights,
             PASS: pass_bytes(pass_samples, seq_len, hidden, widest, heads, pass_element)}
    if sizes.world_size > 1:
        needs[EVERY_RANK] = 2 * sizes.total * seq_len * hidden * element
    return needs


def pass_bytes(samples: int, seq_len: int, hidden: int, mlp: int, heads: int, element: int) -> int:
    """A tuning pass's activations at its peak (forward and backward over `samples` x `seq_len` tokens, in `element`
    bytes): the backward pass through attention's softmax (ATTENTION_COPIES score-sized tensors of `heads` heads
    beside the hidden-wide activations kept for it), or, where the scores are short, the MLP's backward (one
    score-sized tensor, and the MLP-wide activations as well)."""
    tokens = samples * seq_len
    scores = samples * heads * seq_len * seq_len * element
    kept = tokens * TOKEN_HIDDEN_COPIES * hidden * element
    return max(ATTENTION_COPIES * scores + kept, scores + kept + tokens * TOKEN_MLP_COPIES * mlp * element)


def idle_note(passes: int, ranks: int) -> str | None:
    """What to say where a step has fewer passes than there are ranks (the others wait while it tunes)."""
    if passes >= ranks:
        return None
    return (f"AutoRound tunes on {passes} of the {ranks} ranks at a time ({passes} forward and backward passes a step); "
            "a user recipe with a smaller samples_per_pass (or a larger batch_size) keeps more of them busy")


def tuning_line(tuning: dict[str, dict]) -> str:
    """The summary's line: each layer's output loss after tuning against round-to-nearest's."""
    ratios = {layer: t["loss_tuned"] / t["loss_rtn"] for layer, t in tuning.items() if t["loss_rtn"] > 0}
    if not ratios:
        return f"{len(tuning)} layers tuned (no output error with round-to-nearest)"
    worst = max(ratios, key=ratios.get)
    mean = sum(ratios.values()) / len(ratios)
    return (f"output loss {mean:.0%} of round-to-nearest's on average over {len(tuning)} layers, at most "
            f"{ratios[worst]:.0%} ({worst}); per layer in quantkit.json")
