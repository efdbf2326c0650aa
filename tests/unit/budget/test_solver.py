"""The budget solver: within the budget, and the least error there on instances whose optimum is known."""

import itertools
import random

import pytest

from quantkit.budget.solver import BudgetError, Choice, Option, hull, solve, total


def test_the_hull_drops_dominated_and_concave_options():
    options = (Option("a", 10, 9.0), Option("b", 20, 4.0), Option("c", 30, 3.5), Option("d", 40, 1.0), Option("e", 50, 2.0))
    assert [o.type for o in hull(options)] == ["a", "b", "d"]  # e: more bytes, more error; c: above the b-d line


def _brute_force(choices, budget):
    best = None
    for combo in itertools.product(*(c.options for c in choices)):
        size, error = sum(o.bytes for o in combo), sum(o.error for o in combo)
        if size <= budget and (best is None or error < best):
            best = error
    return best


def test_a_known_optimum():
    choices = [Choice("x", (Option("2", 2, 8.0), Option("4", 4, 2.0), Option("8", 8, 0.0))),
               Choice("y", (Option("2", 2, 1.0), Option("4", 4, 0.5), Option("8", 8, 0.0)))]
    chosen = solve(choices, 8)
    assert {name: o.type for name, o in chosen.items()} == {"x": "4", "y": "4"}
    assert total(chosen) == (8, 2.5)


@pytest.mark.parametrize("seed", range(20))
def test_within_the_budget_and_near_the_optimum(seed):
    rng = random.Random(seed)
    choices = []
    for i in range(5):
        size = rng.choice([256, 512, 1024])
        options, error = [], rng.uniform(1, 10)
        for bits in (2, 3, 4, 5, 6, 8):
            error *= rng.uniform(0.2, 0.6)
            options.append(Option(str(bits), size * bits, error))
        choices.append(Choice(f"t{i}", tuple(options)))
    smallest = sum(min(o.bytes for o in c.options) for c in choices)
    largest = sum(max(o.bytes for o in c.options) for c in choices)
    budget = rng.randint(smallest, largest)
    chosen = solve(choices, budget)
    used, error = total(chosen)
    optimum = _brute_force(choices, budget)
    assert used <= budget
    assert error <= optimum * 1.25 + 1e-12  # greedy on hulls, then filled: near the knapsack's optimum
    uniform = [sum(c.options[k].error for c in choices) for k in range(6)
               if sum(c.options[k].bytes for c in choices) <= budget]
    assert error <= min(uniform) + 1e-12  # never worse than the best single type that fits


def test_a_budget_below_the_smallest_candidates_is_refused():
    with pytest.raises(BudgetError, match="smallest candidates take 4 bytes"):
        solve([Choice("x", (Option("2", 2, 1.0),)), Choice("y", (Option("2", 2, 1.0),))], 3)
