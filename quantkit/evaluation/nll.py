"""The summed negative log-likelihood of a batch of windows without its full logits.

The base model computes the hidden states; lm_head (with the scaling or soft-capping the model's forward applies
after it) then turns the scored positions into logits a chunk at a time, so the float32 logits held at once stay
under LOGITS_CHUNK_BYTES whatever the vocabulary: a 128k vocabulary's one 2048-token window is 1 GiB of them.
Whether a model's forward computes exactly that is checked on a few tokens before the first batch
(`nll_function`); a model that does something else after its base model gets its full logits, as it always did.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
LOGITS_CHUNK_BYTES = 64 * 2**20  # float32 logits of one chunk: 128 positions of a 128k vocabulary
PROBE_TOKENS = 8  # tokens on which the chunked logits are compared with the model's own

Observe = Callable[[torch.Tensor], None]  # takes each chunk of the scored positions' float32 logits, in order
NllFunction = Callable[..., tuple[float, int]]  # (inputs [B, L], labels [B, L], observe=None) -> (summed NLL, count)


def nll_function(model, probe_ids: torch.Tensor) -> NllFunction:
    """(inputs [B, L], labels [B, L]) -> (summed NLL, scored tokens): by chunks of lm_head's output where the
    model's logits are its base model's hidden states through `logit_head` (compared on the first PROBE_TOKENS of
    `probe_ids`, a 1-D token stream on the model's device), else from the model's full logits."""
    head = logit_head(model)
    if head is None:
        return partial(full_logits_nll, model)
    ids = probe_ids[:PROBE_TOKENS][None]
    expected = model(input_ids=ids, use_cache=False).logits[:, :-1].flatten(0, 1)
    rows = max(1, LOGITS_CHUNK_BYTES // (4 * expected.shape[-1]))
    got = torch.cat([logits for logits, _ in _logit_chunks(model.base_model, head, ids, ids, rows)])
    if not _same_logits(got, expected):
        return partial(full_logits_nll, model)
    return partial(chunked_nll, model.base_model, head, rows)


def _same_logits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """The chunked logits (float32) are the model's own up to rounding: a GEMM of another shape may round a 16-bit
    logit the other way (a few units of its last place), where a missing scaling or soft-cap changes it entirely."""
    tolerance = max(1e-3, 4 * torch.finfo(expected.dtype).eps)
    expected = expected.float()
    scale = max(1.0, float(expected.abs().max()))
    return got.shape == expected.shape and torch.allclose(got, expected, rtol=tolerance, atol=tolerance * scale)


def logit_head(model) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Hidden states -> logits as a transformers causal LM's forward computes them after its base model: lm_head,
    then Gemma 2 / 3's `final_logit_softcapping`, Granite's division by `logits_scaling`, Cohere's `logit_scale`.
    None where the model has no base model and lm_head of its own (a wrapped model)."""
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if lm_head is None or getattr(model, "base_model", model) is model:
        return None
    cap = getattr(model.config, "final_logit_softcapping", None)
    divisor = getattr(model.config, "logits_scaling", None)
    factor = getattr(model, "logit_scale", None)

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = lm_head(hidden)
        if cap is not None:  # the same operations as transformers', in the same order: the same rounding
            logits = torch.tanh(logits / cap) * cap
        if divisor is not None:
            logits = logits / divisor
        if factor is not None:
            logits = logits * factor
        return logits

    return head


def chunked_nll(base, head: Callable, rows: int, inputs: torch.Tensor, labels: torch.Tensor,
                observe: Observe | None = None) -> tuple[float, int]:
    """Summed NLL of the labelled tokens (position t predicts token t + 1) and how many there are, from `rows`
    positions' logits at a time (each chunk handed to `observe` too); the sum is accumulated in float32."""
    total, count = None, 0
    for logits, targets in _logit_chunks(base, head, inputs, labels, rows):
        if observe is not None:
            observe(logits)
        nll = F.cross_entropy(logits, targets, reduction="sum")
        total, count = nll if total is None else total + nll, count + targets.numel()
    return (0.0 if total is None else total.item()), count


def full_logits_nll(model, inputs: torch.Tensor, labels: torch.Tensor, observe: Observe | None = None) -> tuple[float, int]:
    """`chunked_nll` from the model's own logits, all of them at once (float32 [B, L, vocab])."""
    logits = model(input_ids=inputs, use_cache=False).logits[:, :-1].float()
    targets = labels[:, 1:]
    if observe is not None:
        observe(logits[targets != IGNORE_INDEX])  # the scored positions, window by window, as `_logit_chunks` gives them
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return nll.item(), int((targets != IGNORE_INDEX).sum())


def _logit_chunks(base, head: Callable, inputs: torch.Tensor, labels: torch.Tensor,
                  rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(float32 logits [n, vocab], targets [n]) of the labelled positions, at most `rows` of them at a time: only
    the scored positions reach lm_head (a strided window's context does not), as one sequence [1, n, hidden], the
    shape the model's forward gives it (a per-token activation quantizer reads a 2-D input otherwise)."""
    output = base(input_ids=inputs, use_cache=False)
    hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
    targets = labels[:, 1:]
    scored = targets != IGNORE_INDEX
    hidden, targets = hidden[:, :-1][scored], targets[scored]
    for start in range(0, targets.numel(), rows):
        yield head(hidden[None, start:start + rows])[0].float(), targets[start:start + rows]


def decoded_nll(logits, tokens: Sequence[int], first_target: int, rows: int, observe=None) -> tuple[float, int]:
    """Summed float32 NLL of tokens[first_target:] (each predicted by the position before it) and how many, from
    one decode's logits of `tokens` [at least len(tokens) - 1, vocab] (an engine's: llama.cpp, mlx-lm), `rows`
    positions at a time as `chunked_nll` sums them, each chunk's logits handed to `observe` where given."""
    logits = logits[: len(tokens) - 1]
    targets = torch.tensor(tokens[1:], dtype=torch.long)
    total = None
    for start in range(first_target - 1, len(tokens) - 1, rows):
        end = min(start + rows, len(tokens) - 1)
        if observe is not None:
            observe(logits[start:end])
        nll = F.cross_entropy(logits[start:end], targets[start:end], reduction="sum")
        total = nll if total is None else total + nll
    return (0.0 if total is None else total.item()), len(tokens) - first_target


def decoded_windows_nll(window_nll: Callable, engine, rows: int, inputs, labels, observe=None) -> tuple[float, int]:
    """`NllFunction` over an engine that decodes one sequence at a time (llama.cpp, mlx-lm): each window (a row of
    `inputs` [B, L]) through `window_nll(engine, tokens, first_target, rows, observe)`, the first target after
    `labels`' IGNORE_INDEX."""
    total, count = 0.0, 0
    for tokens, targets in zip(inputs.tolist(), labels):
        first_target = int((targets != IGNORE_INDEX).nonzero()[0])
        nll, scored = window_nll(engine, tokens, first_target, rows, observe)
        total, count = total + nll, count + scored
    return total, count

