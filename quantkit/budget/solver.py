"""The budget solver: a type for each tensor, the least estimated error within a byte budget (a multiple-choice
knapsack). Pure Python, no torch.

Each tensor's candidates are reduced to their lower convex hull in (bytes, error): a candidate that costs more
and errs no less than another, or lies above the line between two others, is never the best use of bytes. Every
tensor starts at its smallest candidate; then, greedily, the upgrade that removes the most error per byte and still
fits is taken, one hull step at a time (on convex hulls this is the Lagrangian optimum at every budget it lands
on exactly). What is left of the budget is then spent on any single change that fits, best error removed first,
so the plan ends as close under the budget as one tensor's step allows.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    type: str
    bytes: int
    error: float  # estimated error the tensor adds to the model's output in this type


@dataclass(frozen=True)
class Choice:
    name: str
    options: tuple[Option, ...]


class BudgetError(ValueError):
    """The budget cannot be met: even the smallest candidates take more."""


def hull(options: tuple[Option, ...]) -> list[Option]:
    """The lower convex hull of `options` in (bytes, error), by bytes: each step buys error down at a falling rate."""
    points = []
    for option in sorted(options, key=lambda o: (o.bytes, o.error)):
        if points and option.error >= points[-1].error:
            continue  # more bytes, no less error
        while len(points) >= 2 and _slope(points[-2], points[-1]) >= _slope(points[-1], option):
            points.pop()  # the last point lies on or above the line from the one before it to this one
        points.append(option)
    return points


def _slope(a: Option, b: Option) -> float:
    return (b.error - a.error) / (b.bytes - a.bytes)  # negative: error removed per byte


def solve(choices: list[Choice], budget: int) -> dict[str, Option]:
    """The option of each choice: the least total error whose bytes are at most `budget` (see the docstring)."""
    hulls = {c.name: hull(c.options) for c in choices}
    at = {name: 0 for name in hulls}
    used = sum(points[0].bytes for points in hulls.values())
    if used > budget:
        raise BudgetError(f"the smallest candidates take {used} bytes, more than the budget's {budget}")
    queue = []

    def push(name: str) -> None:
        points, i = hulls[name], at[name]
        if i + 1 < len(points):
            heapq.heappush(queue, (_slope(points[i], points[i + 1]), name, i))

    for name in hulls:
        push(name)
    while queue:
        _, name, i = heapq.heappop(queue)
        points = hulls[name]
        step = points[i + 1].bytes - points[i].bytes
        if used + step > budget:
            continue  # this tensor's next step does not fit; smaller ones of others may
        used += step
        at[name] = i + 1
        push(name)
    chosen = {name: hulls[name][at[name]] for name in hulls}
    return _fill(choices, chosen, budget - used)


def _fill(choices: list[Choice], chosen: dict[str, Option], left: int) -> dict[str, Option]:
    """Spend what is left on the single changes that fit, the most error removed first (off the hull too)."""
    while True:
        best = None
        for choice in choices:
            now = chosen[choice.name]
            for option in choice.options:
                extra, gain = option.bytes - now.bytes, now.error - option.error
                if 0 < extra <= left and gain > 0 and (best is None or gain > best[0]):
                    best = (gain, choice.name, option, extra)
        if best is None:
            return chosen
        _, name, option, extra = best
        chosen[name], left = option, left - extra


def total(chosen: dict[str, Option]) -> tuple[int, float]:
    """(bytes, estimated error) of a plan."""
    return sum(o.bytes for o in chosen.values()), sum(o.error for o in chosen.values())
