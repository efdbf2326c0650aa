"""Dataset specs to token ids: local .txt/.jsonl/.parquet files or `datasets` hub specs, plus the windows
and blocks that evaluation and calibration cut from the token stream.

User content is only ever parsed as text, JSON or parquet: no pickle, no remote code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from quantkit.errors import DataError, UsageError

LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
DEFAULT_SPLIT = "test"
_SPEC_HINT = "pass a .txt/.jsonl/.parquet file or a datasets spec like wikitext:wikitext-2-raw-v1:test"
SNIFFED_CHARS = 65536  # the text check reads this many characters from the start of the data, whatever its size
NOT_TEXT_SHARE = 0.1  # more characters than this that are not printable text: the data is not text
# Control characters other than whitespace (Unicode's Cc) and U+FFFD, what a byte that is not UTF-8 decodes to
_NOT_PRINTABLE = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f\ufffd]")


class NoTextFieldError(DataError):
    """The data has no field (or column) of the name asked for; `load_texts` ends the message with the caller's
    advice on naming another."""


def load_texts(spec: str, text_field: str = "text", default_split: str = DEFAULT_SPLIT,
               field_advice: str | None = None) -> list[str]:
    """The documents named by `spec`: a local file if it exists or has a data suffix, else a `datasets` spec
    `name[:config][:split]` (split defaults to `default_split`: "test", or "train" for training data); `name` may
    be a hub name or a local dataset directory. Data without `text_field` is refused naming the fields it has, then
    `field_advice`: how the caller's user names another field (e.g. "pass --text-field NAME"); without it, to put
    the text under `text_field`."""
    try:
        texts = _read_texts(spec, text_field, default_split)
    except NoTextFieldError as exc:
        raise NoTextFieldError(f"{exc}; {field_advice or f'put the text under {text_field!r}'}") from None
    if not any(texts):
        raise DataError(f"{spec} has no text (every '{text_field}' value is empty)")
    check_text(texts, spec)
    return texts


def _read_texts(spec: str, text_field: str, default_split: str) -> list[str]:
    if Path(spec.split(":", 1)[0]).is_dir():  # a local dataset directory, loaded by `datasets` like a hub name
        return _load_datasets(spec, text_field, default_split)
    if Path(spec).exists() or Path(spec).suffix.lower() in LOCAL_SUFFIXES:
        return _load_local(Path(spec), text_field)
    return _load_datasets(spec, text_field, default_split)


def check_text(texts: list[str], where: str) -> None:
    """Refuse data that is not text (random bytes, a binary file named .txt, another encoding than UTF-8): more than
    NOT_TEXT_SHARE of its first SNIFFED_CHARS characters are control characters or bytes UTF-8 cannot decode.
    Text in any script passes; a few stray bytes (a Latin-1 accent) do too."""
    sample = _first_chars(texts, SNIFFED_CHARS)
    share = len(_NOT_PRINTABLE.findall(sample)) / max(1, len(sample))
    if share > NOT_TEXT_SHARE:
        raise DataError(f"{where} is not text: {share:.0%} of its first {len(sample):,} characters are control characters "
                        "or bytes that are not UTF-8; pass UTF-8 text (a .txt file, or a .jsonl/.parquet text field)")


def _first_chars(texts: list[str], count: int) -> str:
    sample, size = [], 0
    for text in texts:
        if size >= count:
            break
        sample.append(text[: count - size])
        size += len(sample[-1])
    return "".join(sample)


def _load_local(path: Path, text_field: str) -> list[str]:
    if not path.exists():
        raise DataError(f"{path} does not exist; {_SPEC_HINT}")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return [path.read_text(encoding="utf-8", errors="replace")]
    if suffix in (".jsonl", ".json"):
        return _read_json_lines(path, text_field)
    if suffix == ".parquet":
        return _read_parquet(path, text_field)
    raise DataError(f"{path}: unknown file type '{suffix}'; {_SPEC_HINT}")


def _read_json_lines(path: Path, text_field: str) -> list[str]:
    """One JSON object per line; blank lines are skipped. Errors name the line number."""
    texts = []
    with open(path, encoding="utf-8", errors="replace") as fh:  # bytes that are not UTF-8: the text check judges them
        for number, line in enumerate(fh, start=1):
            if line.strip():
                texts.append(_field_of(_parse_json_line(line, path, number), text_field, f"{path}:{number}"))
    return texts


def _parse_json_line(line: str, path: Path, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{number} is not valid JSON ({exc.msg}); each line must be one JSON object") from exc
    if not isinstance(record, dict):
        raise DataError(f"{path}:{number} is a JSON {type(record).__name__}, not an object; write one JSON object per line")
    return record


def _field_of(record: dict, text_field: str, where: str) -> str:
    if text_field not in record:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise NoTextFieldError(f"{where} has no field '{text_field}' (fields: {keys})")
    value = record[text_field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{text_field}' is a {type(value).__name__}, not a string")
    return value


def _read_parquet(path: Path, text_field: str) -> list[str]:
    import datasets

    try:
        table = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as exc:  # a corrupt file surfaces as many arrow/datasets error types
        raise DataError(f"{path}: cannot read parquet ({_first_line(exc)})") from exc
    return _column_of(table, text_field, str(path))


def _column_of(table, text_field: str, where: str) -> list[str]:
    if text_field not in table.column_names:
        columns = ", ".join(table.column_names) or "none"
        raise NoTextFieldError(f"{where} has no column '{text_field}' (columns: {columns})")
    return [value or "" for value in table[text_field]]


def parse_hub_spec(spec: str, default_split: str = DEFAULT_SPLIT) -> tuple[str, str | None, str]:
    """`name[:config][:split]` -> (name, config, split)."""
    parts = spec.split(":")
    if len(parts) > 3 or not all(parts):
        raise DataError(f"'{spec}' is not a file or a datasets spec; {_SPEC_HINT}")
    name, config, split = (parts + [None, None])[:3]
    return name, config, split or default_split


def _load_datasets(spec: str, text_field: str, default_split: str) -> list[str]:
    import datasets

    name, config, split = parse_hub_spec(spec, default_split)
    try:
        table = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # offline, unknown name, bad config/split: all reported the same way
        raise DataError(
            f"cannot load datasets spec '{spec}' ({_first_line(exc)}); "
            f"without network access, pass a local .txt/.jsonl/.parquet file"
        ) from exc
    return _column_of(table, text_field, spec)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def joined_text(texts: list[str]) -> str:
    """The texts as one evaluation text: joined with blank lines."""
    return "\n\n".join(texts)


def tokenize(tokenizer, texts: list[str]) -> torch.Tensor:
    """The texts joined with blank lines (`joined_text`), encoded without special tokens: a 1-D LongTensor."""
    ids = tokenizer(joined_text(texts), add_special_tokens=False)["input_ids"]
    if not ids:
        raise DataError("the dataset gives no tokens; pass data with text in it")
    return torch.tensor(ids, dtype=torch.long)


def eval_windows(
    num_tokens: int, seq_len: int, stride: int | None = None, max_samples: int | None = None
) -> list[tuple[int, int, int]]:
    """Strided-perplexity windows (begin, end, target_begin): tokens [begin, end) are fed and tokens
    [target_begin, end) are scored. Every token but the first is scored exactly once.

    Each window after the first scores up to `stride` new tokens with `seq_len - stride` tokens of context.
    A scored token needs at least one token before it in its window, so stride == seq_len behaves as
    seq_len - 1 (windows overlap by that one token). `max_samples` keeps only the first windows.
    """
    _check_window_args(num_tokens, seq_len, stride, max_samples)
    context = max(1, seq_len - (stride or seq_len))
    windows = [(0, min(seq_len, num_tokens), 1)]
    while windows[-1][1] < num_tokens and (max_samples is None or len(windows) < max_samples):
        target_begin = windows[-1][1]
        begin = target_begin - context
        windows.append((begin, min(begin + seq_len, num_tokens), target_begin))
    return windows


def _check_window_args(num_tokens: int, seq_len: int, stride: int | None, max_samples: int | None) -> None:
    if seq_len < 2:
        raise DataError(f"seq_len must be at least 2 (got {seq_len})")
    if stride is not None and not 0 < stride <= seq_len:
        raise DataError(f"--stride must be between 1 and --seq-len {seq_len} (got {stride})")
    if max_samples is not None and max_samples < 1:
        raise DataError(f"max_samples must be at least 1 (got {max_samples})")
    if num_tokens < 2:
        raise DataError(f"the dataset gives {num_tokens} token(s); perplexity needs at least 2")


def sample_blocks(ids: torch.Tensor, num_samples: int, seq_len: int, seed: int = 0,
                  source: str = "the calibration data", seq_len_flag: str = "--seq-len") -> torch.Tensor:
    """`num_samples` blocks of `seq_len` tokens at random offsets, [num_samples, seq_len]; the same seed
    gives the same blocks. Refused where `ids` (from `source`, as the message names it) hold fewer than
    num_samples x seq_len + 1 tokens, naming the caller's option for seq_len (`seq_len_flag`)."""
    if num_samples < 1 or seq_len < 1:
        raise DataError(f"num_samples and seq_len must be positive (got {num_samples}, {seq_len})")
    tokens, need = ids.numel(), num_samples * seq_len + 1  # one more: the blocks start at random offsets
    if tokens < need:  # fewer would repeat the same tokens many times over
        most, shorter = (tokens - 1) // seq_len, (tokens - 1) // num_samples
        flag = seq_len_flag
        fewer = (f", or at most --num-samples {most} at this {flag}" if most else
                 f", or at most {flag} {shorter} at this --num-samples" if shorter >= 2 else
                 f", or --num-samples 1 {flag} {tokens - 1}" if tokens >= 3 else "")
        raise DataError(f"{source} gives {tokens} tokens; --num-samples {num_samples} x {flag} {seq_len} needs at "
                        f"least {need}; pass more text{fewer}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (num_samples,), generator=generator)
    return torch.stack([ids[start : start + seq_len] for start in starts.tolist()])


def rank_slice(num_samples: int, rank: int, world_size: int) -> range:
    """This rank's contiguous share of range(num_samples); the first `num_samples % world_size` ranks get one more."""
    if num_samples < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"cannot split {num_samples} samples for rank {rank} of world size {world_size}")
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def rank_batches(num_samples: int, batch_size: int, rank: int, world_size: int) -> list[range]:
    """This rank's calibration batches (sample index ranges). The samples are cut into batches of `batch_size`
    once, as a single process cuts them, and whole batches are shared out (`rank_slice` over batches): every
    batch is then the same tensor whatever the number of ranks, and so are its per-batch statistics. With fewer
    batches than ranks, the samples themselves are shared out, in batches of at most `batch_size`."""
    starts = range(0, num_samples, batch_size)
    if len(starts) >= world_size:
        mine = [starts[i] for i in rank_slice(len(starts), rank, world_size)]
        return [range(start, min(start + batch_size, num_samples)) for start in mine]
    share = rank_slice(num_samples, rank, world_size)
    return [range(i, min(i + batch_size, share.stop)) for i in range(share.start, share.stop, batch_size)]


