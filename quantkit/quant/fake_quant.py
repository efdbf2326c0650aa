"""Fake quantizers that follow a scheme's grid exactly: what QAT trains through (`training.qat`), and what learned
rotations are learned against (`calibration.learned_rotations`).

The contract: for every planned Linear, the weight the forward pass sees is, bit for bit (atol=0, rtol=0),
`grids.fake_quantize_weight(weight, scheme.weights)`, the weight `finalize` will write, in float32 and in
bfloat16. Activations are fake-quantized the way torchao's PTQ runtime quantizes them for the same scheme
(int8 or float8, per token, dynamic), so the trained model sees what the deployed one computes.

Where a torchao fake quantizer reproduces the grid exactly it is used, configured to match qparams
(`scale_precision` float32 or None, meaning the weight's own dtype at every call; eps = float32 eps;
int2 in [-2, 1], int3 in [-4, 3], int4 in [-8, 7], int8 in [-128, 127]). Where none does, a quantkit config and fake quantizer take its place
behind the same interface (`fake_quantize_configs` -> `fake_quantizer`):

- `GridFakeQuantizeConfig`: asymmetric integer weights (torchao's asymmetric weight path is unsigned with a
  float zero point) and float8 weights with model-dtype scales; computed by quantkit.grids.qparams itself.
- `Int8TokenFakeQuantizeConfig`: int8 symmetric per-token activations (torchao's IntxFakeQuantizer has
  no symmetric per-token path); computed by torchao's runtime `Int8Tensor.from_hp` itself.
- NVFP4, MXFP4, MXFP8 and FP8-block weights take `GridFakeQuantizeConfig` too: torchao's prototype NVFP4 and MX
  numerics (`NVFP4Tensor.to_nvfp4`, `MXTensor.to_mx`) round differently from compressed-tensors, whose grid the
  artifact holds (17% of NVFP4 and 7% of MXFP4 elements of a random bf16 weight differ). NVFP4's global scale
  is shared by the Linears a kernel fuses (q/k/v, gate/up), as `finalize` shares it.
- `GroupActivationFakeQuantizeConfig`: dynamic per-group float activations (FP8 per group of 128, MX's FP4 /
  FP8 with E8M0 scales), as compressed-tensors' runtime quantizes them (`float_grids.fake_quantize_groups`).
- `BlockGridFakeQuantizeConfig`: llama.cpp's block grids (K-quants Q2_K ... Q6_K, the GGUF mixtures' types;
  i-quants): llama.cpp's own search of the block scales (the family's `searched`, no gradient), the weights rounded
  onto that grid (its `round`). The search costs far more than the rounding, so in training it is redone every
  `refresh_every` forward calls, the weights rounded on the last grid found in between; in eval mode every call
  searches, so the weight seen is the one `finalize` writes.

Every fake quantizer has a straight-through backward (identity). For torchao's int configs,
`IntxFakeQuantizer`'s forward is used, bit for bit, behind it: torchao's own backward masks the gradient where
values were clamped, which min/max scales hardly ever do, and saving and applying that mask costs about 7% of a
training step. For float8, `Float8FakeQuantizer`'s forward is used the same way: its own backward casts the gradient to float8 (the
`.to(dtype)` after the float8 round trip is differentiated as a cast, unscaled), which flushes nearly every
weight and activation gradient to zero, and it differentiates through the per-row amax (about 20 extra
full-size kernels per call).

Usage: `prepare(model, plan)` before building the optimizer (and before DDP/FSDP wrapping). Parameters keep
their names and identity, so `state_dict()` keys do not change. `strip(model)` goes back to plain nn.Linear;
`with stripped(model): model.save_pretrained(...)` saves a checkpoint plain transformers loads, mid-training.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torchao.quantization import Int8Tensor
from torchao.quantization.granularity import PerAxis, PerGroup, PerRow, PerToken
from torchao.quantization.qat import Float8FakeQuantizeConfig, IntxFakeQuantizeConfig
from torchao.quantization.qat.fake_quantize_config import FakeQuantizeConfigBase
from torchao.quantization.qat.fake_quantizer import FakeQuantizerBase, Float8FakeQuantizer
from torchao.quantization.quant_primitives import MappingType

from quantkit.models.architectures import kernel_fused_groups
from quantkit import grids
from quantkit.grids import float_grids, qparams
from quantkit.quant.plan import ModulePlan
from quantkit.grids.schemes import ActivationSpec, Granularity, QDtype, QuantScheme, ScaleDtype, WeightSpec

_EPS = torch.finfo(torch.float32).eps  # qparams' eps; tests check tiny groups, where a different eps shows
_TORCH_INT = {QDtype.INT2: torch.int2, QDtype.INT3: torch.int3, QDtype.INT4: torch.int4, QDtype.INT8: torch.int8}
# Training forward calls between two K-grid searches (`BlockGridFakeQuantizer`). scripts/bench_qat.py, 17.8M Llama, 1 CPU
# thread: gguf-q4-k-m's step took 1.91x a plain one searching at every call, 1.25x every 8 (gguf-q4-0: 1.01x); the
# search is hundreds of small ops per chunk of super-blocks, so on a GPU it weighs more still. Codes follow the
# weights at every call; only the super-block scales and mins lag, by at most 7 calls.
K_REFRESH_EVERY = 8


# ---------------------------------------------------------------- configs


@dataclass(frozen=True)
class GridFakeQuantizeConfig(FakeQuantizeConfigBase):
    """Weights fake-quantized by quantkit.grids.qparams, for grids no torchao fake quantizer reproduces."""

    weights: WeightSpec


@dataclass(frozen=True)
class GroupActivationFakeQuantizeConfig(FakeQuantizeConfigBase):
    """Dynamic per-group float activations (FP8 groups of 128; MX FP4/FP8 groups of 32 with E8M0 scales)."""

    activations: ActivationSpec


@dataclass(frozen=True)
class BlockGridFakeQuantizeConfig(FakeQuantizeConfigBase):
    """Weights on a llama.cpp K grid: llama.cpp's search, redone every `refresh_every` training forward calls."""

    weights: WeightSpec
    refresh_every: int = K_REFRESH_EVERY

    def __post_init__(self):
        if grids.family_of(self.weights).fake_quant(self.weights) != "block_grid":
            raise ValueError(f"BlockGridFakeQuantizeConfig takes a searched block grid, not {self.weights.describe()}")
        if self.refresh_every < 1:
            raise ValueError(f"refresh_every is a count of forward calls (1: search at every call), got {self.refresh_every}")


