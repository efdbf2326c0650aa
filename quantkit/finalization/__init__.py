"""Finalization: `quantkit finalize`, prepare -> quantize -> write.

- `finalize.py`: the run: prepare (every check, before any weight is read), quantize (streamed layer by layer, or
  the whole model), write (through the format's exporter, atomically).
- `preflight.py`: what a run will need (memory, disk, time), estimated before anything loads.

Imports anything below it: `quantkit.calibration`, `quantkit.export`, `quantkit.algorithms`, `quantkit.models`,
`quantkit.quant`, `quantkit.runtime`, `quantkit.data`, `quantkit.errors`.
"""
