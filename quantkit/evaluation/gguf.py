"""A GGUF file measured in llama.cpp (`quantkit eval MODEL.gguf`), through llama-cpp-python, the optional extra
`pip install 'quantkit-llm[gguf]'`.

The windows are quantkit's (`evaluate.plan_windows`); the loss is the same float32 cross-entropy of the scored tokens
(`nll.IGNORE_INDEX` aside), from llama.cpp's logits instead of transformers'. Which token ids llama.cpp is fed is
`choose_ids`'s decision: the ids the Hugging Face rows are scored on, where llama.cpp's vocabulary reads them back as
the text, so every row scores the same windows; llama.cpp's own tokenization only where it cannot.

This is GGUF's engine (`export.gguf_reader.ENGINE`): evaluation reaches it through the registry (`check_options`,
`positions`, `measure`), never by the format's name. Nothing here imports torch or llama_cpp at module level: the CLI
checks a .gguf path before either loads.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from quantkit.errors import HardwareError, SourceModelError, UsageError
from quantkit.export import gguf_reader
from quantkit.export.gguf_reader import MAGIC  # the first four bytes of every GGUF file
from quantkit.runtime.progress import QUIET, Progress

INSTALL_HINT = "pip install 'quantkit-llm[gguf]'"


def check_gguf_file(path: str | Path) -> Path:
    """A readable GGUF file, or SourceModelError saying what it is instead."""
    path = Path(path)
    if not path.exists():
        raise SourceModelError(f"{path} does not exist; pass a .gguf file or a Hugging Face model directory")
    if not path.is_file():
        raise SourceModelError(f"{path} is a directory; a .gguf model is one file (a Hugging Face model directory is named without .gguf)")
    with open(path, "rb") as fh:
        magic = fh.read(len(MAGIC))
    if magic != MAGIC:
        raise SourceModelError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes); "
                               "write one with `quantkit finalize SRC OUT.gguf`, or pass a Hugging Face model directory")
    return path


def require_llama_cpp() -> Any:
    """The llama_cpp module, or HardwareError (exit 2) naming the extra to install."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise HardwareError(f"evaluating a .gguf file needs llama-cpp-python ({exc.name or exc} is missing): {INSTALL_HINT}") from exc
    return llama_cpp


def runtime_name() -> str:
    """How GGUF rows ran: `llama.cpp (llama-cpp-python 0.3.36)`."""
    return f"llama.cpp (llama-cpp-python {require_llama_cpp().__version__})"


def gpu_offload_supported() -> bool:
    return bool(require_llama_cpp().llama_supports_gpu_offload())


# ---------------------------------------------------------------- which ids llama.cpp is fed


@dataclass
class ChosenIds:
    ids: list[int]
    note: str | None  # why these ids, where the table should say it; None when llama.cpp's own tokenizer agrees


def choose_ids(vocab, text: str, reference: Sequence[int] | None, reference_name: str = "the reference tokenizer") -> ChosenIds:
    """The ids to score a GGUF model on. `vocab` is a llama_cpp.Llama (`vocab_only` will do); `reference` the ids the
    Hugging Face rows are scored on (None without such rows).

    - llama.cpp's own ids, when they equal `reference` or there is none;
    - else `reference`, when llama.cpp's vocabulary reads those ids back as the text (the same vocabulary, split
      differently by llama.cpp's tokenizer): the same windows as the other rows, and a note saying so;
    - else llama.cpp's own ids (another vocabulary), and a note: the windows differ from the other rows'.
    """
    own = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True)  # special: as HF's tokenizers parse them
    if reference is None:
        return ChosenIds(own, None)
    reference = list(reference)
    if own == reference:
        return ChosenIds(own, None)
    counts = f"{len(own):,} tokens, {reference_name}: {len(reference):,}"
    if reads_back(vocab, reference, text):
        at = next((i for i, (a, b) in enumerate(zip(own, reference)) if a != b), min(len(own), len(reference)))
        return ChosenIds(reference, f"llama.cpp's own tokenizer splits the text differently ({counts}; first at token {at:,}); "
                                    f"scored on {reference_name}'s ids, like the other rows")
    return ChosenIds(own, f"tokenized by llama.cpp ({counts}): its vocabulary does not read {reference_name}'s ids "
                          "back as the text")


