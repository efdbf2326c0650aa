"""The `quantkit train` configuration: a YAML file, validated before any work starts.

Every key is checked against the dataclass fields below; an error names the key and what is allowed.
`--set section.key=value` overrides a key (the value is parsed as YAML: `--set train.lr=1e-4`).
`model.config` (a model trained from scratch) is checked against its model type's config class by `model_config`,
which imports transformers (the rest of this module needs neither it nor torch).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from quantkit.errors import UsageError


class ConfigError(UsageError):
    pass


@dataclass
class ModelSection:
    path: str | None = None  # a Hugging Face model directory or hub id (org/name, from the HF cache) to fine-tune
    revision: str | None = None  # with a hub id in `path`: the branch, tag or commit; default: main
    config: dict | None = None  # or a model config (with model_type) to train from scratch
    tokenizer: str | None = None  # tokenizer directory or hub id; default: `path`
    tokenizer_revision: str | None = None  # with a hub id in `tokenizer`


@dataclass(frozen=True)
class Sources:
    """Where the model and tokenizer come from, as directories."""

    model: Path | None  # None: trained from model.config
    tokenizer: Path


@dataclass
class DataSection:
    train: str = ""  # data spec (local .txt/.jsonl/.parquet, or a datasets spec)
    eval: str | None = None
    text_field: str = "text"
    seq_len: int = 256  # tokens per packed block


@dataclass
class TrainSection:
    micro_batch_size: int = 8  # sequences per forward pass, per rank
    global_batch_size: int = 32  # sequences per optimizer step, all ranks together; independent of N
    max_steps: int = 100
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | constant
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    precision: str = "auto"  # auto (bf16 autocast where the device supports it) | bf16 | fp32
    seed: int = 0
    log_interval: int = 10
    eval_interval: int = 0  # 0: only at the end
    eval_max_samples: int = 32
    save_interval: int = 0  # 0: only the final model
    keep_last: int = 2


@dataclass
class TrainConfig:
    model: ModelSection
    data: DataSection
    train: TrainSection = field(default_factory=TrainSection)
    output_dir: str = "runs/train"
    qat_recipe: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_CHOICES = {"train.schedule": ("cosine", "constant"), "train.precision": ("auto", "bf16", "fp32")}


_MINIMAL = "model: {path: DIR} (or model.config) and data: {train: FILE}"


def load(path: str | Path, overrides: list[str] = ()) -> TrainConfig:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; pass the training config, a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc.__class__.__name__})") from exc
    if data is None:
        raise ConfigError(f"{path} is empty; a training config needs at least {_MINIMAL}")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config is a mapping of sections: model, data, train, output_dir, qat_recipe")
    for item in overrides:
        apply_override(data, item)
    return from_dict(data)


def apply_override(data: dict, item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item}: use --set section.key=value (e.g. --set train.lr=1e-4)")
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item}: '{part}' is not a section")
    node[leaf] = yaml.safe_load(value)


def from_dict(data: dict) -> TrainConfig:
    config = _build(TrainConfig, data, "")
    validate(config)
    return config


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where.rstrip('.') or 'config'}: must be a mapping")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown key '{where}{unknown[0]}'; allowed: {', '.join(sorted(names))}")
    _check_required(cls, data, where)
    values = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, f"{where}{name}.")
        else:
            values[name] = _check_type(value, hint, f"{where}{name}")
    return cls(**values)


def _check_required(cls: type, data: dict, where: str) -> None:
    """A field without a default (the `model` and `data` sections) must be there."""
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in data:
            raise ConfigError(f"the config has no '{where}{f.name}' section; "
                              f"a training config needs at least {_MINIMAL}")


def _check_type(value: Any, hint: Any, key: str) -> Any:
    allowed = [a for a in typing.get_args(hint)] if isinstance(hint, types.UnionType) else [hint]
    if value is None and type(None) in allowed:
        return None
    for kind in allowed:
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is float and isinstance(value, str) and _is_number(value):  # PyYAML reads `3e-4` as a string
            return float(value)
        if kind is not type(None) and isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return value
    names = " or ".join("null" if a is type(None) else a.__name__ for a in allowed)
    raise ConfigError(f"{key}: {value!r} is not allowed; expected {names}")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def validate(config: TrainConfig) -> None:
    """Cross-field checks, all before any model or data is loaded."""
    m, d, t = config.model, config.data, config.train
    if (m.path is None) == (m.config is None):
        raise ConfigError("model: give either model.path (fine-tune) or model.config (train from scratch), not both")
    if m.config is not None and "model_type" not in m.config:
        raise ConfigError("model.config.model_type is required (e.g. llama)")
    if m.config is not None and not m.tokenizer:
        raise ConfigError("model.tokenizer is required when training from model.config")
    if m.revision is not None and m.path is None:
        raise ConfigError("model.revision is the revision of model.path (a hub id); set model.path or remove model.revision")
    if m.tokenizer_revision is not None and m.tokenizer is None:
        raise ConfigError("model.tokenizer_revision is the revision of model.tokenizer (a hub id); set model.tokenizer "
                          "or use model.revision for model.path's tokenizer")
    if not d.train:
        raise ConfigError("data.train is required (a .txt/.jsonl/.parquet file or a datasets spec)")
    for key, choices in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value not in choices:
            raise ConfigError(f"{key}: '{value}' is not allowed; allowed: {', '.join(choices)}")
    # (value, least allowed): a block of one token predicts nothing; evaluation needs a sample
    least = {"data.seq_len": (d.seq_len, 2), "train.micro_batch_size": (t.micro_batch_size, 1),
             "train.global_batch_size": (t.global_batch_size, 1), "train.max_steps": (t.max_steps, 1),
             "train.keep_last": (t.keep_last, 1), "train.eval_max_samples": (t.eval_max_samples, 1)}
    for key, (value, minimum) in least.items():
        if value < minimum:
            raise ConfigError(f"{key}: must be >= {minimum} (got {value})")
    if t.lr <= 0 or not 0 <= t.min_lr_ratio <= 1 or t.warmup_steps < 0:
        raise ConfigError("train.lr must be > 0, train.min_lr_ratio in [0, 1], train.warmup_steps >= 0")


def model_config(section: ModelSection):
    """model.config as a transformers config, checked: a known model_type, keys its config class knows (a typo
    would otherwise be dropped silently and the default size built), values its validators accept."""
    from transformers import CONFIG_MAPPING

    params = dict(section.config)
    model_type = params.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else "e.g. llama, qwen2, qwen3, mistral, gemma2, phi3"
        raise ConfigError(f"model.config.model_type: unknown model_type {model_type}; {hint}")
    config_class = CONFIG_MAPPING[model_type]
    _check_model_keys(config_class, params)
    try:
        return config_class(**params)
    except Exception as exc:  # ValueError, TypeError, huggingface_hub's StrictDataclassError: the last line says why
        reason = str(exc).strip().splitlines()[-1].strip().removeprefix("ValueError: ").removeprefix("TypeError: ")
        raise ConfigError(f"model.config: {reason}") from exc


def _check_model_keys(config_class: type, params: dict) -> None:
    known = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
    for cls in config_class.__mro__:
        if "__init__" in vars(cls):
            known |= set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    for key in params:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else f"see {config_class.__name__} for the keys it takes"
            raise ConfigError(f"unknown key 'model.config.{key}' for model_type {config_class.model_type}; {hint}")


def resolve_sources(config: TrainConfig) -> Sources:
    """model.path and model.tokenizer as directories: as given, or hub ids resolved through the Hugging Face cache
    (`sources.resolve_source`: HF_HUB_OFFLINE=1 never goes online). The tokenizer defaults to the model's. Errors
    name the config key."""
    from quantkit.errors import SourceModelError
    from quantkit.models import sources

    m = config.model
    try:
        model = sources.resolve_source(m.path, m.revision) if m.path else None
    except SourceModelError as exc:
        raise SourceModelError(f"model.path: {exc}") from exc
    if not m.tokenizer:
        return Sources(model, model)
    try:
        return Sources(model, sources.resolve_tokenizer(m.tokenizer, m.tokenizer_revision))
    except SourceModelError as exc:
        raise SourceModelError(f"model.tokenizer: {exc}") from exc


def accumulation_steps(config: TrainConfig, world_size: int) -> int:
    """Micro-steps per optimizer step so that the global batch stays `train.global_batch_size` for any N."""
    t = config.train
    per_step = t.micro_batch_size * world_size
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size {t.global_batch_size} is not a multiple of micro_batch_size x ranks "
            f"({t.micro_batch_size} x {world_size}); change train.micro_batch_size or --nproc-per-node"
        )
    return t.global_batch_size // per_step
