"""A recipe's fused rotations applied to a model: the float model its quantizer sees.

R1 rotates the residual stream by a Hadamard matrix Q of the hidden size: the embeddings write it rotated, every
Linear reading it (after its norm's weight is folded in) reads it rotated, every Linear writing to it writes
rotated, and the final norm is folded into lm_head, which reads it rotated. R2 rotates each attention head's
values by a head-sized Q, between v_proj and o_proj. Neither changes what the float model computes
(`algorithms.rotation` has the math; tested per architecture), but both spread a few outlier channels over all
of them, so activations and weights quantize to 4 bits (or FP4) with much less error (QuaRot, SpinQuant).

The rotations are applied as the weights are read: `rotate_rest` on the embeddings, final norm and lm_head,
`rotate_layer` on each decoder layer when its turn comes (streamed) or on all of them at once (whole model). So
every path after it (round-to-nearest, every calibration algorithm, `eval -q`, resume, N ranks) quantizes the
rotated model with nothing special, and the artifact is a plain model: transformers and vLLM load it as any other.
Which modules each rotation touches comes from `models.architectures.residual_modules`.
"""

from __future__ import annotations

import time
from functools import partial

from torch import nn

from quantkit.algorithms import hadamard
from quantkit.algorithms.rotation import (
    fold_norm,
    rotate_embedding,
    rotate_heads_input,
    rotate_heads_output,
    rotate_input,
    rotate_output,
)
from quantkit.errors import UnsupportedModelError
from quantkit.models import architectures
from quantkit.models.architectures import final_norm, norm_weight_offset, residual_modules
from quantkit.quant.registry import Recipe, Transform, TransformType


class Rotator:
    """The fused rotations of `recipe` for one model (its sizes read from its config); `seconds` accumulates the
    time spent rotating."""

    def __init__(self, transforms: tuple[Transform, ...], config):
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.heads
        self.r1 = self.r2 = None
        for transform in transforms:
            seed = transform.seed if transform.type is TransformType.RANDOM_HADAMARD else None
            if "R1" in transform.rotations:
                self.r1 = _rotation(self.hidden, seed, "the hidden size (R1)")
            if "R2" in transform.rotations:
                self.r2 = _rotation(self.head_dim, seed, "the attention head size (R2)")
        self.seconds = 0.0

    @classmethod
    def of(cls, recipe: Recipe, config) -> "Rotator | None":
        return cls(recipe.fused_rotations, config) if recipe.fused_rotations else None

    def check(self, model: nn.Module) -> None:
        """Refuse, before any weight is read, a model the rotations would not leave computing the same
        (`model` may be the meta skeleton)."""
        layers = architectures.decoder_layers(model)
        final_norm(layers_parent(model, layers))
        for layer in layers:
            residual_modules(layer, self.hidden, self._value_rows())
        if model.get_output_embeddings() is None:
            raise UnsupportedModelError(f"rotations: {type(model).__name__} has no lm_head")

    def rotate_rest(self, model: nn.Module) -> None:
        """The modules outside the decoder layers: embeddings rotated, the final norm folded into lm_head, which
        reads the rotated stream. Tied embeddings are untied first (lm_head reads them through the folded norm)."""
        if self.r1 is None:
            return
        started = time.perf_counter()
        embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
        if head.weight is embeddings.weight:
            untie(model)
        norm = final_norm(layers_parent(model, architectures.decoder_layers(model)))
        rotate_embedding(embeddings.weight.data, self.r1)
        fold_norm(norm.weight.data, [head.weight.data], norm_weight_offset(norm))
        rotate_input(head.weight.data, self.r1)
        self.seconds += time.perf_counter() - started

    def rotate_layer(self, layer: nn.Module) -> None:
        """One decoder layer: its norms folded into the Linears they feed, the stream's readers and writers
        rotated by R1, the values and o_proj's inputs by R2."""
        started = time.perf_counter()
        wiring = residual_modules(layer, self.hidden, self._value_rows())
        weight = lambda name: layer.get_submodule(name).weight.data  # noqa: E731
        if self.r1 is not None:
            for norm_name, readers in ((wiring.attention_norm, wiring.attention_readers),
                                       (wiring.mlp_norm, wiring.mlp_readers)):
                norm = layer.get_submodule(norm_name)
                fold_norm(norm.weight.data, [weight(n) for n in readers], norm_weight_offset(norm))
                for name in readers:
                    rotate_input(weight(name), self.r1)
            for name in (wiring.attention_writer, *wiring.mlp_writers):
                bias = layer.get_submodule(name).bias
                rotate_output(weight(name), self.r1, bias.data if bias is not None else None)
        if self.r2 is not None:
            values = layer.get_submodule(wiring.values)
            rows = slice(wiring.value_rows, wiring.value_rows + self.kv_heads * self.head_dim)
            bias = values.bias.data[rows] if values.bias is not None else None
            rotate_heads_output(values.weight.data[rows], self.r2, self.head_dim, bias)
            rotate_heads_input(weight(wiring.attention_writer), self.r2, self.head_dim)
        self.seconds += time.perf_counter() - started

    def rotate_model(self, model: nn.Module) -> None:
        """The whole model in memory."""
        self.rotate_rest(model)
        for layer in architectures.decoder_layers(model):
            self.rotate_layer(layer)

    def _value_rows(self) -> int:
        return (self.heads + self.kv_heads) * self.head_dim  # in a fused qkv projection: after queries and keys

    def describe(self) -> dict:
        """What quantkit.json records."""
        return {"R1": self.hidden if self.r1 is not None else None, "R2": self.head_dim if self.r2 is not None else None,
                "seconds": round(self.seconds, 3)}