def pack_blocks(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The token stream cut into full blocks of `seq_len` tokens [n, seq_len] (the remainder is dropped)."""
    count = ids.numel() // seq_len
    if count == 0:
        raise DataError(f"the training data has {ids.numel()} tokens, fewer than one block of data.seq_len={seq_len}")
    return ids[: count * seq_len].view(count, seq_len)


def micro_batches(
    num_samples: int, global_batch: int, micro_batch: int, rank: int, world_size: int, seed: int, step: int
) -> list[list[int]]:
    """The sample indices of each micro-batch of one rank at optimizer step `step`.

    Each epoch is one seeded permutation (DistributedSampler: rank r takes every world_size-th entry), so the
    union over ranks of one step's micro-batches is the same global batch for any world_size.
    """
    from torch.utils.data import DistributedSampler

    steps_per_epoch = num_samples // global_batch
    if steps_per_epoch == 0:
        raise DataError(f"{num_samples} training blocks are fewer than one global batch ({global_batch}); add data or lower train.global_batch_size")
    epoch, position = divmod(step, steps_per_epoch)
    sampler = DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    per_rank = global_batch // world_size
    mine = list(sampler)[position * per_rank : (position + 1) * per_rank]
    return [mine[i : i + micro_batch] for i in range(0, per_rank, micro_batch)]
