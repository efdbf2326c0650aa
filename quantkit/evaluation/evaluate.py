"""Measuring models: strided perplexity, lm-eval task scores (`quantkit.evaluation.tasks`), per-model reports, and the
accuracy gate."""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from quantkit.data import eval_windows, load_texts, tokenize
from quantkit.errors import UsageError
from quantkit.evaluation.artifacts import engine, in_engine, locate
from quantkit.evaluation.divergence import Comparison, DivergenceResult, Observer
from quantkit.evaluation.nll import IGNORE_INDEX, NllFunction, nll_function
from quantkit.evaluation.tasks import TaskOptions, TaskResult, TaskSuite, load_tasks
from quantkit.evaluation.tensor_parallel import check_options as check_tensor_parallel_options
from quantkit.evaluation.tensor_parallel import gather_ints
from quantkit.evaluation.tensor_parallel import load as tensor_parallel_load
from quantkit.export import made_as, metadata, reader_for
from quantkit.finalization.preflight import peak_resident_bytes, reset_peak_resident
from quantkit.models.loading import load_config, load_model, load_tokenizer, max_positions, weights_size
from quantkit.models.sources import resolve_source
from quantkit.runtime.precision import float32_products, model_dtype
from quantkit.runtime.progress import QUIET, Progress

Window = tuple[int, int, int]
DEFAULT_SEQ_LEN = 512  # compare's window when none is asked for, clipped to each model's positions
TEXT_FIELD_ADVICE = "pass --text-field NAME"  # how an eval user names the field of --data that holds the text


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token
    tokens: int  # scored tokens
    seconds: float
    tokens_per_second: float  # tokens fed through the model (context included) per wall second
    seq_len: int = 0  # effective window length, after clipping to the model's max_position_embeddings
    windows_digest: str = ""  # of the token ids and windows scored: rows with equal digests scored the same tokens


@dataclass
class ModelReport:
    path: str
    label: str
    recipe: str | None
    format: str | None
    size_bytes: int | None  # None for an in-memory preview (nothing written)
    perplexity: PerplexityResult
    tasks: dict[str, TaskResult] = field(default_factory=dict)  # by task name; empty without --tasks
    peak_rss_per_rank: list[int] = field(default_factory=list)  # bytes, while this model was loaded and measured
    weight_bytes_per_rank: list[int] = field(default_factory=list)  # parameters and buffers each rank held, as computed
    tensor_parallel: int = 1  # ranks the model was sharded over (`eval --tp`)
    runtime: str = "transformers"  # what computed it: transformers, or the engine its format runs in (llama.cpp)
    tokens_note: str | None = None  # an engine's tokenization, where it is not simply the Hugging Face rows' ids
    kl_divergence: DivergenceResult | None = None  # from the first model's distributions (--kl-divergence); None for it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def effective_seq_len(model, seq_len: int) -> int:
    """`seq_len`, clipped to the model's max_position_embeddings when it has a smaller one."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return min(seq_len, limit) if limit else seq_len


def check_seq_len(models: Sequence[str], seq_len: int, trust_remote_code: bool = False) -> None:
    """A window length asked for, no longer than any model's positions, checked before any weights load: a longer
    one would be clipped, and the model scored on other windows than asked for."""
    for label in models:
        limit, recorded = model_positions(label, trust_remote_code)
        if limit is not None and seq_len > limit:
            raise UsageError(f"--seq-len {seq_len} is beyond {label}'s {limit} positions ({recorded}); use at most {limit}")


def model_positions(label: str, trust_remote_code: bool = False) -> tuple[int | None, str]:
    """(the longest window the model takes, where that is recorded), from its config or, for a model its own engine
    runs, that engine's reading of its metadata, without its weights; None where nothing records a limit."""
    path, reader = locate(label)
    if reader.ENGINE:
        return engine(reader).positions(path)
    return max_positions(load_config(path, trust_remote_code)), "max_position_embeddings"


def plan_windows(num_tokens: int, seq_len: int, stride: int | None = None, max_samples: int | None = None,
                 limit: int | None = None) -> tuple[int, list[Window]]:
    """(effective seq_len, windows): `quantkit.data.eval_windows` with seq_len, and the stride with it, clipped to
    `limit` (the positions the model takes) when that is smaller."""
    clipped = min(seq_len, limit) if limit else seq_len
    if stride is not None and stride <= seq_len:  # a stride valid for the requested length stays valid
        stride = min(stride, clipped)
    return clipped, eval_windows(num_tokens, clipped, stride, max_samples)