@dataclass(frozen=True)
class Int8TokenFakeQuantizeConfig(FakeQuantizeConfigBase):
    """int8 symmetric per-token activations, as torchao's Int8Tensor runtime quantizes them (float32 scales)."""


def weight_fake_quantize_config(spec: WeightSpec) -> FakeQuantizeConfigBase:
    """The fake quantizer the grid's family names (`GridFamily.fake_quant`): torchao's where it reproduces the grid
    exactly, else quantkit's own."""
    return WEIGHT_CONFIGS[grids.family_of(spec).fake_quant(spec)](spec)


def _torchao_intx_config(spec: WeightSpec) -> IntxFakeQuantizeConfig:
    """torchao's symmetric integer weights, configured to match qparams."""
    granularity = PerGroup(spec.group_size) if spec.granularity is Granularity.GROUP else PerAxis(0)
    # None: the scale takes the weight's dtype at each call, so a model cast to bf16 later stays exact
    precision = torch.float32 if spec.scale_dtype is ScaleDtype.FLOAT32 else None
    return IntxFakeQuantizeConfig(
        _TORCH_INT[spec.dtype], granularity, MappingType.SYMMETRIC, scale_precision=precision, eps=_EPS,
    )


WEIGHT_CONFIGS: dict[str, Callable[[WeightSpec], FakeQuantizeConfigBase]] = {
    "torchao_intx": _torchao_intx_config,
    "torchao_float8": lambda spec: Float8FakeQuantizeConfig(torch.float8_e4m3fn, PerRow()),
    "grid": GridFakeQuantizeConfig,
    "block_grid": BlockGridFakeQuantizeConfig,
}


