"""A name -> implementation table filled by a decorator where each implementation is defined.

Algorithms (`quantkit.algorithms`) and calibration layer steps (`quantkit.calibration.steps`) register this
way; each package imports its implementation modules in one place, so nothing is found by walking packages.
"""

from __future__ import annotations

from typing import Callable, Generic, Hashable, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """`@registry.register(key)` on a function or class; `registry.get(key)` finds it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[Hashable, T] = {}

    def register(self, key: Hashable) -> Callable[[T], T]:
        def decorator(entry: T) -> T:
            if key in self._entries:
                raise ValueError(f"{self.kind} {_name(key)} registered twice")
            self._entries[key] = entry
            return entry

        return decorator

    def get(self, key: Hashable) -> T:
        try:
            return self._entries[key]
        except KeyError:
            known = ", ".join(sorted(_name(k) for k in self._entries)) or "none"
            raise LookupError(f"no {self.kind} registered for {_name(key)} (registered: {known})") from None

    def keys(self) -> list[Hashable]:
        return list(self._entries)


def _name(key: Hashable) -> str:
    return str(getattr(key, "value", key))
