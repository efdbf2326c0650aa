"""The one recipe registry: every command resolves recipe names here.

A recipe is a YAML file under `recipes/` (shipped inside the package as `quantkit.recipes`); its name is its
file name. A name and a path are different inputs: a value ending in .yaml/.yml or containing a path
separator is read as a file, anything else is looked up as a name, and a mistyped name gets close matches.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from functools import lru_cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Iterator

import yaml

from quantkit import algorithms
from quantkit.errors import RecipeError, RecipeNotFoundError
from quantkit.grids.schemes import (
    ActivationSpec,
    Granularity,
    KVCacheSpec,
    QDtype,
    QuantScheme,
    ScaleDtype,
    SchemeError,
    WeightObserver,
    WeightSpec,
)


class Format(str, Enum):
    COMPRESSED_TENSORS = "compressed-tensors"
    TORCHAO = "torchao"
    GGUF = "gguf"  # one file for llama.cpp (export/gguf.py)
    MLX = "mlx"  # a directory for mlx-lm on Apple silicon (export/mlx.py)


@dataclass(frozen=True)
class AlgorithmStep:
    name: str  # a registered algorithm's (`quantkit.algorithms.names()`)
    args: dict[str, Any] = field(default_factory=dict)  # as the recipe gives them, checked

    @property
    def algorithm(self) -> algorithms.Algorithm:
        """The algorithm object, which everything asks about it (`quantkit.algorithms.base.Algorithm`)."""
        return algorithms.get(self.name)

    @property
    def arguments(self):
        """The algorithm's argument dataclass, defaults filled in."""
        return self.algorithm.arguments(self.args)


class TransformType(str, Enum):
    HADAMARD = "hadamard"  # the deterministic Hadamard matrix (compressed-tensors' "hadamard")
    RANDOM_HADAMARD = "random-hadamard"  # a Hadamard matrix with random signs drawn from `seed` (QuIP's, QuaRot's)


ROTATIONS = ("R1", "R2", "R3", "R4")
FUSED = ("R1", "R2")  # R1: the residual stream; R2: each attention head's values, between v_proj and o_proj
ONLINE = ("R4",)  # R4: the down projections' inputs, rotated at run time (R3, the keys and queries, is not supported)


@dataclass(frozen=True)
class Learning:
    """Learned rotations (SpinQuant): R1 and R2 start from the transform's Hadamard matrices and are optimized by
    Cayley SGD (`algorithms.cayley`) for the causal-LM loss of the model quantized with the recipe's scheme, on
    the calibration data (`calibration.learned_rotations`); the learned matrices are fused as the Hadamard ones are."""

    steps: int = 100  # optimizer steps, one calibration batch each
    learning_rate: float = 1.5  # SpinQuant's, decayed by a cosine to zero


@dataclass(frozen=True)
class Transform:
    """Rotations of one kind (`transforms:` in a recipe): orthogonal matrices that leave the float model's function
    unchanged and spread activation outliers over all channels before quantization (QuaRot, SpinQuant). R1 and R2
    are fused into the weights (`quant.rotations`), so the artifact is a plain model; R4 (`online`) is fused into
    the down projections' weights and applied to their inputs at run time, by the runtimes that read
    compressed-tensors' `transform_config` (compressed-tensors, vLLM, `quantkit eval`)."""

    type: TransformType = TransformType.HADAMARD
    rotations: tuple[str, ...] = FUSED
    seed: int = 0  # random-hadamard's signs (every rank draws the same)
    online: bool = False  # applied to activations at run time (R4)
    learn: Learning | None = None  # R1 / R2 learned on the calibration data, from this type's matrices


class IndivisiblePolicy(str, Enum):
    """What to do with a Linear whose input size the group size does not divide."""

    SMALLER_GROUP = "smaller-group"  # the largest group size that divides it, halving down to 16
    SKIP = "skip"  # leave the layer in full precision


@dataclass(frozen=True)
class Requirement:
    """What a format's kernels need. Checked before any weight is loaded."""

    cuda_capability: str | None = None  # e.g. "8.9"
    packages: tuple[str, ...] = ()