def activation_fake_quantize_config(spec: ActivationSpec | None) -> FakeQuantizeConfigBase | None:
    if spec is None:
        return None
    if not spec.dynamic:
        raise ValueError("QAT fake-quantizes dynamic activations only; static scales come from calibration")
    if spec.granularity is Granularity.GROUP:
        return GroupActivationFakeQuantizeConfig(spec)
    if spec.dtype.is_float:  # Float8DynamicActivationFloat8WeightConfig(PerRow()): no activation bounds
        return Float8FakeQuantizeConfig(torch.float8_e4m3fn, PerRow())
    if spec.symmetric:
        return Int8TokenFakeQuantizeConfig()
    # as IntxUnpackedToInt8Tensor's runtime: scale in the activation's dtype, torchao's default eps
    return IntxFakeQuantizeConfig(torch.int8, PerToken(), MappingType.ASYMMETRIC, scale_precision=None)


def fake_quantize_configs(scheme: QuantScheme) -> tuple[FakeQuantizeConfigBase | None, FakeQuantizeConfigBase]:
    """(activation config or None, weight config) for the scheme: torchao's where exact, quantkit's otherwise."""
    return activation_fake_quantize_config(scheme.activations), weight_fake_quantize_config(scheme.weights)


# ---------------------------------------------------------------- fake quantizers


class _StraightThrough(torch.autograd.Function):
    """forward: fn(x), bit for bit; backward: identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _StraightThroughFakeQuantizer(FakeQuantizerBase, ABC):
    def __init__(self, config: FakeQuantizeConfigBase):
        super().__init__()
        self.config = config
        self.enabled = True

    @abstractmethod
    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """The fake-quantized tensor (forward value; the backward is the identity)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _StraightThrough.apply(x, self.fake_quantize) if self.enabled else x


class GridFakeQuantizer(_StraightThroughFakeQuantizer):
    def __init__(self, config: GridFakeQuantizeConfig):
        super().__init__(config)
        self.fused_with: list[torch.Tensor] = []  # NVFP4: the weights sharing this one's global scale (itself included)

    def fake_quantize(self, weight: torch.Tensor) -> torch.Tensor:
        spec, dtype = self.config.weights, weight.dtype
        grid_dtype = torch.bfloat16 if spec.sixteen_bit and dtype == torch.float32 else dtype  # as finalize writes it
        global_scale = None
        if spec.global_scale and self.fused_with:
            with torch.no_grad():
                global_scale = qparams.weight_global_scale([w.detach().to(grid_dtype) for w in self.fused_with])
        return grids.fake_quantize_weight(weight.to(grid_dtype), spec, global_scale).to(dtype)


