"""Fitting a budget: a type per tensor from measured sensitivity (`finalize --target-bpw`).

- `sensitivity.py`: each tensor's estimated error in each candidate type, measured on the calibration samples.
- `solver.py`: the least estimated error within a byte budget (pure).
- `planner.py`: the budget plan of a model, as a recipe with one `tensor_types` entry per tensor.
- `report.py`: the plan as a self-contained web page (`--report FILE.html`), which `eval --report` adds its table to.
"""
