"""Sensitivity, measured: how much each candidate type of each tensor adds to the model's output error, in the
units of the KL divergence of the model's next-token distribution from the float model's.

Two measurements on the calibration samples, made in one pass over the decoder layers as calibration makes it (a
streamed model holds one decoder layer in memory; `--nproc-per-node` ranks share the batches and the proxies):

1. **A proxy per tensor and type** (the float model's hidden states of up to MOMENT_SAMPLES samples): each Linear's input
   second moments E[x_j^2] (an importance matrix, llama.cpp's imatrix: the diagonal of GPTQ's Hessian over the
   token count) are collected; a type's proxy is sum_ij (W - Q(W))_ij^2 E[x_j^2], the expected squared error it
   adds to the Linear's output per token (Q rounded to nearest on the type's grid, the K types' search weighted by
   the same E[x^2]), computed on every k-th row (ROWS of them) and scaled to the whole weight: every format here
   rounds rows independently. The token embedding's is sum_t p(t) |E_t - Q(E)_t|^2 with p the tokens'
   frequencies in the samples, over the EMBEDDING_ROWS most frequent tokens.
2. **An end-to-end gain per role** (one stream of hidden states per role over PROBE_SAMPLES samples, beside the
   float model's): the proxy compares
   tensors of one role well, but not a value projection with an MLP's down projection: an error early in the
   residual stream or in a tensor the attention amplifies costs more at the output. So all tensors of a role
   (GGUF's: attn_q, attn_v, ffn_down, output, token_embd, ...) are put on their smallest candidate together, the
   KL divergence of the model's output from the float model's is measured, and the role's gain is that KL over
   the sum of its tensors' proxies there. A tensor's estimated error in a type is its role's gain times its proxy.

3. **The quantizer's discount per role** (where the recipe's quantizer uses the Hessian of its inputs: GPTQ): the
   proxies and the gains are round to nearest's, but the file's Linears are GPTQ's, which takes a role's error
   down by a factor that differs from role to role (most where the inputs are correlated: outlier channels),
   while the token embedding, which no calibration reaches, keeps its rounding. Planned on round to nearest's
   errors alone, the embedding was priced too low against the Linears (on the outlier benchmark model, the plan
   at 3.0 bits per weight: KL 0.0136 with the embedding in Q2_K, 0.0074 with it in Q3_K at the same size). So on
   one decoder layer (the middle one) and lm_head, the Hessian of each Linear's inputs is taken on the first
   moment batch, and the quantizer's error over round to nearest's on the same ROWS rows in the role's smallest
   candidate, each through that Hessian, is the role's discount; a tensor's estimated error is multiplied by it.

The estimate treats errors as additive; the benchmark (docs/benchmarks.md, "Fitting a budget") measures how the
plan it leads to does end to end.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from quantkit import data
from quantkit.calibration.hooks import Tail, capture_inputs, hidden_states, observe, run_layer, tail_calls, with_hidden
from quantkit.evaluation.divergence import kl_divergence
from quantkit.grids import quantize_weight
from quantkit.grids.observers import HessianObserver
from quantkit.grids.qparams import QuantizedWeight
from quantkit.models import architectures as models
from quantkit.quant import gguf_types
from quantkit.quant.registry import tensor_type_spec as spec_of
from quantkit.runtime import distributed
from quantkit.runtime.distributed import Context
from quantkit.runtime.progress import QUIET, Progress

MOMENT_SAMPLES = 32  # samples the input moments are taken on (E[x^2] settles long before: it is a mean)
ROWS = 256  # rows of a weight its proxy is computed on: every k-th row, the sum scaled up (rows are alike)
EMBEDDING_ROWS = 2048  # the most frequent tokens' rows of the embedding (the others weigh little or nothing)
PROBE_SAMPLES = 4  # samples the gains' KL divergences are measured on
LOGIT_ROWS = 256  # positions whose logits are computed at a time (float32 [256, vocab] each, two at once)
BATCH = 4


@dataclass
class Sensitivity:
    errors: dict[str, dict[str, float]]  # tensor -> type -> estimated added KL (nats per token)
    proxies: dict[str, dict[str, float]]  # tensor -> type -> the proxy (output squared error per token)
    gains: dict[str, float]  # role -> KL per unit of proxy
    role_kl: dict[str, float]  # role -> the KL measured with its tensors on their smallest candidate
    seconds: dict[str, float] = field(default_factory=dict)
    probe_tokens: int = 0
    tokens: int = 0
    discounts: dict[str, float] = field(default_factory=dict)  # role -> the quantizer's error over rounding's (3.)


class Layers(Protocol):
    """Where the decoder layers' weights come from: `models.streaming.StreamedModel` (read one layer at its turn,
    released after it, the modules outside the layers read only while needed) or `InMemory` (all there)."""

    def load(self, module: nn.Module) -> None: ...

    def release(self, module: nn.Module) -> None: ...

    def load_rest(self) -> None: ...

    def release_rest(self) -> None: ...


class InMemory:
    """A model loaded whole: nothing to read or release."""

    def load(self, module: nn.Module) -> None:
        pass

    release = load

    def load_rest(self) -> None:
        pass

    release_rest = load_rest


@torch.no_grad()
def measure(model: nn.Module, candidates: dict[str, list[str]], roles: dict[str, str], samples: torch.Tensor,
            embedding: str | None = None, members: dict[str, list[str]] | None = None,
            smallest: dict[str, str] | None = None, layers: Layers | None = None, ctx: Context | None = None,
            device: torch.device | None = None, progress: Progress = QUIET,
            quantizer: HessianQuantizer | None = None) -> Sensitivity:
    """Estimated errors of each tensor in each of its `candidates` types. A tensor is a Linear's module name, or
    `embedding` (the token embedding's name), or a name `members` maps to Linears that take one type together (an
    MoE layer's experts of one projection: GGUF stacks them into one tensor; their proxies add up, so an expert
    few tokens reach weighs little, and one none reach nothing). `roles`: each tensor's role (its gain's group).
    `samples`: token ids [n, seq_len]. `smallest`: each tensor's smallest candidate, which its role's gain is
    measured in (by default the one of fewest bits, for GGML types).

    Decoder layer by decoder layer, as calibration runs: `layers` reads each layer's weights at its turn (a
    streamed model: one layer in memory; default: the model is in memory). The moment samples and the probe's
    streams (the float model's and one per role, each with that role's tensors on their smallest types) go through
    the layer on `device`; the modules outside the layers (embeddings, final norm, lm_head) are read at the start
    and the end. With a distributed `ctx`, each rank runs its share of the batches and computes its share of the
    proxies; per-batch sums and proxies are exchanged so that every rank gets the values one process computes.
    `quantizer`: the recipe's, where it rounds through its inputs' Hessian (its result on some rows of a weight
    given the Hessian, or None): the roles' discounts (the module docstring's 3.); None: no discount."""
    layers = layers or InMemory()
    device = device or torch.device("cpu")
    members = {name: (members or {}).get(name, [name]) for name in candidates}
    smallest = {name: (smallest or {}).get(name) or min(types, key=gguf_types.bits_per_weight)
                for name, types in candidates.items()}
    run = _Run(model, candidates, roles, members, smallest, embedding, samples, layers, ctx, device, quantizer)
    return run.measure(progress)


class HessianQuantizer(Protocol):
    """The recipe's quantizer on some rows of a weight given its inputs' Hessian (`Algorithm.quantize_with_hessian`
    with the recipe's arguments), or None where it does not use one."""

    def __call__(self, weight: torch.Tensor, hessian: torch.Tensor, spec) -> QuantizedWeight | None: ...


class _Run:
    """One measurement (`measure`): its state between the layers."""

    def __init__(self, model, candidates, roles, members, smallest, embedding, samples, layers, ctx, device, quantizer):
        self.model, self.candidates, self.roles, self.members = model, candidates, roles, members
        self.quantizer = quantizer
        self.errors_by_role: dict[str, list[float]] = {}  # role -> [the quantizer's, rounding's] weighted errors
        self.smallest, self.embedding, self.samples, self.layers, self.ctx = smallest, embedding, samples, layers, ctx
        self.device = device
        self.decoder = models.decoder_layers(model)
        self.prefix = models.module_name(model, self.decoder)
        rank, world = (ctx.rank, ctx.world_size) if ctx is not None and ctx.distributed else (0, 1)
        moment = samples[:MOMENT_SAMPLES]
        probe = samples[:PROBE_SAMPLES]
        self.moment_batches = _shares(moment, rank, world, BATCH)
        self.probe_batches = _shares(probe, rank, world, 1)  # a sample's hidden states alike whatever the ranks
        self.moment, self.probe = moment, probe
        self.seconds = {"read": 0.0, "moments": 0.0, "proxies": 0.0, "gains": 0.0}
        self.proxies: dict[str, dict[str, float]] = {}
        self.moments: dict[str, torch.Tensor] = {}

    def _layer_of(self, linear: str) -> int | None:
        head = f"{self.prefix}."
        if not linear.startswith(head):
            return None
        return int(linear[len(head):].split(".", 1)[0])

    def _role_tensors(self) -> dict[str, list[str]]:
        by_role: dict[str, list[str]] = {}
        for name in self.candidates:
            by_role.setdefault(self.roles[name], []).append(name)
        return by_role

    def measure(self, progress: Progress) -> Sensitivity:
        model, embedding = self.model, self.embedding
        by_role = self._role_tensors()
        linears_of_layer: dict[int | None, list[str]] = {}
        tensors_of_layer: dict[int | None, list[str]] = {}  # a tensor is in a layer when all its Linears are
        for name in self.candidates:
            if name != embedding:
                layers = {self._layer_of(linear) for linear in self.members[name]}
                for linear in self.members[name]:
                    linears_of_layer.setdefault(self._layer_of(linear), []).append(linear)
                if len(layers) == 1:
                    tensors_of_layer.setdefault(layers.pop(), []).append(name)
        with self._timed("read"):
            self.layers.load_rest()
        embedding_param = model.get_input_embeddings().weight
        if embedding is not None:
            with self._timed("proxies"):
                self._embedding_proxies(embedding_param)
        with self._timed("moments"):
            moment_calls = capture_inputs(model, self.decoder, _batches(self.moment, self.moment_batches), self.device)
        with self._timed("gains"):
            probe_batches = _batches(self.probe, self.probe_batches)
            reference = capture_inputs(model, self.decoder, probe_batches, self.device)
            streams: dict[str, list | None] = {}
            for role, names in by_role.items():  # a role whose tensors change the embedding's output starts apart
                outside = self._outside(names)
                touches = any(self._param(n) is embedding_param for n in outside)
                if touches:
                    with _on_grids(model, {n: self.smallest[n] for n in outside}, embedding):
                        streams[role] = hidden_states(capture_inputs(model, self.decoder, probe_batches, self.device))
                else:
                    streams[role] = None  # the float model's, until one of its tensors is reached
        with self._timed("read"):
            self.layers.release_rest()
        trials = sum(len(types) for types in self.candidates.values())
        passes = self.moment.shape[0] + self.probe.shape[0] * (len(by_role) + 1)
        with progress.task(f"Budget: measuring sensitivity ({passes} sample passes per layer, {trials} rounding trials)",
                           total=len(self.decoder)) as advance:
            for i, layer in enumerate(self.decoder):
                with self._timed("read"):
                    self.layers.load(layer)
                layer.to(self.device)
                here = {linear: layer.get_submodule(linear[len(f"{self.prefix}.{i}."):]) for linear in linears_of_layer.get(i, [])}
                with self._timed("moments"):
                    if i == len(self.decoder) // 2:
                        self._discounts(here, layer, moment_calls[:1])
                    outputs = self._moments(layer, here, moment_calls)
                    moment_calls = with_hidden(moment_calls, outputs)
                with self._timed("proxies"):
                    self._linear_proxies(tensors_of_layer.get(i, []))
                with self._timed("gains"):
                    float_out = run_layer(layer, reference)
                    for role, names in by_role.items():
                        inside = {m: self.smallest[n] for n in names if n != embedding
                                  for m in self.members[n] if self._layer_of(m) == i}
                        if not inside and streams[role] is None:
                            continue
                        calls = reference if streams[role] is None else with_hidden(reference, streams[role])
                        with _on_grids(model, inside, embedding):
                            streams[role] = run_layer(layer, calls)
                    reference = with_hidden(reference, float_out)
                layer.to("cpu")
                with self._timed("read"):
                    self.layers.release(layer)
                advance()
        with self._timed("read"):
            self.layers.load_rest()
        norm, head = self._tail()
        with self._timed("moments"):  # Linears outside the decoder layers: lm_head reads the final norm's output
            for linear in linears_of_layer.get(None, []):
                module = model.get_submodule(linear)
                sums = torch.zeros(len(self._all(self.moment)), module.in_features, dtype=torch.float64)
                for slot, call in zip(self._slots(self.moment, self.moment_batches), hidden_states(moment_calls)):
                    x = norm(call.to(self.device)).float().reshape(-1, module.in_features)
                    sums[slot] = (x * x).sum(0).double().cpu()
                self.moments[linear] = self._reduced_mean(sums, self.moment.numel())
            outside = {linear: model.get_submodule(linear) for linear in linears_of_layer.get(None, [])}
            self._discounts(outside, Tail(norm, outside), tail_calls(moment_calls[:1]))
        with self._timed("proxies"):
            self._linear_proxies(tensors_of_layer.get(None, []))
        with self._timed("gains"):
            role_kl, gains = {}, {}
            hidden = hidden_states(reference)
            for role, names in sorted(by_role.items()):
                outside = {m: self.smallest[n] for n in self._outside(names) if n != embedding for m in self.members[n]}
                role_kl[role] = self._kl(norm, head, hidden, streams[role] or hidden, _on_grids(model, outside, embedding))
                proxy = sum(self.proxies[name][self.smallest[name]] for name in names)
                gains[role] = role_kl[role] / proxy if proxy > 0 else 0.0
        discounts = self._reduced_discounts(sorted(by_role))
        errors = {name: {t: gains[self.roles[name]] * discounts.get(self.roles[name], 1.0) * p for t, p in by_type.items()}
                  for name, by_type in self.proxies.items()}
        return Sensitivity(errors, self.proxies, gains, role_kl, self.seconds, self.probe.numel(), self.moment.numel(),
                           discounts)

    def _discounts(self, linears: dict[str, nn.Module], module: nn.Module, calls: list) -> None:
        """Add each of `linears`' weighted errors (the quantizer's, round to nearest's) to its role's, in its
        smallest candidate, through the Hessian of its inputs on `calls` (run through `module`): on the rank that
        holds the first moment batch (the others' sums stay 0 and are added to it, `_reduced_discounts`)."""
        tensors = {m: name for name in self.candidates for m in self.members[name]}  # an MoE expert: its stack's
        linears = {m: linear for m, linear in linears.items() if m in tensors}
        if self.quantizer is None or not linears or not calls or 0 not in self._slots(self.moment, self.moment_batches):
            return
        observers = observe(linears, HessianObserver, module, calls)
        for linear, observer in observers.items():  # (experts no token of the batch reached have none)
            name = tensors[linear]
            spec = spec_of(self.smallest[name])
            if spec is None:
                continue
            hessian = observer.hessian().to(self.device)
            weight = linears[linear].weight.data
            rows = weight[:: max(1, weight.shape[0] // ROWS)].float()
            solved = self.quantizer(rows, hessian, spec)
            if solved is None:
                continue
            rounded = quantize_weight(rows, spec, importance=hessian.diagonal().clone())
            sums = self.errors_by_role.setdefault(self.roles[name], [0.0, 0.0])
            sums[0] += _through(rows, solved, hessian)
            sums[1] += _through(rows, rounded, hessian)

    def _reduced_discounts(self, roles: list[str]) -> dict[str, float]:
        """role -> the quantizer's weighted error over rounding's, the same on every rank (roles not measured: none)."""
        sums = torch.tensor([self.errors_by_role.get(role, [0.0, 0.0]) for role in roles], dtype=torch.float64)
        distributed.all_reduce_(sums, self.ctx)
        return {role: float(solved / rounded) for role, (solved, rounded) in zip(roles, sums.tolist()) if rounded > 0}

    def _outside(self, names: list[str]) -> list[str]:
        """Of `names`, the tensors outside the decoder layers (the embedding, lm_head)."""
        return [n for n in names if n == self.embedding or any(self._layer_of(m) is None for m in self.members[n])]

    def _param(self, name: str) -> nn.Parameter:
        return self.model.get_input_embeddings().weight if name == self.embedding else self.model.get_submodule(name).weight

    def _moments(self, layer: nn.Module, linears: dict[str, nn.Module], calls) -> list[torch.Tensor]:
        """Run the moment batches through `layer`, taking E[x_j^2] of each of `linears`' inputs (all ranks' batches)."""
        slots = self._slots(self.moment, self.moment_batches)
        count = len(self._all(self.moment))
        sums = {name: torch.zeros(count, m.in_features, dtype=torch.float64) for name, m in linears.items()}
        current = [0]

        def hook(name):
            def accumulate(module, args):
                x = args[0].detach().float().reshape(-1, args[0].shape[-1])
                sums[name][slots[current[0]]] += (x * x).sum(0).double().cpu()
            return accumulate

        handles = [m.register_forward_pre_hook(hook(name)) for name, m in linears.items()]
        outputs = []
        try:
            for b, (args, kwargs) in enumerate(calls):
                current[0] = b
                out = layer(*args, **kwargs)
                outputs.append(out[0] if isinstance(out, tuple) else out)
        finally:
            for handle in handles:
                handle.remove()
        for name, by_batch in sums.items():
            self.moments[name] = self._reduced_mean(by_batch, self.moment.numel())
        return outputs

    def _reduced_mean(self, by_batch: torch.Tensor, count: int) -> torch.Tensor:
        """Every rank's per-batch sums (each batch's row filled by one rank), added in batch order: float32 [in]."""
        distributed.all_reduce_(by_batch, self.ctx)
        return (by_batch.sum(0) / count).float()

    def _slots(self, samples: torch.Tensor, batches: list[range]) -> list[int]:
        """The index among all ranks' batches (in rank order: sample order) of each of this rank's."""
        return [self._all(samples).index(r) for r in batches]

    def _all(self, samples: torch.Tensor) -> list[range]:
        """Every rank's batches of `samples` (the moments' or the probe's), in rank order."""
        world = self.ctx.world_size if self.ctx is not None and self.ctx.distributed else 1
        size = BATCH if samples is self.moment else 1
        return [r for rank in range(world) for r in _shares(samples, rank, world, size)]

    def _linear_proxies(self, names: list[str]) -> None:
        work = [(name, t) for name in names for t in self.candidates[name]]
        values = distributed.computed_once(
            len(work), lambda k: sum(_proxy(self.model.get_submodule(m).weight.data, work[k][1], self.moments[m])
                                     for m in self.members[work[k][0]]), self.ctx)
        for (name, t), value in zip(work, values):
            self.proxies.setdefault(name, {})[t] = value

    def _embedding_proxies(self, weight: torch.Tensor) -> None:
        freq = torch.bincount(self.samples.flatten(), minlength=weight.shape[0])[: weight.shape[0]].float() / self.samples.numel()
        top = freq.topk(min(EMBEDDING_ROWS, int((freq > 0).sum()))).indices.sort().values
        types = self.candidates[self.embedding]
        values = distributed.computed_once(len(types), lambda k: _proxy(weight[top], types[k], freq[top], rows=True), self.ctx)
        self.proxies[self.embedding] = dict(zip(types, values))

    def _tail(self):
        """The final norm and the logit head (hidden states -> logits, as the model's forward computes them)."""
        from quantkit.evaluation.nll import logit_head

        norm = models.final_norm(getattr(self.model, self.model.base_model_prefix)).to(self.device)
        head = logit_head(self.model) or self.model.get_output_embeddings()
        self.model.get_output_embeddings().to(self.device)
        return norm, head

    def _kl(self, norm, head, reference: list[torch.Tensor], other: list[torch.Tensor], grids: _on_grids) -> float:
        """The mean KL divergence (nats per position) of `other`'s next-token distribution (its head's tensors on
        `grids`) from `reference`'s, over every rank's probe positions, LOGIT_ROWS positions' logits at a time."""
        sums = torch.zeros(len(self._all(self.probe)), dtype=torch.float64)
        for slot, ref, got in zip(self._slots(self.probe, self.probe_batches), reference, other):
            ref, got = ref.to(self.device).flatten(0, -2), got.to(self.device).flatten(0, -2)
            for start in range(0, ref.shape[0], LOGIT_ROWS):
                rows = slice(start, start + LOGIT_ROWS)
                p = head(norm(ref[rows])).float()
                with grids:
                    q = head(norm(got[rows])).float()
                sums[slot] += float(kl_divergence(p, q)[0].double().sum())
        distributed.all_reduce_(sums, self.ctx)
        return float(sums.sum()) / self.probe.numel()

    @contextmanager
    def _timed(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - started


def _shares(samples: torch.Tensor, rank: int, world: int, size: int) -> list[range]:
    return data.rank_batches(samples.shape[0], size, rank, world)


def _batches(samples: torch.Tensor, ranges: list[range]) -> list[torch.Tensor]:
    return [samples[r.start : r.stop] for r in ranges]


def _through(weight: torch.Tensor, q, hessian: torch.Tensor) -> float:
    """sum over rows of (w - q) H (w - q)^T: the rows' squared output error on the Hessian's inputs."""
    delta = weight - q.dequantize(torch.float32)
    return float(((delta @ hessian) * delta).sum())


def _proxy(weight: torch.Tensor, type_name: str, importance: torch.Tensor, rows: bool = False) -> float:
    """sum (W - Q(W))^2 weighted by `importance`: per column (a Linear's E[x^2]) or per row (`rows`: the
    embedding's token frequencies, all rows given); a Linear's on every k-th of its rows (ROWS), scaled up."""
    stride = 1 if rows else max(1, weight.shape[0] // ROWS)
    w = weight[::stride].float()
    spec = spec_of(type_name)
    if spec is None:
        return 0.0
    column_importance = None if rows else importance.to(w.device)
    q = quantize_weight(w, spec, importance=column_importance).dequantize(torch.float32)
    error = (w - q).pow_(2)
    weighted = error.sum(1) * importance.to(w.device) if rows else error @ importance.to(w.device)
    return float(weighted.sum()) * (weight.shape[0] / w.shape[0])


class _on_grids:
    """Inside: the given tensors hold their types' rounded values (the rest float); restored on leaving. The rounded
    values are computed on the first entry and kept: entering again only swaps them in."""

    def __init__(self, model: nn.Module, types: dict[str, str], embedding: str | None):
        self.model, self.types, self.embedding, self.saved, self.rounded = model, types, embedding, {}, {}

    def _param(self, name: str) -> nn.Parameter:
        return self.model.get_input_embeddings().weight if name == self.embedding else self.model.get_submodule(name).weight

    def __enter__(self):
        for name, type_name in self.types.items():
            param = self._param(name)
            self.saved[name] = param.data
            spec = spec_of(type_name)
            if spec is not None:
                if name not in self.rounded:
                    self.rounded[name] = quantize_weight(param.data.float(), spec).dequantize(torch.float32).to(param.dtype)
                param.data = self.rounded[name]
        return self

    def __exit__(self, *exc):
        for name, data in self.saved.items():
            self._param(name).data = data
        self.saved = {}
