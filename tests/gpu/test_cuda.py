"""Every command on CUDA, compared with the CPU run of the same work.

Each shipped recipe is finalized twice from the same tiny Llama and the same calibration tokens, with
`--device cpu` and `--device cuda`; both artifacts are evaluated on the GPU and their perplexities agree within
PPL_TOLERANCE (GPU and CPU products round differently, so calibrated integers may differ in a few places; the
round-to-nearest recipes, which quantize on the CPU whatever the device, are checked tensor for tensor). A recipe
whose kernels need a newer GPU than this one is refused with a line naming the capability."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import make_text

PPL_TOLERANCE = 0.02  # relative: |ppl(cuda-made) / ppl(cpu-made) - 1|
NUM_SAMPLES, SEQ_LEN = 16, 64
AUTOROUND_ITERS = 40  # the shipped 200 steps a layer, cut for the suite's time (the same recipe on both devices)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny Llama whose widths (128, 256) take every group size and FP8's 128x128 blocks; calibration and eval text."""
    from quantkit.models.tiny import build_tiny_llama

    root = tmp_path_factory.mktemp("gpu")
    build_tiny_llama(root / "model", make_text(3000), hidden_size=128, intermediate_size=256)
    (root / "calib.txt").write_text(make_text(4000, seed=11))
    (root / "eval.txt").write_text(make_text(1500, seed=1))
    return root


def _recipe(name: str, folder: Path):
    from quantkit.quant import registry
    recipe = registry.resolve(name)
    if recipe.quantizer.name != "autoround":
        return recipe
    files = {p.stem: p for p in Path(registry.__file__).parent.joinpath("recipes").rglob("*.yaml")}
    data = yaml.safe_load(files[name].read_text()) if name in files else None
    if data is None:  # an installed wheel: the recipes are package data of quantkit.recipes
        from importlib import resources

        data = yaml.safe_load(resources.files("quantkit.recipes").joinpath(f"{name}.yaml").read_text())
    data["algorithm"]["iters"] = AUTOROUND_ITERS
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return registry.resolve(str(path))


def _finalize(work: Path, recipe, device: str, fmt=None):
    from quantkit.finalization.finalize import CalibrationOptions, finalize

    dst = work / f"{recipe.name}-{fmt.value if fmt else 'default'}-{device}"
    options = CalibrationOptions(data=str(work / "calib.txt"), num_samples=NUM_SAMPLES, seq_len=SEQ_LEN, device=device)
    return finalize(work / "model", dst, recipe, fmt, overwrite=True, calibration=options if recipe.needs_samples else
                    CalibrationOptions(device=device))


def _perplexity(path: Path, work: Path, device: str = "cuda") -> float:
    from quantkit.data import load_texts, tokenize
    from quantkit.evaluation.evaluate import load_eval_model, perplexity

    model, tokenizer = load_eval_model(path, device=device)
    ids = tokenize(tokenizer, load_texts(str(work / "eval.txt")))
    return perplexity(model, ids, seq_len=128, max_samples=16).perplexity


def _recipe_names() -> list[str]:
    """The recipes whose artifact is a directory transformers reloads (GGUF files run in llama.cpp)."""
    from quantkit.quant.registry import Format, recipe_names, resolve

    return [name for name in recipe_names() if resolve(name).format is not Format.GGUF]