def perplexity(
    model,
    ids: torch.Tensor,
    seq_len: int = 512,
    stride: int | None = None,
    batch_size: int = 1,
    max_samples: int | None = None,
    progress: Progress = QUIET,
    logits: Observer | None = None,
) -> PerplexityResult:
    """exp(mean NLL) over `ids` (1-D), scored in the windows of `quantkit.data.eval_windows` (a bf16 / fp16 model's
    Linear products in float32 on a CPU without native ones, `precision.float32_products`), from lm_head's logits a
    chunk of tokens at a time (`nll.nll_function`), each chunk handed to `logits` too where given."""
    if batch_size < 1:
        raise UsageError(f"batch_size must be at least 1 (got {batch_size})")
    if ids.dim() != 1:
        raise UsageError(f"ids must be a 1-D token stream (got shape {tuple(ids.shape)})")
    seq_len, windows = plan_windows(ids.numel(), seq_len, stride, max_samples, effective_seq_len(model, seq_len))
    device = next(model.parameters()).device
    with torch.inference_mode(), float32_products(model_dtype(model), device):
        sum_nll = nll_function(model, ids[: windows[0][1]].to(device))  # lm_head by chunks of tokens where it can
        return score_windows(sum_nll, ids, windows, seq_len, batch_size, device, progress, logits)


def score_windows(sum_nll: NllFunction, ids: torch.Tensor, windows: list[Window], seq_len: int, batch_size: int = 1,
                  device: torch.device | str = "cpu", progress: Progress = QUIET,
                  logits: Observer | None = None) -> PerplexityResult:
    """exp(mean NLL) of the windows' scored tokens, `sum_nll` (inputs [B, L], labels [B, L], observe) -> (summed NLL,
    count) computing each batch's loss and handing its scored positions' logits to `logits` (started with the windows'
    digest and scored tokens); tokens/s counts every token fed (context included) per wall second."""
    digest = windows_digest(ids, windows)
    if logits is not None:
        logits.start(digest, sum(end - target_begin for _, end, target_begin in windows))
    total_nll, scored, fed = 0.0, 0, 0
    start = time.perf_counter()
    with progress.task("Perplexity", total=len(windows)) as advance:
        for batch in _batches(windows, batch_size):
            inputs, labels = _window_tensors(ids, batch)
            nll, count = sum_nll(inputs.to(device), labels.to(device), logits)
            total_nll, scored, fed = total_nll + nll, scored + count, fed + inputs.numel()
            advance(len(batch))
    seconds = time.perf_counter() - start
    return PerplexityResult(
        perplexity=math.exp(total_nll / scored), nll=total_nll / scored, tokens=scored,
        seconds=seconds, tokens_per_second=fed / seconds if seconds > 0 else float("inf"), seq_len=seq_len,
        windows_digest=digest,
    )


def windows_digest(ids: torch.Tensor, windows: list[Window]) -> str:
    """A short sha256 of the windows and the tokens they hold: two models with the same digest were scored on the
    same token ids in the same windows, so their perplexities compare."""
    hashed = hashlib.sha256(repr(windows).encode())
    hashed.update(ids[: windows[-1][1]].to("cpu", torch.int64).numpy().tobytes())  # ids may be on a GPU
    return hashed.hexdigest()[:16]


def _batches(windows: list[Window], batch_size: int) -> Iterator[list[Window]]:
    """Consecutive windows of equal length, at most `batch_size` at a time (so no padding is needed)."""
    batch: list[Window] = []
    for window in windows:
        if batch and (len(batch) == batch_size or _length(window) != _length(batch[0])):
            yield batch
            batch = []
        batch.append(window)
    if batch:
        yield batch


def _length(window: Window) -> int:
    return window[1] - window[0]


