"""Fused rotations (QuaRot, SpinQuant R1 and R2): the weight math, on plain tensors.

With an orthogonal Q, the residual stream h can be carried rotated, h·Q, without changing the model's function:
every Linear writing to it (o_proj, down_proj; the embedding) writes its output rotated, W ← Qᵀ·W (E ← E·Q), and
every Linear reading it reads the rotated stream, W ← W·Q, so (x·Q)·(W·Q)ᵀ = x·Wᵀ. RMSNorm commutes with Q
(‖h·Q‖ = ‖h‖) but its per-channel weight g does not, so each norm's weight is first folded into the Linears it
feeds, W ← W·diag(g), and set to one. Per attention head (R2), the value vectors can be rotated by a head_dim-sized
Q the same way: v_proj's output rows of each head, and o_proj's input columns of each head.

The convention is compressed-tensors' (`transform/utils/matrix.py`, `apply_transform_weight`): a transform
weight T applied at `weight_output` is W ← Tᵀ·W, at `weight_input` with `inverse` W ← W·T, online at `input`
x ← x·T.
So Q here is the T a compressed-tensors transform_config describes, and `hadamard.hadamard_matrix(n)` is the Q of
its "hadamard" type.

A rotation is the matrix Q or a function x ↦ x·Q along the last dimension (`hadamard.hadamard_transform`: a
Hadamard rotation of a 14336-wide MLP without its 1.6 GB float64 matrix). Each function computes in
`compute_dtype` (float64 by default, as compressed-tensors fuses) and casts back to the weight's dtype once,
in place, so shared (tied) parameters stay shared.
"""

from __future__ import annotations

from typing import Callable, Union

import torch

__all__ = ["Rotation", "fold_norm", "rotate_input", "rotate_output", "rotate_embedding", "rotate_heads_output",
           "rotate_heads_input", "heads_output", "heads_bias", "heads_input"]

Rotation = Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


@torch.no_grad()
def fold_norm(norm_weight: torch.Tensor, weights: list[torch.Tensor], offset: float = 0.0,
              compute_dtype: torch.dtype = torch.float64) -> None:
    """In place: each Linear weight [out, in] reading the norm's output ← W·diag(offset + g); the norm's weight
    then computes x̂·1 (g = 1 - offset: 1 for Llama's x̂·g, 0 for Gemma's x̂·(1 + g)). The float function is
    unchanged, and the norm is now a plain RMS normalisation, which a rotation commutes with."""
    scale = norm_weight.to(compute_dtype) + offset
    for weight in weights:
        _by_rows(weight, lambda rows: rows * scale.to(weight.device), compute_dtype)
    norm_weight.fill_(1.0 - offset)


@torch.no_grad()
def rotate_input(weight: torch.Tensor, rotation: Rotation, compute_dtype: torch.dtype = torch.float64) -> None:
    """In place: W [out, in] ← W·Q, the Linear reading the rotated input x·Q computes what it computed on x."""
    _by_rows(weight, lambda rows: _right(rows, rotation), compute_dtype)


@torch.no_grad()
def rotate_output(weight: torch.Tensor, rotation: Rotation, bias: torch.Tensor | None = None,
                  compute_dtype: torch.dtype = torch.float64) -> None:
    """In place: W [out, in] ← Qᵀ·W and b ← b·Q, the Linear's output y becomes y·Q."""
    _by_rows(weight.T, lambda columns: _right(columns, rotation), compute_dtype)
    if bias is not None:
        _assign(bias, _right(bias.to(compute_dtype), rotation))


@torch.no_grad()
def rotate_embedding(weight: torch.Tensor, rotation: Rotation, compute_dtype: torch.dtype = torch.float64) -> None:
    """In place: E [vocab, hidden] ← E·Q, each token's embedding rotated into the stream."""
    _by_rows(weight, lambda rows: _right(rows, rotation), compute_dtype)


@torch.no_grad()
def rotate_heads_output(weight: torch.Tensor, rotation: Rotation, head_dim: int, bias: torch.Tensor | None = None,
                        compute_dtype: torch.dtype = torch.float64) -> None:
    """In place: the same Q [head_dim, head_dim] on each head's rows of W [heads·head_dim, in] (v_proj, R2): each
    head's value vector v becomes v·Q. With grouped-query attention `heads` are the key-value heads; every query
    head reads one of them, so its attention output, a mix of rotated values, is rotated by the same Q."""
    _assign(weight, heads_output(weight.to(compute_dtype), rotation, head_dim))
    if bias is not None:
        _assign(bias, heads_bias(bias.to(compute_dtype), rotation, head_dim))


@torch.no_grad()
def rotate_heads_input(weight: torch.Tensor, rotation: Rotation, head_dim: int,
                       compute_dtype: torch.dtype = torch.float64) -> None:
    """In place: the same Q on each head's columns of W [out, heads·head_dim] (o_proj, R2, `heads` the query
    heads): it reads each head's attention output o·Q and computes what it computed on o."""
    _assign(weight, heads_input(weight.to(compute_dtype), rotation, head_dim))


def heads_output(weight: torch.Tensor, rotation: Rotation, head_dim: int) -> torch.Tensor:
    """`rotate_heads_output`'s result as a new tensor, differentiable in `rotation` (a matrix): learned rotations
    (`calibration.learned_rotations`) compute with it."""
    rows = weight.unflatten(0, (-1, head_dim))  # [heads, head_dim, in]
    return _right(rows.transpose(1, 2), rotation).transpose(1, 2).flatten(0, 1)


def heads_bias(bias: torch.Tensor, rotation: Rotation, head_dim: int) -> torch.Tensor:
    """`rotate_heads_output`'s bias as a new tensor: each head's slice b·Q."""
    return _right(bias.unflatten(0, (-1, head_dim)), rotation).flatten()


def heads_input(weight: torch.Tensor, rotation: Rotation, head_dim: int) -> torch.Tensor:
    """`rotate_heads_input`'s result as a new tensor, differentiable in `rotation` (a matrix)."""
    return _right(weight.unflatten(1, (-1, head_dim)), rotation).flatten(1)  # [out, heads, head_dim] · Q


def _right(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """x·Q along the last dimension."""
    if isinstance(rotation, torch.Tensor):
        return x @ rotation.to(device=x.device, dtype=x.dtype)
    return rotation(x)


CHUNK_ROWS = 1024  # rows computed at once: float64 copies of a 128k-token embedding whole would take 12 GB


def _by_rows(target: torch.Tensor, function: Callable[[torch.Tensor], torch.Tensor], compute_dtype: torch.dtype) -> None:
    """In place, CHUNK_ROWS rows at a time (each row's result depends on that row alone): target ← function(target),
    computed in `compute_dtype`, so what a rotation holds beside the weight is a few float64 copies of 1024 rows."""
    for start in range(0, target.shape[0], CHUNK_ROWS):
        rows = target[start:start + CHUNK_ROWS]
        _assign(rows, function(rows.to(compute_dtype)))


def _assign(target: torch.Tensor, value: torch.Tensor) -> None:
    target.copy_(value.to(target.dtype))
