"""Per-tensor type overrides: `finalize --tensor-type REGEX=TYPE` (repeatable) and a recipe's `tensor_types` list,
in the same `REGEX=TYPE` spelling. A budget plan is written the same way, one exact name per tensor.

REGEX is searched (`re.search`) in a tensor's quantkit module name (`model.layers.3.mlp.down_proj`) and in its GGUF
name (`blk.3.ffn_down`, `output`, `token_embd`), so `ffn_down`, `down_proj` and `^blk\\.(0|1)\\.attn_v$` all work.
Every override is applied in order and the last one that matches a tensor wins; the recipe's come before the
command line's. TYPE is what the format holds per tensor: a GGML type (`gguf_types.names()`, any case) in a GGUF
file, a recipe name whose scheme the tensor takes (`gptq-w8a16`) in a compressed-tensors artifact, or `float`
(left in full precision) in either. Torch-free: the request check parses overrides before any model is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from quantkit.grids.schemes import SchemeError, WeightSpec
from quantkit.quant import gguf_types

EMBEDDING_NAMES = ("model.embed_tokens", "token_embd")  # the token embedding, as quantkit and GGUF name it


@dataclass(frozen=True)
class Override:
    pattern: str
    type: str  # gguf_types' canonical name

    @classmethod
    def parse(cls, text: str) -> Override:
        """`REGEX=TYPE` (split at the last `=`), or SchemeError saying what is wrong."""
        pattern, sep, kind = str(text).rpartition("=")
        if not sep or not pattern.strip() or not kind.strip():
            raise SchemeError("tensor_types", f"'{text}' is not REGEX=TYPE; e.g. 'ffn_down=Q6_K' or 'attn_v=q8_0'")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise SchemeError("tensor_types", f"'{pattern}' is not a regular expression ({exc}); escape it or fix it") from exc
        return cls(pattern.strip(), type_name(kind))

    def matches(self, names: tuple[str, ...]) -> bool:
        return any(re.search(self.pattern, name) for name in names if name)

    def __str__(self) -> str:
        return f"{self.pattern}={self.type}"


_RECIPE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


def type_name(text: str) -> str:
    """A GGML type as llama.cpp spells it (`q6_k` -> `Q6_K`), `float`, or what can be a recipe's name (the registry
    checks that it is one: `registry.tensor_type_spec`); SchemeError otherwise."""
    try:
        return gguf_types.canonical(text)
    except SchemeError:
        if _RECIPE_NAME.fullmatch(text.strip()):
            return text.strip()
        raise SchemeError("tensor type", f"'{text}' is neither a GGML type quantkit writes ({', '.join(gguf_types.names())}) "
                          "nor a recipe name (`quantkit recipes list`)") from None


def is_ggml(name: str) -> bool:
    """Whether a type is GGUF's (a GGML type or `float`), not a recipe's scheme."""
    return name == gguf_types.FLOAT or name in gguf_types.BLOCK_BYTES


def fits(spec: WeightSpec | None, kind: str, columns: int) -> bool:
    """Whether rows of `columns` weights take type `kind`, whose grid is `spec`: whole blocks of a GGML type, whole
    groups of a recipe's scheme; `float` always."""
    if spec is None:
        return True
    if is_ggml(kind):
        return gguf_types.fits(kind, columns)
    return spec.group_size is None or columns % spec.group_size == 0


def parse_all(texts) -> tuple[str, ...]:
    """Overrides in their canonical spelling (`ffn_down=Q6_K`), each one checked."""
    return tuple(str(Override.parse(text)) for text in texts or ())


def type_for(names: tuple[str, ...], overrides: tuple[str, ...]) -> str | None:
    """The type the last override matching any of `names` gives, or None: no override for this tensor."""
    matching = _Matcher.of(overrides).matching(names)
    return Override.parse(overrides[max(matching)]).type if matching else None


def unmatched(overrides: tuple[str, ...], tensors: list[tuple[str, ...]]) -> list[str]:
    """The overrides that match none of `tensors` (each its names), to be reported: a pattern matching nothing is
    most often a typo."""
    matcher, matched = _Matcher.of(overrides), set()
    for names in tensors:
        matched.update(matcher.matching(names))
    return [text for i, text in enumerate(overrides) if i not in matched]


class _Matcher:
    """Which overrides of a list match a tensor's names. A budget plan gives every tensor its own exact pattern
    (`^name$`, the name escaped): those are looked up by name, so a plan of n tensors costs n lookups, not n^2
    regular-expression searches; the others are searched as written. One per overrides list (they are recipes'
    fields, immutable)."""

    def __init__(self, overrides: tuple[str, ...]):
        self.exact: dict[str, list[int]] = {}
        self.searched: list[tuple[int, re.Pattern]] = []
        for i, override in enumerate(map(Override.parse, overrides)):
            literal = _literal(override.pattern)
            if literal is None:
                self.searched.append((i, re.compile(override.pattern)))
            else:
                self.exact.setdefault(literal, []).append(i)

    @staticmethod
    @lru_cache(maxsize=16)
    def of(overrides: tuple[str, ...]) -> _Matcher:
        return _Matcher(overrides)

    def matching(self, names: tuple[str, ...]) -> set[int]:
        """The indices of the overrides that match any of `names`."""
        found = {i for name in names if name for i in self.exact.get(name, ())}
        found.update(i for i, pattern in self.searched if any(pattern.search(name) for name in names if name))
        return found


def _literal(pattern: str) -> str | None:
    """The one name an anchored, escaped pattern (`^model\\.layers\\.0$`) matches, or None for any other pattern."""
    if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$":
        return None
    body = pattern[1:-1]
    literal = re.sub(r"\\(.)", r"\1", body)
    return literal if re.escape(literal) == body else None


def names_of(module_name: str) -> tuple[str, ...]:
    """A planned Linear's names an override's pattern is searched in: quantkit's and GGUF's."""
    return (module_name, gguf_name(module_name) or "")


def gguf_name(module_name: str) -> str | None:
    """The GGUF tensor name (without `.weight`) of a planned Linear: `blk.N.ffn_down`, `blk.N.attn_v`, `output`;
    an MoE expert's projection is its layer's stacked `blk.N.ffn_down_exps`; None when GGUF has no such role."""
    from quantkit.quant.gguf_mixtures import role_of

    role, layer = role_of(module_name)
    if role is None:
        return None
    return "output" if role == "output" else f"blk.{layer}.{role}"