def _window_tensors(ids: torch.Tensor, batch: list[Window]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [B, L] and labels [B, L] with IGNORE_INDEX before each window's target_begin."""
    inputs = torch.stack([ids[begin:end] for begin, end, _ in batch])
    labels = inputs.clone()
    for row, (begin, _, target_begin) in enumerate(batch):
        labels[row, : target_begin - begin] = IGNORE_INDEX
    return inputs, labels


def load_eval_model(
    path: str | Path, trust_remote_code: bool = False, tokenizer_path: str | Path | None = None, dtype: str = "auto",
    load_weights: bool = True, tensor_parallel: bool = False, device: str = "cpu",
):
    """(model, tokenizer) for a source or quantized model directory. Quantized directories (a format's artifact, or
    another tool's `quantization_config` in config.json) load through plain transformers, with what their format's
    reader refuses first (`check_load`, `check_device`). With `load_weights` False only the tokenizer is loaded (model
    is None); with `tensor_parallel` the model is sharded over the ranks of this torchrun
    (`quantkit.evaluation.tensor_parallel`), else it is loaded onto `device`."""
    path = resolve_source(path)
    reader_for(path).check_load(path)
    tokenizer = load_tokenizer(Path(tokenizer_path) if tokenizer_path else path, trust_remote_code)
    if not load_weights:
        return None, tokenizer
    if tensor_parallel:
        return tensor_parallel_load(path, dtype=dtype, trust_remote_code=trust_remote_code), tokenizer
    _check_kernels_run_on(path, device)
    placed = {} if torch.device(device).type == "cpu" else {"device_map": {"": device}}
    model = load_model(path, dtype=dtype, trust_remote_code=trust_remote_code, **placed)
    return model, tokenizer


def _check_kernels_run_on(path: Path, device: str) -> None:
    """An artifact whose kernels cannot run on `device` refused in one line (its reader's `check_device`: torchao's FP8
    on the CPU), not with PyTorch's internal assertion halfway through the first forward."""
    reader_for(path).check_device(path, device)


def describe(path: str | Path) -> tuple[str | None, str | None]:
    """(recipe name, format) from quantkit.json; the format falls back to config.json's quant_method."""
    made = metadata.read(Path(path)) or {}
    return (made.get("recipe") or {}).get("name"), made_as(path)


def make_report(
    path: str | Path, label: str, result: PerplexityResult, recipe: str | None = None,
    tasks: dict[str, TaskResult] | None = None, peak_rss_per_rank: list[int] | None = None,
    weight_bytes_per_rank: list[int] | None = None, tensor_parallel: int = 1,
) -> ModelReport:
    """A report for the model at `path`; `recipe` (e.g. a previewed recipe) overrides quantkit.json's."""
    found_recipe, fmt = describe(path)
    return ModelReport(
        path=str(path), label=label, recipe=recipe or found_recipe, format=fmt,
        size_bytes=weights_size(Path(path)), perplexity=result, tasks=tasks or {},
        peak_rss_per_rank=peak_rss_per_rank or [], weight_bytes_per_rank=weight_bytes_per_rank or [],
        tensor_parallel=tensor_parallel,
    )


def gate(
    reports: list[ModelReport], baseline_label: str | None, max_increase_pct: float | None = None,
    max_acc_drop: float | None = None, max_kld: float | None = None,
) -> list[str]:
    """One message per model whose perplexity rose more than `max_increase_pct` percent over the baseline's,
    one per model and task whose score fell more than `max_acc_drop` points (percentage points) below it, and one per
    model whose mean KL divergence from the first model (`--kl-divergence`'s reference, not the baseline) is over
    `max_kld`."""
    failures = []
    baseline = _find(reports, baseline_label) if baseline_label is not None else None
    for report in reports:
        if baseline is not None and report is not baseline:
            if max_increase_pct is not None:
                failures += _perplexity_failures(report, baseline, max_increase_pct)
            if max_acc_drop is not None:
                failures += _task_failures(report, baseline, max_acc_drop)
        if max_kld is not None and report.kl_divergence is not None:
            failures += _divergence_failures(report, report.kl_divergence, max_kld)
    return failures


def other_windows(report: ModelReport, baseline: ModelReport) -> bool:
    """`report` was scored on other tokens or windows than `baseline` (another tokenizer, a shorter window): its
    perplexity does not compare with the baseline's."""
    digests = report.perplexity.windows_digest, baseline.perplexity.windows_digest
    return all(digests) and digests[0] != digests[1]


def _perplexity_failures(report: ModelReport, baseline: ModelReport, max_increase_pct: float) -> list[str]:
    base, ppl = baseline.perplexity.perplexity, report.perplexity.perplexity
    if other_windows(report, baseline):
        why = f": {report.tokens_note}" if report.tokens_note else " (another tokenizer, or a shorter context)"
        return [f"{report.label}: scored on other tokens than {baseline.label}{why}; perplexities over different tokens "
                "do not compare, so the gate cannot pass it"]
    limit = base * (1.0 + max_increase_pct / 100.0)  # compared as a product: 10.5 vs 10 at 5% passes exactly
    if ppl <= limit:  # NaN fails too
        return []
    return [f"{report.label}: perplexity {ppl:.4g} is {(ppl / base - 1.0) * 100.0:+.2f}% over "
            f"{baseline.label} ({base:.4g}); the limit is +{max_increase_pct:g}%"]


def _divergence_failures(report: ModelReport, divergence: DivergenceResult, max_kld: float) -> list[str]:
    if divergence.mean <= max_kld:  # NaN fails too
        return []
    return [f"{report.label}: mean KL divergence {divergence.mean:.4g} from {divergence.reference}; the limit is {max_kld:g}"]


def _task_failures(report: ModelReport, baseline: ModelReport, max_drop: float) -> list[str]:
    failures = []
    for name, base in baseline.tasks.items():
        score = report.tasks.get(name)
        drop = 100.0 * (base.value - score.value) if score is not None else math.nan
        if not drop <= max_drop + 1e-9:  # points of k/n fractions: 62.5 - 60.0 is 2.5000000000000027; NaN fails
            got = f"{score.metric} {100 * score.value:.2f}" if score is not None else "no score"
            failures.append(f"{report.label}: {name} {got} is {drop:.2f} points below {baseline.label} "
                            f"({100 * base.value:.2f}); the limit is {max_drop:g} points")
    return failures


def _find(reports: list[ModelReport], label: str) -> ModelReport:
    for report in reports:
        if report.label == label:
            return report
    labels = ", ".join(r.label for r in reports) or "none"
    raise UsageError(f"baseline '{label}' is not among the evaluated models ({labels})")


def compare(
    models: list[str],
    data: str,
    recipes: Sequence[str] = (),
    seq_len: int | None = None,
    stride: int | None = None,
    max_samples: int | None = None,
    batch_size: int = 1,
    tokenizer: str | Path | None = None,
    threads: int | None = None,
    trust_remote_code: bool = False,
    text_field: str = "text",
    progress: Progress = QUIET,
    calibration=None,
    tasks: TaskOptions | None = None,
    tensor_parallel: int = 1,
    device: str = "cpu",
    kl_divergence: bool = False,
) -> list[ModelReport]:
    """Each model on the same data (and `tasks`), labelled by its path as given; then, for each recipe, the
    model quantized under it in memory (labelled "PATH+RECIPE"), as `finalize` would quantize it. With
    `kl_divergence`, every row after the first also gets its next-token distributions' divergence from the first's
    (`divergence.Comparison`: the first row's logits kept on disk while the others are scored). With
    `tensor_parallel` > 1 (under torchrun, one process per rank) each model is sharded over the ranks; every
    rank returns the same reports. Otherwise the models run on `device` (cpu, cuda, cuda:N). A MODEL whose format runs
    in an engine of its own (a .gguf file: llama.cpp) is measured there, on the Hugging Face rows' token ids where its
    vocabulary reads them (the engine's `measure`). A `seq_len` beyond a model's positions is
    refused (`check_seq_len`); without one, each model's windows are DEFAULT_SEQ_LEN tokens, or its positions where
    fewer."""
    from quantkit.runtime import environment as runtime
    if tensor_parallel > 1:
        check_tensor_parallel_options(recipes, tasks)
    if kl_divergence and len(models) < 2 and not recipes:
        raise UsageError("--kl-divergence compares each model with the first MODEL (the reference): pass at least one more "
                         "MODEL, or -q RECIPE")
    if seq_len is not None:
        check_seq_len(models, seq_len, trust_remote_code)
    threads = runtime.set_threads(threads)
    suite = load_tasks(tasks) if tasks else None  # a wrong task name or missing task data: before any model loads
    texts = load_texts(data, text_field, field_advice=TEXT_FIELD_ADVICE)
    previews = _prepare_previews(models, recipes, trust_remote_code, calibration)  # every check before any model loads
    settings = dict(seq_len=seq_len or DEFAULT_SEQ_LEN, stride=stride, max_samples=max_samples, batch_size=batch_size,
                    progress=progress)
    reference = _reference_ids(models, tokenizer, texts, trust_remote_code) if any(map(in_engine, models)) else None
    with Comparison(enabled=kl_divergence) as comparison:
        reports = []
        for label in models:
            path, reader = locate(label)  # a directory (a hub id from the cache), or a file its engine runs
            if reader.ENGINE:
                reset_peak_resident()
                reports.append(engine(reader).measure(label, texts, reference, threads=threads, device=device,
                                                      logits=comparison.observer(label), **settings))
                continue
            measure = partial(_measure, texts=texts, tokenizer=tokenizer, trust_remote_code=trust_remote_code,
                              suite=suite, tensor_parallel=tensor_parallel > 1, device=device, **settings)
            reset_peak_resident()
            result, scores, held = measure(path, logits=comparison.observer(label))
            peaks = gather_ints(peak_resident_bytes())
            reports.append(make_report(path, label, result, tasks=scores, peak_rss_per_rank=peaks,
                                       weight_bytes_per_rank=gather_ints(held), tensor_parallel=tensor_parallel))
            for recipe, prepared in previews.get(label, []):
                logits = comparison.observer(f"{label}+{recipe.name}")
                reports.append(_preview(path, label, recipe, prepared, partial(measure, logits=logits), trust_remote_code,
                                        progress, calibration))
    for report, found in zip(reports, comparison.results([r.perplexity.perplexity for r in reports])):
        report.kl_divergence = found
    return reports


def _prepare_previews(models: list[str], recipe_names: Sequence[str], trust_remote_code: bool,
                      calibration=None) -> dict[str, list]:
    """Each full-precision model's recipes checked as `finalize` checks them (`checks.prepare`: the model, the
    calibration data), before any model loads: (recipe, Prepared) pairs by model label. A QAT-trained model is
    measured under each recipe asked for: its own runs as its convert step, another as `finalize --force-recipe`
    would quantize it (a measurement writes nothing, so nothing needs refusing)."""
    if not recipe_names:
        return {}
    from quantkit.export import for_format
    from quantkit.finalization.checks import CalibrationOptions, prepare
    from quantkit.quant.registry import resolve

    recipes = [for_format(recipe, recipe.format) for recipe in map(resolve, recipe_names)]  # as finalize quantizes
    previews, quantized = {}, []
    for label in models:
        path, reader = locate(label)
        method = reader.quantized(path)
        if method is not None:  # recipes preview full-precision models only
            quantized.append(f"{label} ({method})")
            continue
        found = [prepare(path, recipe, trust_remote_code=trust_remote_code, force_recipe=True,
                         calibration=calibration or CalibrationOptions()) for recipe in recipes]
        previews[label] = [(prepared.recipe, prepared) for prepared in found]  # a QAT model's convert step
    if not previews:
        raise UsageError(f"--quantize quantizes full-precision models, and every model here is quantized already: "
                         f"{', '.join(quantized)}; evaluate them without -q, or pass the model they were made from")
    return previews


def _measure(
    path: str | Path, texts: list[str], tokenizer, trust_remote_code: bool, model=None, suite: TaskSuite | None = None,
    tensor_parallel: bool = False, device: str = "cpu", **settings,
) -> tuple[PerplexityResult, dict[str, TaskResult], int]:
    """Perplexity on `texts`, then the suite's task scores, on the model at `path` (or `model`, quantized in
    memory: moved to `device`); and the bytes of the weights this process held while it computed (`held_bytes`)."""
    loaded, tok = load_eval_model(path, trust_remote_code, tokenizer, load_weights=model is None,
                                  tensor_parallel=tensor_parallel, device=device)
    model = model.to(device) if model is not None else loaded
    result = perplexity(model, tokenize(tok, texts), **settings)
    scores = suite.run(model, tok, batch_size=settings["batch_size"], progress=settings["progress"]) if suite else {}
    return result, scores, held_bytes(model)


def _reference_ids(models: list[str], tokenizer: str | Path | None, texts: list[str],
                   trust_remote_code: bool) -> tuple[list[int], str] | None:
    """(ids, whose) the Hugging Face rows are scored on, for the rows of models an engine runs to be fed where its
    vocabulary reads them: `--tokenizer`'s, else the first Hugging Face model's; None when there is neither."""
    source = tokenizer or next((m for m in models if not in_engine(m)), None)
    if source is None:
        return None
    found = load_tokenizer(Path(tokenizer) if tokenizer else resolve_source(source), trust_remote_code)
    return tokenize(found, texts).tolist(), str(source)


def held_bytes(model) -> int:
    """Bytes of the parameters and buffers this process holds: a tensor-parallel rank's shards (DTensors' local
    parts) and replicated tensors; compressed-tensors artifacts as computed (their dequantized weights)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()  # tied weights once
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def _preview(
    path: Path,
    label: str,
    recipe,
    prepared,
    measure: Callable[..., tuple[PerplexityResult, dict[str, TaskResult], int]],
    trust_remote_code: bool,
    progress: Progress,
    calibration=None,
) -> ModelReport:
    """The model quantized in memory exactly as `finalize` would (`prepared` by `_prepare_previews`), measured
    without writing anything. Its size on disk is unknown (None) until it is written."""
    from quantkit.finalization.finalize import quantize_model

    model = quantize_model(prepared, recipe, trust_remote_code=trust_remote_code, progress=progress, calibration=calibration)
    result, scores, held = measure(path, model=model)
    return ModelReport(
        path=str(path), label=f"{label}+{recipe.name}", recipe=recipe.name, format=prepared.format.value,
        size_bytes=None, perplexity=result, tasks=scores, weight_bytes_per_rank=[held],
    )