@pytest.mark.parametrize("name", _recipe_names())
def test_every_recipe_finalizes_on_cuda_as_on_the_cpu(work, name):
    from quantkit.errors import HardwareError
    from quantkit.finalization import checks

    recipe = _recipe(name, work)
    needed = checks.missing_requirement(recipe, recipe.format)
    if needed:
        with pytest.raises(HardwareError, match="compute capability"):
            _finalize(work, recipe, "cuda")
        pytest.skip(f"{name}: refused as it should be on this GPU ({needed})")
    on_gpu = _finalize(work, recipe, "cuda")
    on_cpu = _finalize(work, recipe, "cpu")
    gpu_ppl, cpu_ppl = _perplexity(on_gpu.dst, work), _perplexity(on_cpu.dst, work)
    assert abs(gpu_ppl / cpu_ppl - 1) <= PPL_TOLERANCE, (name, gpu_ppl, cpu_ppl)
    if recipe.needs_calibration:
        made = json.loads((on_gpu.dst / "quantkit.json").read_text())["calibration"]
        assert made["device"] == "cuda" and made["peak_device_bytes"] > 0, made
        assert made["peak_device_reserved_bytes"] >= made["peak_device_bytes"], made  # the allocator's cache included
        assert made["device_outside_allocator_bytes"] > 0, made  # the CUDA context at least
    else:  # round to nearest: the same tensors, bit for bit
        _assert_same_tensors(on_gpu.dst, on_cpu.dst)


@pytest.mark.parametrize("name", ["int4-weight-only", "float8-dynamic-act-float8-weight", "int8-dynamic-act-int4-weight"])
def test_torchao_artifacts_made_and_evaluated_on_cuda(work, name):
    """torchao converts while loading, on the device it runs on; an FP8 artifact evaluates on the GPU (on the CPU
    torch has no per-row FP8 product)."""
    from quantkit.quant.registry import Format, resolve

    recipe = resolve(name)
    made = _finalize(work, recipe, "cuda", Format.TORCHAO)
    float_ppl, ppl = _perplexity(work / "model", work), _perplexity(made.dst, work)
    assert ppl < float_ppl * 1.5, (name, ppl, float_ppl)


def _assert_same_tensors(a: Path, b: Path) -> None:
    one, two = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert one.keys() == two.keys()
    for key in one:
        x, y = one[key], two[key]
        if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), key


def _quantkit(*args, cwd: Path | None = None, runner: list[str] | None = None, timeout: int = 600):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    cmd = [sys.executable, *(runner or ["-m", "quantkit.cli.main"]), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def test_one_rank_on_nccl_writes_what_one_process_writes(work, tmp_path):
    """The collectives of N GPUs, run with one: torchrun, one rank, nccl; the artifact equals a plain run's."""
    runner = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", f"--log-dir={tmp_path / 'logs'}",
              "-m", "quantkit.cli.main"]
    common = ["-q", "gptq-w4a16", "--calib-data", work / "calib.txt", "--num-samples", NUM_SAMPLES, "--seq-len", SEQ_LEN,
              "--device", "cuda", "--quiet"]
    plain = _quantkit("finalize", work / "model", tmp_path / "plain", *common)
    ranked = _quantkit("finalize", work / "model", tmp_path / "ranked", *common, runner=runner)
    assert plain.returncode == 0 and ranked.returncode == 0, (plain.stderr[-3000:], ranked.stderr[-3000:])
    _assert_same_tensors(tmp_path / "plain", tmp_path / "ranked")
    info = json.loads((tmp_path / "ranked" / "quantkit.json").read_text())["calibration"]
    assert info["ranks"] == 1 and info["device"] == "cuda"


def test_more_ranks_than_gpus_is_refused_before_anything_starts(work, tmp_path):
    count = torch.cuda.device_count()
    done = _quantkit("finalize", work / "model", tmp_path / "out", "-q", "gptq-w4a16", "--calib-data", work / "calib.txt",
                     "--device", "cuda", "--nproc-per-node", count + 1)
    assert done.returncode == 2, done.stderr
    assert f"--nproc-per-node {count + 1} needs {count + 1} GPUs (one per rank) and this machine has {count}" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


