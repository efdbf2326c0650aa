"""`eval --kl-divergence`: how far each model's next-token distributions are from the first model's (the reference),
on the tokens its perplexity is scored on.

The design, for memory: models are measured one after another (one model loaded at a time), so the reference's
logits must outlive it. Every scoring path (transformers' lm_head a chunk at a time, its full logits, llama.cpp's
`scores`) hands the float32 logits of the scored positions to an observer, in the same order whatever the chunking
(window by window, position by position). The reference's observer (`Recording`) appends them to one float32 file in
a temporary directory (TMPDIR; under --tp, each rank its own), [scored tokens, vocab]: nothing of it stays in memory,
and its size (4 bytes x tokens x vocab, refused up front where the disk cannot hold it) is what `--max-samples`
bounds. Each later model's observer (`Divergence`) reads the same rows back from a memory map, a chunk at a time, on
the model's device, and keeps what it needs of each token (its KL divergence; whether the argmaxes agree). float32,
not float16: a float16 log-probability's rounding (up to 5e-4 near the top token) is of the order of an 8-bit
model's whole divergence, and a model compared with itself must give exactly 0.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quantkit.errors import UsageError

ROW_DTYPE = np.float32  # the reference's logits on disk


@dataclass
class DivergenceResult:
    reference: str  # the model compared against: the first MODEL
    mean: float  # KL(P_reference || P_model) per scored token, natural log (nats)
    median: float
    p99: float  # the 99th percentile over the scored tokens
    top1_agreement: float  # fraction of scored tokens whose most likely next token is the reference's
    perplexity_ratio: float  # this model's perplexity / the reference's
    tokens: int  # scored tokens compared


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(P_ref || P) in nats, argmax agreement) per position of two [positions, vocab] logits tensors, P = softmax:
    sum over the vocabulary of p_ref * (log p_ref - log p), computed in float32; a token the reference gives no
    probability adds nothing (a -inf logit)."""
    if reference_logits.shape != logits.shape:
        raise ValueError(f"logits of shape {tuple(logits.shape)} against the reference's {tuple(reference_logits.shape)}")
    reference = torch.log_softmax(reference_logits.float(), dim=-1)
    model = torch.log_softmax(logits.float(), dim=-1)
    p = reference.exp()
    terms = torch.where(p > 0, p * (reference - model), torch.zeros_like(p))
    kld = terms.sum(-1).clamp_min(0.0)  # float rounding can leave a sum of near-equal distributions at -1e-9
    return kld, reference_logits.argmax(-1) == logits.argmax(-1)


class Observer:
    """What a scoring path hands the scored positions' logits to: `start` once (the windows' digest, how many
    positions they score), then each chunk of float32 logits [n, vocab], in order."""

    def start(self, digest: str, rows: int) -> None:
        raise NotImplementedError

    def __call__(self, logits: torch.Tensor) -> None:
        raise NotImplementedError


class Comparison:
    """One eval's --kl-divergence: the first row measured is the reference (`observer` gives it a `Recording`), each
    later one a `Divergence` from it. A context manager: its temporary directory goes on leaving; `results` after.
    Not `enabled` (no --kl-divergence), it observes nothing and every row's result is None."""

    def __init__(self, enabled: bool = True, directory: str | Path | None = None) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="quantkit-kld-", dir=directory) if enabled else None
        self.reference: Recording | None = None
        self.divergences: list[Divergence] = []

    def __enter__(self) -> Comparison:
        return self

    def __exit__(self, *exc) -> None:
        if self._directory is not None:
            self._directory.cleanup()

    def observer(self, label: str) -> Recording | Divergence | None:
        """The observer of the row labelled `label`: the reference's recording for the first, a divergence from it
        for every later one."""
        if self._directory is None:
            return None
        if self.reference is None:
            self.reference = Recording(label, Path(self._directory.name) / "reference-logits.f32")
            return self.reference
        self.divergences.append(Divergence(self.reference, label))
        return self.divergences[-1]

    def results(self, perplexities: list[float]) -> list[DivergenceResult | None]:
        """Each row's divergence, in the order the observers were given (None for the reference), from the rows'
        perplexities in that order."""
        if self.reference is None:
            return [None] * len(perplexities)
        reference = perplexities[0]
        return [None] + [found.summary(perplexity / reference) for found, perplexity in zip(self.divergences, perplexities[1:])]


class Recording(Observer):
    """The reference's logits, appended row by row to `path` (float32 [rows, vocab])."""

    def __init__(self, label: str, path: Path) -> None:
        self.label, self.path = label, path
        self.digest, self.rows, self.vocab = "", 0, 0

    def start(self, digest: str, rows: int) -> None:
        self.digest, self.rows = digest, rows
        self.path.write_bytes(b"")

    def __call__(self, logits: torch.Tensor) -> None:
        if not self.vocab:
            self.vocab = logits.shape[-1]
            check_space(self.label, self.rows, self.vocab, self.path.parent)
        with open(self.path, "ab") as fh:
            fh.write(logits.detach().to("cpu", torch.float32).numpy().astype(ROW_DTYPE, copy=False).tobytes())

    def read(self, start: int, count: int) -> torch.Tensor:
        """Rows start .. start + count of the recorded logits."""
        table = np.memmap(self.path, dtype=ROW_DTYPE, mode="r", shape=(self.rows, self.vocab))
        return torch.from_numpy(np.array(table[start:start + count]))


class Divergence(Observer):
    """A model's per-token KL divergence from the reference and argmax agreement, chunk by chunk."""

    def __init__(self, reference: Recording, label: str) -> None:
        self.reference, self.label = reference, label
        self.position = 0
        self.klds: list[torch.Tensor] = []
        self.agreed = 0

    def start(self, digest: str, rows: int) -> None:
        if digest != self.reference.digest:
            raise UsageError(f"{self.label} is scored on other tokens than {self.reference.label} (another tokenizer, or a "
                             "shorter context): KL divergence compares next-token distributions at the same positions; "
                             "compare models that share the reference's tokenizer, at a --seq-len that every model takes")

    def __call__(self, logits: torch.Tensor) -> None:
        if logits.shape[-1] != self.reference.vocab:
            raise UsageError(f"{self.label}'s logits span {logits.shape[-1]:,} tokens and {self.reference.label}'s "
                             f"{self.reference.vocab:,}: KL divergence compares distributions over one vocabulary")
        reference = self.reference.read(self.position, logits.shape[0]).to(logits.device)
        kld, agree = kl_divergence(reference, logits)
        self.klds.append(kld.cpu())
        self.agreed += int(agree.sum())
        self.position += logits.shape[0]

    def summary(self, perplexity_ratio: float) -> DivergenceResult:
        klds = torch.cat(self.klds).double().numpy() if self.klds else np.full(1, np.nan)
        return DivergenceResult(
            reference=self.reference.label, mean=float(klds.mean()), median=float(np.median(klds)),
            p99=float(np.percentile(klds, 99)), top1_agreement=self.agreed / max(1, self.position),
            perplexity_ratio=perplexity_ratio, tokens=self.position,
        )


def check_space(label: str, rows: int, vocab: int, directory: Path) -> None:
    """Refuse, before the reference's first window is written, a recording its file system cannot hold."""
    needed = rows * vocab * np.dtype(ROW_DTYPE).itemsize
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise UsageError(f"--kl-divergence keeps {label}'s logits of {rows:,} scored tokens x {vocab:,} ({needed / 1e9:.1f} GB) "
                         f"in {directory.parent}, which has {free / 1e9:.1f} GB free; pass --max-samples N (fewer windows), "
                         "or set TMPDIR to a larger disk")
