"""The process a command runs in: the bottom layer, which imports only `quantkit.errors`.

- `environment.py`: threads; what the environment says (rank, launcher, `QUANTKIT_DEBUG`).
- `distributed.py`: process groups (gloo or nccl, following the compute device), collectives, owner bin-packing.
- `hardware.py`: the GPUs this machine has: `--device` and `--nproc-per-node` checked against them.
- `placement.py`: where tensors live: the compute device, and the rule that what is written is on the CPU.
- `precision.py`: half-precision products on CPUs without native instructions for them.
- `memory.py`: giving freed memory back to the system between the big allocations.
- `progress.py`: progress bars (rich) on a terminal; elsewhere, and under `--quiet`, every call is a no-op.
- `registration.py`: a name -> implementation table filled by a decorator.
"""