def _rotation(size: int, seed: int | None, what: str):
    if not hadamard.is_supported_width(size):
        raise UnsupportedModelError(f"rotations: no Hadamard matrix of {what}, {size}: sizes supported are 2^k and "
                                    "q·2^k for odd q up to 63 (12·2^k, 20·2^k, 28·2^k, ...); leave out this rotation")
    return partial(hadamard.hadamard_transform, seed=seed)


def layers_parent(model: nn.Module, layers: nn.ModuleList) -> nn.Module:
    return model.get_submodule(architectures.module_name(model, layers).rpartition(".")[0])


def untie(model: nn.Module) -> None:
    """lm_head gets its own copy of the embeddings' weight, and the config says so (the artifact stores both)."""
    head = model.get_output_embeddings()
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    if getattr(model.config, "get_text_config", None) is not None:
        model.config.get_text_config().tie_word_embeddings = False


__all__ = ["Rotator", "untie"]


def transform_config(recipe: Recipe, model: nn.Module) -> dict | None:
    """compressed-tensors' `transform_config` for the recipe's fused rotations of `model`, laid out as llm-compressor's
    SpinQuantModifier writes it (groups "R1", "R2": `weight_output` on the Linears writing the rotated tensor,
    `weight_input` with `inverse` on those reading it; targets as `re:.*<name>$` patterns). The weights hold the
    rotations already, so runtimes ignore these (vLLM applies online locations only; transformers none): the config
    says what was done to the weights, in the place where compressed-tensors' tools look. A rotation it cannot
    state is left out (quantkit.json records every one): R2 on values fused into one qkv projection, whose rows
    a target cannot single out, and a "hadamard" of a size that is not a power of two, which compressed-tensors'
    "hadamard" type cannot build."""
    if not recipe.fused_rotations:
        return None
    rotator = Rotator(recipe.fused_rotations, model.config)
    layers = architectures.decoder_layers(model)
    wirings = [residual_modules(layer, rotator.hidden, rotator._value_rows()) for layer in layers]
    leaf = lambda name: f"re:.*{name.rsplit('.', 1)[-1]}$"  # noqa: E731
    unique = lambda names: list(dict.fromkeys(names))  # noqa: E731
    groups = {}
    kinds = {rotation: transform for transform in recipe.fused_rotations for rotation in transform.rotations}

    def group(rotation: str, size: int, head_dim: int | None, writers: list[str], readers: list[str]) -> None:
        transform = kinds[rotation]
        if transform.type is TransformType.HADAMARD and not hadamard.is_power_of_two(size):
            return
        groups[rotation] = {
            "type": transform.type.value, "head_dim": head_dim, "precision": "torch.float64", "randomize": False,
            "requires_grad": False,
            "apply": [{"targets": writers, "location": "weight_output", "inverse": False, "ignore": []},
                      {"targets": readers, "location": "weight_input", "inverse": True, "ignore": []}],
        }

    if "R1" in kinds:
        embeddings = architectures.module_name(model, model.get_input_embeddings())
        head = architectures.module_name(model, model.get_output_embeddings())
        writers = unique([leaf(embeddings)] + [leaf(n) for w in wirings for n in (w.attention_writer, *w.mlp_writers)])
        readers = unique([leaf(n) for w in wirings for n in (*w.attention_readers, *w.mlp_readers)]) + [head]
        group("R1", rotator.hidden, None, writers, readers)
    if "R2" in kinds and not any(w.value_rows for w in wirings):
        group("R2", rotator.head_dim, rotator.head_dim, unique([leaf(w.values) for w in wirings]),
              unique([leaf(w.attention_writer) for w in wirings]))
    return {"config_groups": groups} if groups else None
