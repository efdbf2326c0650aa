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

import torch
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
        self.r1 = self.r2 = self.r4 = None
        self.r2_per_layer: list[torch.Tensor] | None = None  # learned: one R2 per decoder layer (`learned`)
        self.learning = next((t for t in transforms if t.learn is not None), None)  # R1 / R2 still to be learned
        self.learned_summary: dict | None = None
        for transform in transforms:
            seed = transform.seed if transform.type is TransformType.RANDOM_HADAMARD else None
            if "R1" in transform.rotations:
                self.r1 = _rotation(self.hidden, seed, "the hidden size (R1)")
            if "R2" in transform.rotations:
                self.r2 = _rotation(self.head_dim, seed, "the attention head size (R2)")
            if "R4" in transform.rotations:
                self.r4 = transform  # its size is each down projection's input width (MoE experts: theirs)
        self.seconds = 0.0

    @classmethod
    def of(cls, recipe: Recipe, config) -> "Rotator | None":
        return cls(recipe.transforms, config) if recipe.transforms else None

    def check(self, model: nn.Module) -> None:
        """Refuse, before any weight is read, a model the rotations would not leave computing the same
        (`model` may be the meta skeleton)."""
        layers = architectures.decoder_layers(model)
        final_norm(layers_parent(model, layers))
        for layer in layers:
            wiring = residual_modules(layer, self.hidden, self._value_rows())
            if self.r4 is not None:
                if len(wiring.mlp_writers) > 1:
                    raise UnsupportedModelError(
                        f"rotations: R4 on MoE experts is not supported: transformers loads {type(model).__name__}'s "
                        "experts fused, where no hook on a down projection reaches them; leave R4 out")
                for name in wiring.mlp_writers:
                    _online_rotation(self.r4, layer.get_submodule(name).in_features)
        if model.get_output_embeddings() is None:
            raise UnsupportedModelError(f"rotations: {type(model).__name__} has no lm_head")

    def rotate_rest(self, model: nn.Module) -> None:
        """The modules outside the decoder layers: embeddings rotated, the final norm folded into lm_head, which
        reads the rotated stream. Tied embeddings are untied first (lm_head reads them through the folded norm)."""
        if self.r1 is None:
            return
        started = time.perf_counter()
        embeddings, head = _fold_rest(model)
        rotate_embedding(embeddings.weight.data, self.r1)
        rotate_input(head.weight.data, self.r1)
        self.seconds += time.perf_counter() - started

    def learned(self, r1: torch.Tensor | None, r2_per_layer: list[torch.Tensor] | None, summary: dict) -> None:
        """Take the learned matrices (`calibration.learned_rotations`) in place of the Hadamard ones: R1 for the
        stream, one R2 per decoder layer."""
        self.r1 = r1 if r1 is not None else self.r1
        self.r2_per_layer = r2_per_layer
        self.learning, self.learned_summary = None, summary

    def fold(self, model: nn.Module) -> None:
        """Every norm folded into the Linears it feeds (tied embeddings untied first), nothing rotated: the model
        the rotations are learned on. Folding again (`rotate_model`) changes nothing: the norms compute x̂·1 now."""
        _fold_rest(model)
        for layer in architectures.decoder_layers(model):
            _fold_layer(layer, residual_modules(layer, self.hidden, self._value_rows()))

    def rotate_layer(self, layer: nn.Module, index: int | None = None) -> None:
        """One decoder layer (the `index`-th: learned R2s are per layer): its norms folded into the Linears they
        feed, the stream's readers and writers rotated by R1, the values and o_proj's inputs by R2."""
        if self.learning is not None:
            raise RuntimeError("learned rotations are used after `learned` has given them")
        started = time.perf_counter()
        r2 = self.r2_per_layer[index] if self.r2_per_layer is not None else self.r2
        wiring = residual_modules(layer, self.hidden, self._value_rows())
        weight = lambda name: layer.get_submodule(name).weight.data  # noqa: E731
        if self.r1 is not None:
            _fold_layer(layer, wiring)
            for name in (*wiring.attention_readers, *wiring.mlp_readers):
                rotate_input(weight(name), self.r1)
            for name in (wiring.attention_writer, *wiring.mlp_writers):
                bias = layer.get_submodule(name).bias
                rotate_output(weight(name), self.r1, bias.data if bias is not None else None)
        if r2 is not None:
            values = layer.get_submodule(wiring.values)
            rows = slice(wiring.value_rows, wiring.value_rows + self.kv_heads * self.head_dim)
            bias = values.bias.data[rows] if values.bias is not None else None
            rotate_heads_output(values.weight.data[rows], r2, self.head_dim, bias)
            rotate_heads_input(weight(wiring.attention_writer), r2, self.head_dim)
        if self.r4 is not None:  # fused into each down projection's weight, its input rotated at run time
            for name in wiring.mlp_writers:
                down = layer.get_submodule(name)
                hook = _online_rotation(self.r4, down.in_features)
                rotate_input(down.weight.data, hook.rotate)
                attach_online(down, hook)
        self.seconds += time.perf_counter() - started

    def rotate_model(self, model: nn.Module) -> None:
        """The whole model in memory."""
        self.rotate_rest(model)
        for i, layer in enumerate(architectures.decoder_layers(model)):
            self.rotate_layer(layer, i)

    def _value_rows(self) -> int:
        return (self.heads + self.kv_heads) * self.head_dim  # in a fused qkv projection: after queries and keys

    def describe(self) -> dict:
        """What quantkit.json records."""
        described = {"R1": self.hidden if self.r1 is not None else None, "R2": self.head_dim if self.r2 is not None else None,
                     "R4": "online" if self.r4 is not None else None, "seconds": round(self.seconds, 3)}
        if self.learned_summary is not None:
            described["learned"] = self.learned_summary
        return {**described, "runtimes": ONLINE_RUNTIMES} if self.r4 is not None else described