@dataclass(frozen=True)
class Calibration:
    num_samples: int = 128
    seq_len: int = 512
    dataset: str | None = None


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    scheme: QuantScheme
    format: Format
    steps: tuple[AlgorithmStep, ...] = (AlgorithmStep(algorithms.DEFAULT),)
    calibration: Calibration = field(default_factory=Calibration)
    ignore: tuple[str, ...] = ("lm_head",)
    on_indivisible: IndivisiblePolicy = IndivisiblePolicy.SMALLER_GROUP
    requires: dict[Format, Requirement] = field(default_factory=dict)
    hardware: str = ""  # where vLLM runs the scheme natively (`recipes show` prints it)
    kv_cache: KVCacheSpec | None = None  # a quantized KV cache (`finalize --kv-cache fp8` sets it on any recipe)
    transforms: tuple["Transform", ...] = ()  # rotations applied to the float model before it is quantized
    mixture: str | None = None  # a llama.cpp GGUF mixture (Q4_K_M, ...): per-tensor types around the scheme's (gguf_mixtures)
    tensor_types: tuple[str, ...] = ()  # per-tensor type overrides, REGEX=TYPE, the last match wins (tensor_types)
    source: str = ""

    @property
    def quantizer(self) -> AlgorithmStep:
        """The last step: the algorithm that rounds the weights."""
        return self.steps[-1]

    @property
    def before_quantizer(self) -> tuple[AlgorithmStep, ...]:
        """The steps before the quantizer (AWQ, SmoothQuant: scales moved between activations and weights)."""
        return self.steps[:-1]

    @property
    def fused_rotations(self) -> tuple["Transform", ...]:
        return tuple(t for t in self.transforms if not t.online)

    @property
    def online_rotations(self) -> tuple["Transform", ...]:
        return tuple(t for t in self.transforms if t.online)

    @property
    def learned_rotations(self) -> "Transform | None":
        return next((t for t in self.transforms if t.learn is not None), None)

    @property
    def needs_samples(self) -> bool:
        """Whether finalize reads calibration data: to calibrate, or to learn the rotations."""
        return self.needs_calibration or self.learned_rotations is not None

    @property
    def needs_calibration(self) -> bool:
        return self.kv_cache is not None or self.needs_calibration_without_kv

    @property
    def needs_calibration_without_kv(self) -> bool:
        """Whether the weights or activations calibrate (not only a quantized KV cache's scales)."""
        calibrated_acts = self.scheme.activations is not None and self.scheme.activations.calibrated
        return calibrated_acts or any(step.algorithm.needs_data for step in self.steps)

    def describe_algorithm(self) -> str:
        parts = ["+".join(t.rotations) + (" (learned)" if t.learn is not None else "") for t in self.transforms]
        rotations = ["+".join(parts)] if parts else []
        return " + ".join(rotations + [step.name for step in self.steps])  # "R1+R2 + rtn": `recipes show` says which matrix

    def requirement(self, fmt: Format) -> Requirement:
        return self.requires.get(fmt, Requirement())

    def to_dict(self) -> dict[str, Any]:
        """The recipe as resolved, JSON-ready (`recipes show --json` and quantkit.json). A transform's `learn` is
        given only where it learns (so recipes, QAT checkpoints and resume fingerprints from before it read the same)."""
        data = _plain(asdict(self))
        data["transforms"] = [{k: v for k, v in t.items() if k != "learn" or v is not None} for t in data["transforms"]]
        return data

    def to_file(self) -> dict[str, Any]:
        """The recipe as a recipe file writes it, every default spelt out (`recipes show`): a file that `resolve`
        reads back to this recipe, under the file's own name."""
        data = self.to_dict()
        steps = [{"name": step["name"], **step["args"]} for step in data["steps"]]
        data["algorithm"] = steps[0] if len(steps) == 1 else steps
        order = ("description", "scheme", "transforms", "algorithm", "calibration", "format", "mixture", "tensor_types",
                 "ignore", "on_indivisible", "requires", "hardware", "kv_cache")
        return {key: data[key] for key in order if data.get(key) not in (None, []) or key == "ignore"}  # [] is not the default


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------- lookup