def reads_back(vocab, ids: Sequence[int], text: str) -> bool:
    """llama.cpp's vocabulary turns `ids` back into `text` (a SentencePiece prefix space aside)."""
    if not ids or min(ids) < 0 or max(ids) >= vocab.n_vocab():
        return False
    decoded = vocab.detokenize(list(ids), special=True)
    expected = text.encode("utf-8")
    return decoded == expected or decoded.removeprefix(b" ") == expected.removeprefix(b" ")


# ---------------------------------------------------------------- the model and its loss


@dataclass
class GgufInfo:
    context_length: int | None  # llama.cpp's n_ctx_train: windows are clipped to it
    file_type: str | None  # e.g. Q8_0, from general.file_type
    recipe: str | None  # quantkit.recipe, where quantkit wrote the file


def open_vocab(path: Path):
    """The GGUF's tokenizer and metadata without its weights."""
    return _llama(path, vocab_only=True)


def read_info(vocab) -> GgufInfo:
    meta = vocab.metadata
    length = meta.get(f"{meta.get('general.architecture')}.context_length")
    return GgufInfo(int(length) if length else None, file_type_name(meta.get("general.file_type")), meta.get("quantkit.recipe"))


def file_type_name(value: str | int | None) -> str | None:
    """llama.cpp's name of a `general.file_type` (7 -> Q8_0, 1 -> F16), or the number where it has none."""
    if value is None:
        return None
    llama_cpp = require_llama_cpp()
    names = {getattr(llama_cpp, name): name.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_")
             for name in dir(llama_cpp) if name.startswith("LLAMA_FTYPE_")}
    return names.get(int(value), str(value))


def open_model(path: Path, n_ctx: int, threads: int, device: str = "cpu"):
    """The model with a context of `n_ctx` tokens that keeps every position's logits (`Llama.scores`), on the CPU,
    or with every layer on the GPU of `device` (cuda, cuda:N) where this llama.cpp build has GPU support."""
    placed: dict[str, Any] = {}
    if device.startswith("cuda") and gpu_offload_supported():
        llama_cpp = require_llama_cpp()
        index = int(device.partition(":")[2] or 0)
        placed = dict(n_gpu_layers=-1, main_gpu=index, split_mode=llama_cpp.LLAMA_SPLIT_MODE_NONE)
    return _llama(path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(n_ctx, 512), logits_all=True, n_threads=threads,
                  n_threads_batch=threads, **placed)


def _llama(path: Path, **kwargs):
    """llama_cpp.Llama on `path`, its log kept off the terminal (verbose=False still prints llama.cpp's errors, and a
    vocabulary-only load logs one about its context); the last line of it is the reason a load failed."""
    llama_cpp = require_llama_cpp()
    with contextlib.redirect_stderr(io.StringIO()) as log:  # llama-cpp-python's log callback prints to sys.stderr
        try:
            return llama_cpp.Llama(model_path=str(path), verbose=False, **kwargs)
        except ValueError as exc:  # "Failed to load model from file"
            reason = (log.getvalue().strip().splitlines() or [str(exc)])[-1]
            raise SourceModelError(f"{path}: llama.cpp cannot load this GGUF file ({reason}); write it again, or upgrade "
                                   f"llama-cpp-python ({INSTALL_HINT} --upgrade)") from exc


def window_nll(model, tokens: Sequence[int], first_target: int, rows: int, observe=None) -> tuple[float, int]:
    """Summed NLL of tokens[first_target:] (each predicted by the position before it) and how many: one fresh
    decode of `tokens`, then float32 cross-entropy `rows` positions at a time, as `nll.chunked_nll` sums it (and
    hands each chunk's logits to `observe`, where given)."""
    import torch

    from quantkit.evaluation.nll import decoded_nll

    model.reset()  # a fresh sequence: llama.cpp drops the cache past position 0 on the next eval
    model.eval(list(tokens))
    logits = torch.from_numpy(model.scores[: len(tokens) - 1])  # a view: llama.cpp's float32 logits
    return decoded_nll(logits, tokens, first_target, rows, observe)