def test_train_with_a_qat_recipe_on_cuda(work, tmp_path):
    from quantkit.models.tiny import train_tokenizer

    train_tokenizer(make_text(3000), 384).save_pretrained(tmp_path / "tok")
    config = {
        "model": {"config": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384,
                             "max_position_embeddings": 128}, "tokenizer": str(tmp_path / "tok")},
        "data": {"train": str(work / "calib.txt"), "eval": str(work / "eval.txt"), "seq_len": 64},
        "train": {"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 8, "lr": 3e-3, "warmup_steps": 2},
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    done = _quantkit("train", tmp_path / "train.yaml", "--qat-recipe", "int8-dynamic-act-int4-weight", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    final = tmp_path / "run" / "final"
    converted = _quantkit("finalize", final, tmp_path / "converted", "-q", "int8-dynamic-act-int4-weight", "--quiet")
    assert converted.returncode == 0, converted.stderr[-3000:]


@pytest.mark.parametrize("tp", [None, 1])
def test_eval_runs_on_the_gpu_by_default(work, tmp_path, tp):
    made = _finalize(work, _recipe("int4-weight-only", work), "cuda")
    extra = ["--tp", tp] if tp else []
    done = _quantkit("eval", work / "model", made.dst, "--data", work / "eval.txt", "--seq-len", 128, "--max-samples", 8,
                     "--json", "-", *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["device"] == "cuda"
    ppl = [r["perplexity"]["perplexity"] for r in report["results"]]
    assert all(p == p and p < 1e4 for p in ppl), ppl


def test_staged_gptq_on_cuda_holds_less_than_with_every_stage_input_held(work, monkeypatch):
    """On a GPU o_proj's and down_proj's inputs are computed batch by batch (`placement.holds_stage_inputs`): the
    peak of CUDA memory is lower than with them held, and the qparams are the same."""
    from quantkit.calibration import calibrate
    from quantkit.models.loading import load_model
    from quantkit.quant.plan import plan_model
    from quantkit.quant.registry import resolve
    from quantkit.runtime import placement

    recipe = resolve("gptq-w4a16")
    vocab = load_model(work / "model").config.vocab_size
    samples = torch.randint(0, vocab, (64, 128), generator=torch.Generator().manual_seed(0))
    peaks, qweights = {}, {}
    for hold in (True, False):
        monkeypatch.setattr(placement, "holds_stage_inputs", lambda device, held_bytes=0, hold=hold: hold)
        model = load_model(work / "model", dtype="float32")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        result = calibrate(model, plan_model(model, recipe), recipe, samples, torch.device("cuda", 0), batch_size=8)
        peaks[hold] = torch.cuda.max_memory_allocated()
        qweights[hold] = result.qweights
        assert result.true_sequential
    assert peaks[False] < peaks[True], peaks
    for name, held in qweights[True].items():
        assert torch.equal(held.qdata, qweights[False][name].qdata), name


def test_the_inverse_hessian_factor_on_cuda_is_the_cpus():
    """On a GPU `factor_` takes the whole-matrix path (`_factor_dense_`); it gives the CPU's blocked factor to
    float32 rounding."""
    from quantkit.algorithms.factor import factor_

    x = torch.randn(4096, 2048, generator=torch.Generator().manual_seed(0))
    hessian = (x.T @ x / 4096).double()
    damped = (hessian + 0.01 * hessian.diagonal().mean() * torch.eye(2048, dtype=torch.float64)).flip(0, 1).float()
    on_cpu, on_gpu = damped.clone(), damped.cuda()
    assert factor_(on_cpu) and factor_(on_gpu)
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, atol=1e-5 * on_cpu.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("actorder", [False, True], ids=["left-to-right", "actorder"])
def test_a_hessian_given_up_on_cuda_is_factored_in_its_own_memory(actorder):
    """`inverse_hessian(h, reuse=True)` on a GPU: the same factor, bit for bit, as from a copy of h, with one
    [in, in] float32 matrix less at the peak (h and the Cholesky factor, without a copy of h beside them)."""
    from quantkit.algorithms.methods.gptq import GPTQArgs
    from quantkit.algorithms.gptq import inverse_hessian

    n = 4096
    x = torch.randn(2 * n, n, generator=torch.Generator().manual_seed(0))
    hessian = (x.T @ x / (2 * n)).cuda()
    args = GPTQArgs(actorder=actorder)
    peaks = {}
    for reuse in (False, True):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        factor = inverse_hessian(hessian.clone(), args, reuse=reuse)  # a temporary: given up with reuse
        peaks[reuse] = (torch.cuda.max_memory_allocated() - start) / (4 * n * n)
        if not reuse:
            from_copy = factor.upper.clone()
        else:
            assert torch.equal(factor.upper, from_copy)
        del factor
    assert peaks[True] <= peaks[False] - 0.9, peaks  # in [in, in] float32 matrices


@pytest.mark.parametrize("actorder", [False, True], ids=["left-to-right", "actorder"])
def test_gptqs_cuda_graphs_replay_the_eager_loop_in_either_column_order(actorder):
    """`gptq_graphs` on CUDA: the captured sub-blocks give the eager column loop's integers and errors bit for bit,
    left to right and in actorder's order (each column's group qparams copied in beside it), and stay on (a
    mismatch would have turned them off)."""
    from quantkit.algorithms import gptq_graphs
    from quantkit.algorithms.methods.gptq import GPTQArgs
    from quantkit.algorithms.gptq import _quantize_columns, inverse_hessian
    from quantkit.grids.qparams import ScaledColumns
    from quantkit.quant import registry

    spec = registry.resolve("gptq-w4a16").scheme.weights
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(512, 1024, generator=generator) * 0.05).to(torch.bfloat16).cuda()
    x = torch.randn(4096, 1024, generator=generator) * torch.linspace(0.2, 3.0, 1024)
    args = GPTQArgs(actorder=actorder)
    factor = inverse_hessian((x.T @ x / 4096).cuda(), args)
    results = []
    for graphs in (None, False):
        grid = ScaledColumns.up_front(weight.float(), torch.bfloat16, spec, dynamic=not actorder)
        wt = weight.T.float().contiguous()
        wt = wt[factor.perm] if factor.perm is not None else wt
        errors = torch.zeros(512, device="cuda")
        results.append((_quantize_columns(wt, factor.upper, grid, factor.order, 128, errors, graphs=graphs), errors))
    assert gptq_graphs._STATE["enabled"]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


R4_RECIPES = {  # R1+R2 fused and R4 online (the tiny model's MLP is 256 wide: type hadamard takes it)
    "r4-w4a8-rtn": "scheme: {weights: {dtype: int4, granularity: group, group_size: 32, symmetric: true}, "
                   "activations: {dtype: int8, granularity: token, dynamic: true, symmetric: false}}\nalgorithm: {name: rtn}\n",
    "r4-gptq-w4a16": "scheme: {weights: {dtype: int4, granularity: group, group_size: 128, symmetric: true}}\n"
                     "algorithm: {name: gptq}\n",
}


@pytest.mark.parametrize("name", R4_RECIPES)
def test_an_online_r4_recipe_on_cuda_as_on_the_cpu(work, name):
    """The online rotation's hook runs on the GPU in calibration and in eval; the artifact is the CPU run's (bit for
    bit when rounded to nearest) and evaluates on the GPU near the float model, not to garbage."""
    from quantkit.quant.registry import resolve

    path = work / f"{name}.yaml"
    path.write_text(R4_RECIPES[name] + "transforms: [{type: hadamard, rotations: [R1, R2]}, "
                    "{type: hadamard, rotations: [R4], online: true}]\nformat: compressed-tensors\nignore: [lm_head]\n")
    recipe = resolve(str(path))
    on_gpu, on_cpu = _finalize(work, recipe, "cuda"), _finalize(work, recipe, "cpu")
    gpu_ppl, cpu_ppl = _perplexity(on_gpu.dst, work), _perplexity(on_cpu.dst, work)
    assert abs(gpu_ppl / cpu_ppl - 1) <= PPL_TOLERANCE, (name, gpu_ppl, cpu_ppl)
    assert gpu_ppl < _perplexity(work / "model", work) * 1.5
    if not recipe.needs_calibration:
        _assert_same_tensors(on_gpu.dst, on_cpu.dst)


def test_learned_rotations_on_cuda_as_on_the_cpu(work):
    """Learning runs the whole model on the GPU (the Cayley solves in float64 there) and hands it back to the CPU;
    the two runs' losses and artifacts agree."""
    from quantkit.quant.registry import resolve

    path = work / "learned-w4a8.yaml"
    path.write_text("scheme: {weights: {dtype: int4, granularity: group, group_size: 32}, "
                    "activations: {dtype: int8, granularity: token, dynamic: true, symmetric: false}}\n"
                    "transforms: [{type: random-hadamard, rotations: [R1, R2], learn: {steps: 5, learning_rate: 0.05}}]\n"
                    "format: compressed-tensors\nignore: [lm_head]\n")
    recipe = resolve(str(path))
    on_gpu, on_cpu = _finalize(work, recipe, "cuda"), _finalize(work, recipe, "cpu")
    gpu, cpu = (json.loads((r.dst / "quantkit.json").read_text())["transforms"]["learned"] for r in (on_gpu, on_cpu))
    assert abs(gpu["loss_first_steps"] - cpu["loss_first_steps"]) <= 1e-3 * cpu["loss_first_steps"]
    gpu_ppl, cpu_ppl = _perplexity(on_gpu.dst, work), _perplexity(on_cpu.dst, work)
    assert abs(gpu_ppl / cpu_ppl - 1) <= PPL_TOLERANCE, (gpu_ppl, cpu_ppl)


@pytest.mark.parametrize("name", ["gptq-w4a16", "awq-w4a16", "fp8-static"])
def test_offloaded_hidden_states_on_cuda_give_the_resident_qparams_for_less_memory(work, name, monkeypatch):
    """Hidden states in pinned CPU memory, copied on a side stream (`calibration.offload`): the same integers and
    scales as with them on the GPU, for a lower peak (AWQ in groups of two batches)."""
    from quantkit.calibration import calibrate, offload
    from quantkit.models.loading import load_model
    from quantkit.quant.plan import plan_model
    from quantkit.quant.registry import resolve

    recipe = resolve(name)
    vocab = load_model(work / "model").config.vocab_size
    samples = torch.randint(0, vocab, (64, 128), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(offload, "GROUP_BYTES", 2 * 8 * 128 * 128 * 4)
    peaks, results = {}, {}
    for offloaded in (False, True):
        model = load_model(work / "model", dtype="float32")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        results[offloaded] = calibrate(model, plan_model(model, recipe), recipe, samples, torch.device("cuda", 0),
                                       batch_size=8, offloaded=offloaded)
        peaks[offloaded] = torch.cuda.max_memory_allocated()
    assert peaks[True] < peaks[False], peaks
    for key, q in results[False].qweights.items():
        other = results[True].qweights[key]
        assert torch.equal(q.qdata, other.qdata) and torch.equal(q.scale, other.scale), key
    for key, scale in results[False].input_scales.items():
        assert torch.equal(scale, results[True].input_scales[key]), key


def test_a_bf16_hessian_on_cuda_is_summed_in_tf32_as_in_float32():
    """16-bit activations are exact in TF32: the tensor-core products give the float32 Hessian to summation order."""
    from quantkit.grids.observers import HessianObserver

    x = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    found, before = {}, torch.backends.cuda.matmul.allow_tf32
    for device in ("cpu", "cuda"):
        observer = HessianObserver()
        observer.update(x.to(device))
        found[device] = observer.xtx().cpu()
    assert torch.backends.cuda.matmul.allow_tf32 == before  # put back as it was
    torch.testing.assert_close(found["cuda"], found["cpu"], rtol=1e-5, atol=1e-5 * found["cpu"].abs().max().item())


def test_awqs_hessian_scored_candidates_on_cuda_are_the_float64_errors_within_tf32s_rounding():
    """AWQ scores a lone Linear's candidates through tr(dW H dW^T), multiplied in TF32 on a GPU: within 1e-3 of the
    float64 errors (a few channels 50x larger, as in trained models), the same best candidate as float64 where the
    best leads by more than that, and the TF32 setting put back."""
    from quantkit.algorithms.methods.awq import AWQArgs
    from quantkit.algorithms.awq import candidate_scales, hessian_error, scaled_candidate
    from quantkit.quant import registry
    from quantkit.grids.observers import HessianObserver

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 1024, generator=g)
    x[:, :8] *= 50  # outlier channels
    x = x.to(torch.bfloat16)
    weight = (torch.randn(512, 1024, generator=g) * 0.02).to(torch.bfloat16)
    spec = registry.resolve("awq-w4a16").scheme.weights
    observer = HessianObserver()
    observer.update(x)
    xtx = observer.xtx()
    candidates = [scaled_candidate(weight, spec, s) for s in candidate_scales(x.float().abs().mean(0), AWQArgs())]
    exact = [float(((c.double() - weight.double()) @ xtx.double() * (c.double() - weight.double())).sum()) for c in candidates]
    before = torch.backends.cuda.matmul.allow_tf32
    on_gpu = [hessian_error(weight.cuda(), c.cuda(), xtx.cuda()) for c in candidates]
    assert torch.backends.cuda.matmul.allow_tf32 == before
    assert max(abs(a / b - 1) for a, b in zip(on_gpu, exact)) < 1e-3
    first, second = sorted(exact)[:2]
    if second / first - 1 > 2e-3:
        assert on_gpu.index(min(on_gpu)) == exact.index(first)


@pytest.mark.parametrize("name", ["gguf-q4-0", "gguf-q4-k-m"])
def test_a_gguf_file_made_on_cuda_is_the_cpus(work, tmp_path, name):
    """GGUF from CUDA calibration: every tensor in the CPU-made file's type; round to nearest the same bytes, GPTQ on
    the K grids (rows of 128: fallbacks; of 256: K super-blocks) as close to the float weights as the CPU's file."""
    import gguf
    import numpy as np

    from quantkit.export.gguf import permute_rows
    from quantkit.finalization.finalize import CalibrationOptions, finalize
    from quantkit.models.loading import load_model
    from quantkit.quant.registry import resolve

    recipe = resolve(name)
    files = {}
    for device in ("cuda", "cpu"):
        options = CalibrationOptions(data=str(work / "calib.txt"), num_samples=NUM_SAMPLES, seq_len=SEQ_LEN, device=device)
        files[device] = {t.name: t for t in gguf.GGUFReader(finalize(
            work / "model", tmp_path / f"{device}.gguf", recipe, None, calibration=options if recipe.needs_samples else
            CalibrationOptions(device=device)).dst).tensors}
    assert {k: t.tensor_type for k, t in files["cuda"].items()} == {k: t.tensor_type for k, t in files["cpu"].items()}
    model = load_model(work / "model", dtype="float32")
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    errors = {"cuda": 0.0, "cpu": 0.0}
    for key, value in model.state_dict().items():
        if key.endswith("q_proj.weight"):
            value = permute_rows(value, config.num_attention_heads)
        elif key.endswith("k_proj.weight"):
            value = permute_rows(value, config.num_key_value_heads)
        found = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if found not in files["cpu"]:
            continue
        for device, tensors in files.items():
            tensor = tensors[found]
            if not recipe.needs_calibration:
                assert np.array_equal(tensor.data, files["cpu"][found].data), found
            values = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type)))
            errors[device] += (values.float().reshape(value.shape) - value).pow(2).sum().item()
    assert errors["cpu"] > 0 and errors["cuda"] <= 1.05 * errors["cpu"], errors