def _walk(folder: Traversable) -> Iterator[Traversable]:
    for entry in folder.iterdir():
        if entry.is_dir():
            yield from _walk(entry)
        elif entry.name.endswith((".yaml", ".yml")):
            yield entry


def _recipe_files() -> dict[str, Traversable]:
    """Every shipped recipe, found recursively in the installed package (wheel or source checkout)."""
    entries = sorted(_walk(resources.files("quantkit.recipes")), key=lambda e: e.name.rsplit(".", 1)[0])
    return {entry.name.rsplit(".", 1)[0]: entry for entry in entries}


def list_recipes() -> list[Recipe]:
    return [load_recipe_file(path) for path in _recipe_files().values()]


def recipe_names() -> list[str]:
    return sorted(_recipe_files())


def _looks_like_path(value: str) -> bool:
    return value.endswith((".yaml", ".yml")) or os.sep in value or "/" in value


def resolve(name_or_path: str) -> Recipe:
    """A recipe name (`int4-weight-only`) or a path to a recipe YAML file."""
    if _looks_like_path(name_or_path):
        path = Path(name_or_path)
        if not path.is_file():
            raise RecipeNotFoundError(f"recipe file {name_or_path} does not exist; pass a recipe name or an existing .yaml file")
        return load_recipe_file(path)
    files = _recipe_files()
    if name_or_path not in files:
        raise RecipeNotFoundError(f"unknown recipe '{name_or_path}'{_close_names(name_or_path, files)} (see `quantkit recipes list`)")
    return load_recipe_file(files[name_or_path])