def _fold_rest(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The final norm folded into lm_head (tied embeddings untied first); returns (embeddings, lm_head)."""
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head.weight is embeddings.weight:
        untie(model)
    norm = final_norm(layers_parent(model, architectures.decoder_layers(model)))
    fold_norm(norm.weight.data, [head.weight.data], norm_weight_offset(norm))
    return embeddings, head


def _fold_layer(layer: nn.Module, wiring) -> None:
    """A decoder layer's two norms folded into the Linears reading them."""
    for norm_name, readers in ((wiring.attention_norm, wiring.attention_readers), (wiring.mlp_norm, wiring.mlp_readers)):
        norm = layer.get_submodule(norm_name)
        fold_norm(norm.weight.data, [layer.get_submodule(n).weight.data for n in readers], norm_weight_offset(norm))


class OnlineRotation:
    """R4 at run time: a forward pre-hook on a down projection, its input x <- x·Q (Q = H/√n, the Hadamard matrix
    of its input width, with random-hadamard's signs from `seed`), while its weight holds W·Q (`rotate_input`):
    the product is unchanged, but the activations quantized on the way in are the rotated ones. Computed in at
    least float32 with the fast Walsh-Hadamard transform; the artifact states it for compressed-tensors and vLLM
    (`transform_config`), and `quantkit eval` applies it when it loads one (`apply_online_transforms`)."""

    def __init__(self, size: int, seed: int | None):
        self.size, self.seed = size, seed

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return hadamard.hadamard_transform(x, seed=self.seed, compute_dtype=torch.promote_types(x.dtype, torch.float32))

    def __call__(self, module: nn.Module, args: tuple):
        return (self.rotate(args[0]), *args[1:])


ONLINE_ATTRIBUTE = "quantkit_online_rotation"


def attach_online(module: nn.Module, hook) -> None:
    """Register `hook` as `module`'s online rotation (once: a module read again keeps the one it has)."""
    if getattr(module, ONLINE_ATTRIBUTE, None) is None:
        module.register_forward_pre_hook(hook)
        setattr(module, ONLINE_ATTRIBUTE, hook)


def _online_rotation(transform: Transform, size: int) -> OnlineRotation:
    """R4's hook for a down projection of input width `size`, or the one-line refusal of a width it cannot have."""
    if transform.type is TransformType.HADAMARD and not hadamard.is_power_of_two(size):
        raise UnsupportedModelError(
            f"rotations: R4 with type: hadamard needs a power-of-two width (compressed-tensors' and vLLM's "
            f"'hadamard' is Sylvester's matrix); the down projections' input is {size} wide: use type: random-hadamard"
        )
    seed = transform.seed if transform.type is TransformType.RANDOM_HADAMARD else None
    _rotation(size, seed, "the down projections' input (R4)")
    return OnlineRotation(size, seed)


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


__all__ = ["Rotator", "untie", "transform_config", "online_tensors", "apply_online_transforms"]


def transform_config(recipe: Recipe, model: nn.Module) -> dict | None:
    """compressed-tensors' `transform_config` for the recipe's rotations of `model`, laid out as llm-compressor's
    SpinQuantModifier writes it (targets as `re:.*<name>$` patterns):
    - R1, R2 (fused): `weight_output` on the Linears writing the rotated tensor, `weight_input` with `inverse` on
      those reading it. The weights hold them already, so runtimes leave them alone (vLLM applies online
      locations only; transformers none): the config says what was done to the weights. One it cannot state is
      left out (quantkit.json records every one): R2 on values fused into one qkv projection, whose rows a target
      cannot single out, a "hadamard" of a size that is not a power of two, which compressed-tensors'
      "hadamard" type cannot build, and a learned rotation, which no type describes.
    - R4 (online): `input` on the down projections, which compressed-tensors and vLLM apply at run time, and
      `weight_input` with `inverse` (fused). Its matrix is stored beside the weights (`online_tensors`)."""
    if not recipe.transforms:
        return None
    rotator = Rotator(recipe.transforms, model.config)
    layers = architectures.decoder_layers(model)
    wirings = [residual_modules(layer, rotator.hidden, rotator._value_rows()) for layer in layers]
    leaf = lambda name: f"re:.*{name.rsplit('.', 1)[-1]}$"  # noqa: E731
    unique = lambda names: list(dict.fromkeys(names))  # noqa: E731
    groups = {}
    kinds = {rotation: transform for transform in recipe.transforms for rotation in transform.rotations}

    def group(rotation: str, size: int | None, head_dim: int | None, writers: list[str], readers: list[str],
              writes: str = "weight_output") -> None:
        transform = kinds[rotation]
        if transform.learn is not None:  # a learned matrix is no compressed-tensors type: quantkit.json records it
            return
        if transform.type is TransformType.HADAMARD and size is not None and not hadamard.is_power_of_two(size):
            return
        groups[rotation] = {
            "type": transform.type.value, "head_dim": head_dim, "precision": "torch.float64", "randomize": False,
            "requires_grad": False,
            "apply": [{"targets": writers, "location": writes, "inverse": False, "ignore": []},
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
    if "R4" in kinds:  # every width checked already (`Rotator.check`): this one is never left out
        downs = unique([leaf(n) for w in wirings for n in w.mlp_writers])
        group("R4", None, None, downs, downs, writes="input")
    return {"config_groups": groups} if groups else None


def online_tensors(recipe: Recipe, model: nn.Module) -> dict[str, torch.Tensor]:
    """The matrices an artifact stores for its online rotation, as llm-compressor's checkpoints hold them: for each
    input width of the down projections, the ±1 matrix (float64, not divided by √n) under the first one's name,
    `<down projection>.R4_input.weight` (the others share it, as compressed-tensors ties them by size)."""
    if not recipe.online_rotations:
        return {}
    transform = recipe.online_rotations[0]
    rotator = Rotator(recipe.transforms, model.config)
    tensors, widths = {}, set()
    prefix = architectures.module_name(model, architectures.decoder_layers(model))
    for i, layer in enumerate(architectures.decoder_layers(model)):
        for name in residual_modules(layer, rotator.hidden, rotator._value_rows()).mlp_writers:
            width = layer.get_submodule(name).in_features
            if width not in widths:
                widths.add(width)
                tensors[f"{prefix}.{i}.{name}.R4_input.weight"] = transform_matrix(transform, width, normalize=False)
    return tensors


def transform_matrix(transform: Transform, size: int, normalize: bool = True, device=None) -> torch.Tensor:
    """The transform's matrix of `size` (float64): Hadamard, or random-Hadamard with its seed; the ±1 matrix with
    `normalize` False (what an artifact stores for an online rotation)."""
    if transform.type is TransformType.RANDOM_HADAMARD:
        return hadamard.random_hadamard_matrix(size, transform.seed, normalize=normalize, device=device)
    return hadamard.hadamard_matrix(size, normalize=normalize, device=device)


ONLINE_LOCATIONS = ("input", "output")
ONLINE_RUNTIMES = ("R4 rotates the down projections' inputs at run time: compressed-tensors, vLLM and quantkit eval apply "
                   "it; plain transformers ignores it and computes wrong outputs")


class StoredRotation:
    """An online transform read from an artifact: a forward pre-hook (location `input`) or forward hook (`output`)
    computing v·M/√n in float32 (M the stored matrix, transposed with `inverse`; per head of `head_dim` columns
    when given), as compressed-tensors' HadamardTransform does."""

    def __init__(self, matrix: torch.Tensor, head_dim: int | None = None):
        self.matrix, self.head_dim, self._on = matrix, head_dim, {}

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        key = x.device
        if key not in self._on:
            self._on[key] = (self.matrix.to(torch.float64) / self.matrix.shape[0] ** 0.5).to(device=x.device, dtype=torch.float32)
        m = self._on[key]
        y = x.to(torch.float32)
        if self.head_dim is not None and self.head_dim != y.shape[-1]:
            return (y.unflatten(-1, (-1, self.head_dim)) @ m).flatten(-2).to(x.dtype)
        return (y @ m).to(x.dtype)

    def __call__(self, module: nn.Module, args: tuple):
        return (self.rotate(args[0]), *args[1:])

    def on_output(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return self.rotate(output)


def online_groups(config: dict) -> dict[str, dict]:
    """The groups of a `config.json`'s transform_config that apply at run time (an `input` or `output` location)."""
    groups = ((config.get("quantization_config") or {}).get("transform_config") or {}).get("config_groups") or {}
    return {name: group for name, group in groups.items()
            if any(a.get("location") in ONLINE_LOCATIONS for a in group.get("apply", []))}


def apply_online_transforms(model: nn.Module, path, config: dict) -> list[str]:
    """Install the online transforms that `config` (the artifact's config.json at `path`) states, which plain
    transformers ignores: each `input` / `output` location's matrix on the modules it targets, read from the
    checkpoint (`<module>.<group>_<location>.weight`, shared by size) or, for type "hadamard", built. Returns the
    modules it hooked; UnsupportedModelError for a transform it cannot apply exactly (randomize's permutations,
    a stored matrix it cannot find)."""
    from safetensors import safe_open

    from quantkit.models import sources

    groups = online_groups(config)
    if not groups:
        return []
    fused = next((name for name, param in model.named_parameters() if param.dim() > 2), None)
    if fused is not None:  # MoE experts as transformers loads them: one parameter, no module a hook could sit on
        raise UnsupportedModelError(f"this artifact's online transforms ({', '.join(groups)}) cannot be applied: "
                                    f"transformers loads its experts fused ({fused}); evaluate it with vLLM")
    files = sources.tensor_files(path)
    hooked = []
    for group_name, group in groups.items():
        if group.get("randomize"):
            raise UnsupportedModelError(f"transform_config group {group_name}: randomized permutations are not applied by "
                                        "quantkit; evaluate this artifact with compressed-tensors or vLLM")
        for args in group.get("apply", []):
            location = args.get("location")
            if location not in ONLINE_LOCATIONS:
                continue
            targets, ignore = args.get("targets") or [], args.get("ignore") or []
            stored = {}
            for key in files:
                if key.endswith(f".{group_name}_{location}.weight"):
                    with safe_open(str(files[key]), framework="pt") as handle:
                        matrix = handle.get_tensor(key)
                    stored[matrix.shape[0]] = matrix
            for name, module in model.named_modules():
                if not _targeted(name, module, targets) or _targeted(name, module, ignore):
                    continue
                width = group.get("head_dim") or (module.in_features if location == "input" else module.out_features)
                matrix = stored.get(width)
                if matrix is None and group.get("type") == TransformType.HADAMARD.value and hadamard.is_power_of_two(width):
                    matrix = hadamard.hadamard_matrix(width, normalize=False)
                if matrix is None:
                    raise UnsupportedModelError(f"transform_config group {group_name}: no stored {width}x{width} matrix for "
                                                f"{name}'s {location}")
                hook = StoredRotation(matrix.T if args.get("inverse") else matrix, group.get("head_dim"))
                if location == "input":
                    module.register_forward_pre_hook(hook)
                else:
                    module.register_forward_hook(hook.on_output)
                hooked.append(name)
    return hooked


def _targeted(name: str, module: nn.Module, targets: list[str]) -> bool:
    """compressed-tensors' matching: `re:` patterns on the module's name, else its name or its class name."""
    import re

    for target in targets:
        if target.startswith("re:"):
            if re.match(target[3:], name):
                return True
        elif target in (name, type(module).__name__):
            return True
    return False