class BlockGridFakeQuantizer(_StraightThroughFakeQuantizer):
    """A weight on its K grid: the grid llama.cpp's search chooses (`k_grids.choose_k_qparams`, under no_grad),
    the weight rounded onto it (`k_grids.round_k`). `round_k` on the grid of the same weights decodes to
    `k_grids.quantize_k`'s values exactly (they differ only in the codes of sub-blocks whose step is 0, which decode
    alike), so a fresh search gives bit for bit what `finalize` writes. Training reuses a grid for
    `refresh_every` forward calls; eval mode searches at every call."""

    def __init__(self, config: BlockGridFakeQuantizeConfig):
        super().__init__(config)
        self.family = grids.family_of(config.weights)
        self.grid = None  # the block parameters of the last search (`GridFamily.searched`)
        self.calls = 0  # training forward calls since that search

    def fake_quantize(self, weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            grid = self._grid(weight)
            return grid.dequantize(grid.round(weight)).to(weight.dtype)

    def _grid(self, weight: torch.Tensor):
        stale = self.grid is None or not self.training or self.calls >= self.config.refresh_every
        stale = stale or self.grid.d.device != weight.device
        if stale:
            self.grid, self.calls = self.family.searched(weight, self.config.weights), 0
        self.calls += self.training
        return self.grid


class GroupActivationFakeQuantizer(_StraightThroughFakeQuantizer):
    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.config.activations
        if spec.global_scale:  # NVFP4: the global scale of this tensor (finalize calibrates one over the data)
            return float_grids.fake_quantize_nvfp4(x, float_grids.global_scale(x.abs().amax()))
        return float_grids.fake_quantize_groups(x, spec.dtype.bits, spec.group_size, spec.scale_dtype is ScaleDtype.E8M0)


class Int8TokenFakeQuantizer(_StraightThroughFakeQuantizer):
    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        return Int8Tensor.from_hp(x, PerRow(), MappingType.SYMMETRIC).dequantize()


class Float8StraightThroughFakeQuantizer(_StraightThroughFakeQuantizer):
    """torchao's float8 fake quantization, its forward bit for bit, with a straight-through backward."""

    def __init__(self, config: Float8FakeQuantizeConfig):
        super().__init__(config)
        self.forward_only = Float8FakeQuantizer(config)  # called inside _StraightThrough, so no graph is recorded

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_only(x)


class IntxStraightThroughFakeQuantizer(_StraightThroughFakeQuantizer):
    """torchao's integer fake quantization, its forward bit for bit, with a straight-through backward. Its own
    backward masks the gradient where values were clamped: for min/max scales only the few values that round
    past the top of the range, at the price of saving and applying a mask per call (about 7% of a step)."""

    def __init__(self, config: IntxFakeQuantizeConfig):
        super().__init__(config)
        self.forward_only = FakeQuantizerBase.from_config(config)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_only(x)


def fake_quantizer(config: FakeQuantizeConfigBase) -> FakeQuantizerBase:
    """The fake-quantizing module for a config from `fake_quantize_configs`."""
    if isinstance(config, GridFakeQuantizeConfig):
        return GridFakeQuantizer(config)
    if isinstance(config, BlockGridFakeQuantizeConfig):
        return BlockGridFakeQuantizer(config)
    if isinstance(config, GroupActivationFakeQuantizeConfig):
        return GroupActivationFakeQuantizer(config)
    if isinstance(config, Int8TokenFakeQuantizeConfig):
        return Int8TokenFakeQuantizer(config)
    if isinstance(config, Float8FakeQuantizeConfig):
        return Float8StraightThroughFakeQuantizer(config)
    if isinstance(config, IntxFakeQuantizeConfig):
        return IntxStraightThroughFakeQuantizer(config)
    return FakeQuantizerBase.from_config(config)


# ---------------------------------------------------------------- modules


class QATLinear(nn.Linear):
    """A Linear that computes with fake-quantized activations and weights; `weight` stays the float Parameter."""

    def __init__(self, linear: nn.Linear, scheme: QuantScheme):
        super().__init__(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameter objects: names, optimizer state
        self.scheme = scheme
        act_config, weight_config = fake_quantize_configs(scheme)
        self.activation_fake_quantizer = fake_quantizer(act_config) if act_config is not None else None
        self.weight_fake_quantizer = fake_quantizer(weight_config)
        self.train(linear.training)  # after the fake quantizers: a K grid's search follows train() / eval()

    def fake_quantized_weight(self) -> torch.Tensor:
        return self.weight_fake_quantizer(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_fake_quantizer is not None:
            x = self.activation_fake_quantizer(x)
        return F.linear(x, self.fake_quantized_weight(), self.bias)

    def to_linear(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear.train(self.training)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scheme={self.scheme.describe()}"


class QATEmbedding(nn.Embedding):
    """A token embedding that looks up rows of its fake-quantized weight (a GGUF mixture quantizes token_embd, on a K
    grid: llama.cpp's search, as for a Linear); `weight` stays the float Parameter."""

    def __init__(self, embedding: nn.Embedding, spec: WeightSpec):
        super().__init__(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx, device="meta")
        self.weight = embedding.weight  # the same Parameter object: its name, optimizer state, a tied lm_head
        self.spec = spec
        self.weight_fake_quantizer = fake_quantizer(weight_fake_quantize_config(spec))
        self.train(embedding.training)

    def fake_quantized_weight(self) -> torch.Tensor:
        return self.weight_fake_quantizer(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.fake_quantized_weight(), self.padding_idx)

    def to_embedding(self) -> nn.Embedding:
        embedding = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx, device="meta")
        embedding.weight = self.weight
        return embedding.train(self.training)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weights={self.spec.describe()}"


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    if not name:
        raise ValueError("QAT replaces submodules; the model itself cannot be the Linear (wrap it in a module)")
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def _install(model: nn.Module, schemes: dict[str, QuantScheme]) -> None:
    for name, scheme in schemes.items():
        linear = model.get_submodule(name)
        if type(linear) is not nn.Linear:
            kind = type(linear).__name__
            raise ValueError(f"{name} is a {kind}, not a plain nn.Linear (already prepared? call strip() first)")
        _replace(model, name, QATLinear(linear, scheme))
    nvfp4 = [name for name, scheme in schemes.items() if scheme.weights.global_scale]
    for group in kernel_fused_groups(nvfp4):  # one global scale per group, as finalize computes it
        weights = [model.get_submodule(name).weight for name in group]
        for name in group:
            model.get_submodule(name).weight_fake_quantizer.fused_with = weights


def prepare(model: nn.Module, plan: list[ModulePlan], embedding: WeightSpec | None = None) -> nn.Module:
    """Install fake quantizers, in place, on every planned Linear with its own scheme (group sizes may differ), and
    on the token embedding where `embedding` gives its grid (a GGUF mixture's type for token_embd).

    Call it before building the optimizer and before wrapping the model (DDP, FSDP, torch.compile).
    Weights stay float, trainable and the same Parameter objects under the same names.
    """
    _install(model, {entry.name: entry.scheme for entry in plan if entry.quantized})
    if embedding is not None:
        _install_embedding(model, embedding)
    return model


def _install_embedding(model: nn.Module, spec: WeightSpec) -> None:
    found = model.get_input_embeddings()
    if type(found) is not nn.Embedding:
        raise ValueError(f"the input embedding is a {type(found).__name__}, not a plain nn.Embedding (already prepared? "
                         "call strip() first)")
    name = next(name for name, module in model.named_modules() if module is found)
    _replace(model, name, QATEmbedding(found, spec))


def prepared_schemes(model: nn.Module) -> dict[str, QuantScheme]:
    """Module name -> scheme of every fake-quantized Linear."""
    return {name: m.scheme for name, m in model.named_modules() if isinstance(m, QATLinear)}


def is_prepared(model: nn.Module) -> bool:
    return any(isinstance(m, (QATLinear, QATEmbedding)) for m in model.modules())


@torch.no_grad()
def fake_quantized_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Module name -> the fake-quantized weight the model currently computes with (Linears and the embedding)."""
    return {name: m.fake_quantized_weight() for name, m in model.named_modules() if isinstance(m, (QATLinear, QATEmbedding))}


def strip(model: nn.Module) -> nn.Module:
    """Turn every fake-quantized Linear (and embedding) back into a plain nn.Linear (nn.Embedding) holding the same
    float Parameters, in place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, QATLinear):
            _replace(model, name, module.to_linear())
        elif isinstance(module, QATEmbedding):
            _replace(model, name, module.to_embedding())
    return model


@contextmanager
def stripped(model: nn.Module) -> Iterator[nn.Module]:
    """Plain nn.Linear inside the block (e.g. to save_pretrained), the same fake quantizers after it.

    The Parameters are the same objects throughout, so an optimizer built before keeps working.
    """
    schemes = prepared_schemes(model)
    embedding = next((m.spec for m in model.modules() if isinstance(m, QATEmbedding)), None)
    strip(model)
    try:
        yield model
    finally:
        _install(model, schemes)
        if embedding is not None:
            _install_embedding(model, embedding)