def _close_names(name: str, files: dict) -> str:
    """"; did you mean a, b?" for the recipe names close to a mistyped one, or ""."""
    close = difflib.get_close_matches(name, list(files), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else ""


# ---------------------------------------------------------------- parsing

_TOP_KEYS = {"description", "scheme", "algorithm", "calibration", "format", "ignore", "on_indivisible", "requires", "hardware",
             "kv_cache", "transforms", "mixture", "tensor_types"}


def load_recipe_file(path: Path | Traversable) -> Recipe:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML ({exc.__class__.__name__}); fix the file's syntax") from exc
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping with keys {sorted(_TOP_KEYS)}")
    try:
        return parse_recipe(path.name.rsplit(".", 1)[0], data, source=str(path))
    except SchemeError as exc:
        raise RecipeError(f"{path}: {exc}") from exc


def parse_recipe(name: str, data: dict[str, Any], source: str = "") -> Recipe:
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise SchemeError(sorted(unknown)[0], f"unknown key; allowed keys are {sorted(_TOP_KEYS)}")
    scheme = _parse_scheme(_mapping(data, "scheme", required=True))
    steps = _parse_steps(data.get("algorithm", {"name": algorithms.DEFAULT}))
    _check_steps(scheme, steps)
    return Recipe(
        name=name,
        description=str(data.get("description", "")),
        scheme=scheme,
        format=_enum(data.get("format"), Format, "format", required=True),
        steps=steps,
        calibration=_parse_calibration(_mapping(data, "calibration") or {}),
        ignore=tuple(_str_list(data.get("ignore", ["lm_head"]), "ignore")),
        on_indivisible=_enum(data.get("on_indivisible", "smaller-group"), IndivisiblePolicy, "on_indivisible"),
        requires=_parse_requires(_mapping(data, "requires") or {}),
        hardware=str(data.get("hardware", "")),
        kv_cache=_parse_kv_cache(data.get("kv_cache")),
        transforms=_parse_transforms(data.get("transforms", [])),
        mixture=_parse_mixture(data.get("mixture"), scheme),
        tensor_types=_parse_tensor_types(data.get("tensor_types", []), scheme, steps),
        source=source,
    )


def _parse_tensor_types(value: Any, scheme: QuantScheme, steps: tuple[AlgorithmStep, ...]) -> tuple[str, ...]:
    """`tensor_types: [REGEX=TYPE, ...]` (quant.tensor_types), each type one the quantizer rounds onto."""
    from quantkit.quant import tensor_types

    overrides = tensor_types.parse_all(_str_list(value, "tensor_types"))
    quantizer = steps[-1].algorithm
    first_of_each_type: dict[str, tensor_types.Override] = {}
    for override in map(tensor_types.Override.parse, overrides):
        first_of_each_type.setdefault(override.type, override)
    for override in first_of_each_type.values():  # a plan's thousands of overrides take a few types
        weights = tensor_type_spec(override.type)
        refusal = None if weights is None else quantizer.refusal(QuantScheme(weights, scheme.activations))
        if refusal:
            raise SchemeError("tensor_types", f"{override}: {refusal}")
    return overrides


@lru_cache(maxsize=64)
def tensor_type_spec(name: str) -> WeightSpec | None:
    """The weights' grid of a per-tensor type (`quant.tensor_types`): a GGML type's, a recipe's scheme's (its file
    read once: the planner asks for every tensor and candidate); None for `float`. SchemeError for a name that is no
    recipe."""
    from quantkit.quant import gguf_types, tensor_types

    if tensor_types.is_ggml(name):
        return gguf_types.spec(name)
    files = _recipe_files()
    if name not in files:
        raise SchemeError("tensor type", f"'{name}' is neither a GGML type nor a recipe{_close_names(name, files)} "
                          "(see `quantkit recipes list`)")
    return resolve(name).scheme.weights


def with_tensor_types(recipe: Recipe, texts: list[str] | None) -> Recipe:
    """The recipe with `finalize --tensor-type REGEX=TYPE ...` after its own overrides (the last match wins)."""
    if not texts:
        return recipe
    try:
        added = _parse_tensor_types(list(texts), recipe.scheme, recipe.steps)
    except SchemeError as exc:
        raise RecipeError(f"--tensor-type {exc.message}") from exc
    return replace(recipe, tensor_types=recipe.tensor_types + added)


def _parse_mixture(value: Any, scheme: QuantScheme) -> str | None:
    """A llama.cpp mixture name, whose base type the scheme's weights must be."""
    if value is None:
        return None
    from quantkit.quant import gguf_types
    from quantkit.quant.gguf_mixtures import MIXTURES

    if value not in MIXTURES:
        raise SchemeError("mixture", f"'{value}' is not one quantkit knows; allowed: {', '.join(MIXTURES)}")
    base = MIXTURES[value]
    if scheme.weights.k_quant_type != base and scheme.weights != gguf_types.spec(base):
        grid = ("float4_e2m1fn group_size 32 with scale_dtype float8_e8m0fnu" if base == "MXFP4" else
                "scale_dtype: k_quant, e.g. int4 group_size 32 asymmetric for Q4_K" if base.endswith("_K") else
                f"the scheme of recipe gguf-{base.lower().replace('_', '-')}")
        raise SchemeError("mixture", f"{value} is built on {base}: the scheme's weights must be {base}'s grid ({grid})")
    return value


def _parse_transforms(value: Any) -> tuple[Transform, ...]:
    if not isinstance(value, list):
        raise SchemeError("transforms", "is a list, e.g. [{type: hadamard, rotations: [R1, R2]}]")
    transforms, seen = [], set()
    for i, item in enumerate(value):
        where = f"transforms[{i}]"
        if not isinstance(item, dict):
            raise SchemeError(where, "is a mapping with keys type, rotations, seed, online, learn")
        unknown = set(item) - {"type", "rotations", "seed", "online", "learn"}
        if unknown:
            raise SchemeError(f"{where}.{sorted(unknown)[0]}",
                              "unknown key; allowed keys are learn, online, rotations, seed, type")
        kind = _enum(item.get("type", "hadamard"), TransformType, f"{where}.type")
        rotations = tuple(_str_list(item.get("rotations", list(FUSED)), f"{where}.rotations"))
        for rotation in rotations:
            if rotation not in ROTATIONS:
                raise SchemeError(f"{where}.rotations", f"'{rotation}' is not a rotation; use {', '.join(FUSED + ONLINE)}")
            if rotation in seen:
                raise SchemeError(f"{where}.rotations", f"{rotation} is given twice")
            if rotation not in FUSED + ONLINE:
                raise SchemeError(f"{where}.rotations", f"{rotation} (online, inside attention) is not supported: vLLM "
                                  f"does not apply it; use {', '.join(FUSED + ONLINE)}")
        seen.update(rotations)
        online = _bool(item.get("online", False), f"{where}.online")
        if not rotations:
            raise SchemeError(f"{where}.rotations", f"names at least one rotation: {', '.join(FUSED + ONLINE)}")
        mixed = [r for r in rotations if (r in ONLINE) != online]
        if mixed and online:
            raise SchemeError(f"{where}.rotations", f"{', '.join(mixed)} is fused into the weights, not online; give it "
                              "in a transform of its own without online: true")
        if mixed:
            raise SchemeError(f"{where}.online", f"{', '.join(mixed)} is applied to activations at run time: give it "
                              "with online: true, e.g. {type: hadamard, rotations: [R4], online: true}")
        seed = item.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise SchemeError(f"{where}.seed", "is an integer >= 0")
        if seed and kind is TransformType.HADAMARD:
            raise SchemeError(f"{where}.seed", "is random-hadamard's (type: hadamard has no randomness)")
        learn = _parse_learning(item["learn"], f"{where}.learn", online) if "learn" in item else None
        if learn is not None and any(t.learn is not None for t in transforms):
            raise SchemeError(f"{where}.learn", "is given once: put the rotations to learn (R1, R2) in one transform")
        transforms.append(Transform(kind, rotations, seed, online, learn))
    return tuple(transforms)


def _parse_learning(value: Any, where: str, online: bool) -> Learning:
    if online:
        raise SchemeError(where, "learns fused rotations (R1, R2) only; an online rotation is the Hadamard matrix its "
                          "runtimes build")
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise SchemeError(where, "is a mapping, e.g. {steps: 100, learning_rate: 1.5} ({} for the defaults)")
    unknown = set(value) - {"steps", "learning_rate"}
    if unknown:
        raise SchemeError(f"{where}.{sorted(unknown)[0]}", "unknown key; allowed keys are learning_rate, steps")
    steps, rate = value.get("steps", Learning.steps), value.get("learning_rate", Learning.learning_rate)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise SchemeError(f"{where}.steps", "is an integer >= 1")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 < rate < float("inf"):
        raise SchemeError(f"{where}.learning_rate", "is a number > 0")
    return Learning(steps, float(rate))


def scheme_from_dict(data: dict[str, Any]) -> QuantScheme:
    """A scheme as `Recipe.to_dict` (quantkit.json) writes it, parsed back."""
    return _parse_scheme(data)


def _parse_scheme(data: dict[str, Any]) -> QuantScheme:
    try:
        return _build_scheme(data)
    except SchemeError as exc:
        field_name = exc.field if exc.field.startswith("scheme.") else f"scheme.{exc.field}"
        raise SchemeError(field_name, exc.message) from None


def _only_known(data: dict[str, Any], allowed: list[str], where: str) -> None:
    """Refuse a key the spec does not have: a misspelt one (`symetric`, `activation`) would otherwise leave its
    default in place and write another scheme than the one asked for."""
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise SchemeError(f"{where}{unknown[0]}", f"unknown key; allowed keys are {sorted(allowed)}")


def _build_scheme(data: dict[str, Any]) -> QuantScheme:
    _only_known(data, ["weights", "activations"], "scheme.")
    w = _mapping(data, "weights", required=True, where="scheme.")
    _only_known(w, [f.name for f in fields(WeightSpec)], "scheme.weights.")
    weights = WeightSpec(
        dtype=_enum(w.get("dtype"), QDtype, "scheme.weights.dtype", required=True),
        granularity=_enum(w.get("granularity"), Granularity, "scheme.weights.granularity", required=True),
        group_size=w.get("group_size"),
        symmetric=_bool(w.get("symmetric", True), "scheme.weights.symmetric"),
        scale_dtype=_enum(w.get("scale_dtype", "model"), ScaleDtype, "scheme.weights.scale_dtype"),
        observer=_enum(w.get("observer", "minmax"), WeightObserver, "scheme.weights.observer"),
        block_shape=_block_shape(w.get("block_shape")),
        global_scale=_bool(w.get("global_scale", False), "scheme.weights.global_scale"),
    )
    a = _mapping(data, "activations", where="scheme.")
    activations = None
    if a:
        _only_known(a, [f.name for f in fields(ActivationSpec)], "scheme.activations.")
        dynamic = _bool(a.get("dynamic", True), "scheme.activations.dynamic")
        activations = ActivationSpec(
            dtype=_enum(a.get("dtype"), QDtype, "scheme.activations.dtype", required=True),
            granularity=_enum(a.get("granularity", "token" if dynamic else "tensor"), Granularity, "scheme.activations.granularity"),
            symmetric=_bool(a.get("symmetric", True), "scheme.activations.symmetric"),
            dynamic=dynamic,
            observer=str(a.get("observer", "static_minmax")),
            group_size=a.get("group_size"),
            scale_dtype=_enum(a["scale_dtype"], ScaleDtype, "scheme.activations.scale_dtype") if a.get("scale_dtype") is not None else None,
            global_scale=_bool(a.get("global_scale", False), "scheme.activations.global_scale"),
        )
    return QuantScheme(weights=weights, activations=activations)


KV_CACHE_CHOICES = {"fp8": Granularity.TENSOR, "fp8-head": Granularity.HEAD}  # `finalize --kv-cache`; "none" drops it


def _parse_kv_cache(value: Any) -> KVCacheSpec | None:
    """`kv_cache: fp8` (or `fp8-head`), or the mapping `{dtype, granularity, observer}`; absent or `none`: None."""
    if value is None or value == "none":
        return None
    if isinstance(value, str):
        if value not in KV_CACHE_CHOICES:
            raise SchemeError("kv_cache", f"'{value}' is not allowed; allowed: {', '.join([*KV_CACHE_CHOICES, 'none'])}, or a mapping")
        return KVCacheSpec(granularity=KV_CACHE_CHOICES[value])
    if not isinstance(value, dict):
        raise SchemeError("kv_cache", "expected fp8, fp8-head, none or a mapping {dtype, granularity, observer}")
    unknown = set(value) - {"dtype", "granularity", "observer"}
    if unknown:
        raise SchemeError(f"kv_cache.{sorted(unknown)[0]}", "unknown key; allowed keys are ['dtype', 'granularity', 'observer']")
    return KVCacheSpec(
        dtype=_enum(value.get("dtype", "float8_e4m3fn"), QDtype, "kv_cache.dtype"),
        granularity=_enum(value.get("granularity", "tensor"), Granularity, "kv_cache.granularity"),
        observer=str(value.get("observer", "static_minmax")),
    )


def with_kv_cache(recipe: Recipe, choice: str | None) -> Recipe:
    """The recipe with `finalize --kv-cache CHOICE` applied (fp8, fp8-head, none); None leaves it as it is."""
    if choice is None:
        return recipe
    if choice not in (*KV_CACHE_CHOICES, "none"):
        raise RecipeError(f"--kv-cache '{choice}' is not allowed; use {', '.join(KV_CACHE_CHOICES)} or none")
    return replace(recipe, kv_cache=_parse_kv_cache(choice))


def _block_shape(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in value):
        raise SchemeError("scheme.weights.block_shape", f"{value!r} is not allowed; give [rows, columns], e.g. [128, 128]")
    return tuple(value)


def _parse_steps(value: Any) -> tuple[AlgorithmStep, ...]:
    """`{name: gptq, block_size: 128}` or a list of such: transforms first, then one quantizer."""
    items = value if isinstance(value, list) else [value]
    steps = tuple(_parse_step(item, f"algorithm[{i}]" if isinstance(value, list) else "algorithm") for i, item in enumerate(items))
    quantizers = ", ".join(algorithms.names(quantizer=True))
    if not steps or not steps[-1].algorithm.quantizer:
        raise SchemeError("algorithm", f"the last step must be a quantizer: {quantizers} (e.g. [{{name: smoothquant}}, {{name: gptq}}])")
    if any(step.algorithm.quantizer for step in steps[:-1]):
        raise SchemeError("algorithm", f"only the last step may be a quantizer ({quantizers}); transforms such as "
                          f"{', '.join(algorithms.names(quantizer=False))} come first")
    return steps


def _check_steps(scheme: QuantScheme, steps: tuple[AlgorithmStep, ...]) -> None:
    """What each algorithm refuses for the scheme (`Algorithm.refusal`), when the recipe is read."""
    for step in steps:
        why = step.algorithm.refusal(scheme)
        if why:
            raise SchemeError("algorithm", why)


def _parse_step(item: Any, where: str) -> AlgorithmStep:
    if not isinstance(item, dict):
        raise SchemeError(where, "must be a mapping such as {name: gptq}")
    args = dict(item)
    name = args.pop("name", None)
    allowed = ", ".join(algorithms.names())
    if name is None:
        raise SchemeError(f"{where}.name", f"is required; allowed: {allowed}")
    if name not in algorithms.names():
        raise SchemeError(f"{where}.name", f"'{name}' is not allowed; allowed: {allowed}")
    try:
        args = algorithms.get(name).parse_arguments(args)
    except SchemeError as exc:
        raise SchemeError(f"{where}.{exc.field}", exc.message) from None
    return AlgorithmStep(name=name, args=args)


def _parse_calibration(data: dict[str, Any]) -> Calibration:
    allowed = {"num_samples": int, "seq_len": int, "dataset": str}
    for key, value in data.items():
        if key not in allowed:
            raise SchemeError(f"calibration.{key}", f"unknown key; allowed keys are {sorted(allowed)}")
        if value is not None and (not isinstance(value, allowed[key]) or isinstance(value, bool)):
            raise SchemeError(f"calibration.{key}", f"{value!r} is not allowed; expected {allowed[key].__name__}")
    for key, least in (("num_samples", 1), ("seq_len", 2)):
        if data.get(key) is not None and data[key] < least:
            raise SchemeError(f"calibration.{key}", f"{data[key]} is not allowed; use at least {least}")
    return Calibration(**data)


def _parse_requires(data: dict[str, Any]) -> dict[Format, Requirement]:
    out = {}
    for key, req in data.items():
        fmt = _enum(key, Format, "requires")
        req = req or {}
        cap = req.get("cuda_capability")
        out[fmt] = Requirement(
            cuda_capability=str(cap) if cap is not None else None,
            packages=tuple(_str_list(req.get("packages", []), f"requires.{key}.packages")),
        )
    return out


def _mapping(data: dict[str, Any], key: str, required: bool = False, where: str = "") -> dict[str, Any] | None:
    value = data.get(key)
    if value is None:
        if required:
            raise SchemeError(where + key, "is required")
        return None
    if not isinstance(value, dict):
        raise SchemeError(where + key, "must be a mapping")
    return value


def _enum(value: Any, enum: type[Enum], field_name: str, required: bool = False) -> Any:
    allowed = ", ".join(e.value for e in enum)
    if value is None and required:
        raise SchemeError(field_name, f"is required; allowed: {allowed}")
    try:
        return enum(value)
    except ValueError:
        raise SchemeError(field_name, f"'{value}' is not allowed; allowed: {allowed}") from None


def _bool(value: Any, field_name: str) -> bool:
    if not isinstance(value, bool):
        raise SchemeError(field_name, f"'{value}' is not allowed; use true or false")
    return value


def _str_list(value: Any, field_name: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SchemeError(field_name, "must be a list of strings")
    return value