def check_options(models: Sequence[str], tp: int = 1, max_acc_drop: float | None = None, device: str = "auto") -> None:
    """The .gguf files among `models` checked, and what they cannot be evaluated with refused, before anything loads:
    `--tp` (transformers' sharding), `--max-acc-drop` (lm-eval scores transformers models only), a `--device cuda`
    that this llama.cpp build cannot use; and llama-cpp-python installed."""
    files = [model for model in models if gguf_reader.detect(Path(model))]
    if not files:
        return
    for file in files:
        check_gguf_file(file)
    if tp > 1:
        raise UsageError(gguf_reader.unsharded(files[0]))
    if max_acc_drop is not None:
        raise UsageError(f"--max-acc-drop gates --tasks scores, and {files[0]} has none (lm-eval scores transformers models); "
                         "gate it with --max-ppl-increase")
    require_llama_cpp()
    if device.startswith("cuda") and not gpu_offload_supported():
        raise HardwareError(f"--device {device}: this llama-cpp-python has no GPU support, so {files[0]} cannot run there; "
                            "reinstall it built for CUDA (CMAKE_ARGS=-DGGML_CUDA=on pip install --force-reinstall --no-cache-dir "
                            "llama-cpp-python), or pass --device auto (the .gguf files then run on the CPU)")


# ---------------------------------------------------------------- measured on quantkit's windows


def positions(path: str | Path) -> tuple[int | None, str]:
    """(the longest window the model takes, where that is recorded), from the GGUF's metadata without its weights."""
    return read_info(open_vocab(check_gguf_file(path))).context_length, "context_length in the GGUF"


def measure(label: str, texts: list[str], reference: tuple[list[int], str] | None, seq_len: int = 512,
            stride: int | None = None, max_samples: int | None = None, threads: int = 1, device: str = "cpu",
            progress: Progress = QUIET, logits=None, **_):
    """A .gguf file's perplexity in llama.cpp, on the windows the Hugging Face rows are scored on where its vocabulary
    allows (`choose_ids`), clipped to its context length; one window at a time (--batch-size does not apply): an
    `evaluate.ModelReport`. The scored positions' logits go to `logits` too (a `divergence.Observer`), where given."""
    from functools import partial

    import torch

    from quantkit.evaluation.evaluate import ModelReport, plan_windows, score_windows
    from quantkit.evaluation.nll import LOGITS_CHUNK_BYTES
    from quantkit.finalization.preflight import peak_resident_bytes

    path = check_gguf_file(label)
    chosen, info = _ids(path, texts, reference)
    ids = torch.tensor(chosen.ids, dtype=torch.long)
    seq_len, windows = plan_windows(ids.numel(), seq_len, stride, max_samples, info.context_length)
    model = open_model(path, seq_len, threads, device)
    rows = max(1, LOGITS_CHUNK_BYTES // (4 * model.n_vocab()))
    with torch.inference_mode():
        result = score_windows(partial(windows_nll, model, rows), ids, windows, seq_len, progress=progress, logits=logits)
    fmt = f"gguf {info.file_type}" if info.file_type else "gguf"
    return ModelReport(path=str(path), label=label, recipe=info.recipe, format=fmt, size_bytes=path.stat().st_size,
                       perplexity=result, peak_rss_per_rank=[peak_resident_bytes()], runtime=runtime_name(),
                       tokens_note=chosen.note)


def _ids(path: Path, texts: list[str], reference: tuple[list[int], str] | None) -> tuple[ChosenIds, GgufInfo]:
    """The ids to feed the GGUF model and its metadata, from its vocabulary alone (freed on return)."""
    from quantkit.data import joined_text

    vocab = open_vocab(path)
    return choose_ids(vocab, joined_text(texts), *(reference or (None,))), read_info(vocab)


def windows_nll(model, rows: int, inputs, labels, observe=None) -> tuple[float, int]:
    """`nll.NllFunction` over a llama.cpp model: each window (a row of `inputs` [B, L]) decoded alone, its loss from
    `window_nll` (`labels`' IGNORE_INDEX before each window's first target)."""
    from quantkit.evaluation.nll import decoded_windows_nll

    return decoded_windows_nll(window_nll, model, rows, inputs, labels, observe)
