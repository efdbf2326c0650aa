#!/usr/bin/env bash
# The whole GPU check in one command, on a GPU machine with no package registry (the image has torch and
# transformers; scripts/gpu_wheels.sh, run beforehand where PyPI is reachable, carried the rest in .whl/):
#   1. installs .whl/quantkit (quantkit's wheel + what the image lacks) and .whl/llmc (llm-compressor 0.14 with
#      the compressed-tensors 0.19 it pins) into two separate target folders;
#   2. runs the GPU suite (pytest -m gpu) and the tests that compare runs of different thread counts;
#   3. runs scripts/bench_gpu.py, both tools side by side on this GPU;
#   4. (step "scale", not by default) scripts/bench_gpu_scale.py: the 8B shape and reduced-depth copies, both tools
#      (SCALE_JOBS: its --jobs; SCALE_DEADLINE: no job started after that many seconds);
#   5. (step "profile", not by default) profiles quantkit's GPTQ of the benchmark's 0.84B model (scripts/profile_cli.py);
#   (step "scale-rest") the scale step's jobs not measured yet (see below); each completed job is recorded on
#      the machine, so the same command in the next call on the same warm machine goes on where this one stopped:
#        bash scripts/gpu_check.sh $OUT scale-rest        # twice: timeout_s 600, then what the budget has left
# Usage, from the repository root:  bash scripts/gpu_check.sh [OUT_DIR] [STEPS]
#   STEPS: any of "tests bench scale scale-rest profile" (default "tests bench": about 9 minutes on an H100); logs, JUnit XML, the
#   benchmark's JSON and the profile land in OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${1:-${OUT:-/tmp/gpu-check}}
STEPS=${2:-tests bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 QUANTKIT_DIST_TIMEOUT=120

# installed once a machine: a second call on the same warm machine finds the same wheels in place (their digest)
wheels=$(cat .whl/quantkit/*.whl .whl/llmc/*.whl | sha256sum | cut -c1-16)
export PYTHONPATH=/tmp/site-qk PATH=/tmp/site-qk/bin:$PATH
echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE-unset}" > "$OUT/bytecode.txt"
unset PYTHONDONTWRITEBYTECODE
if [[ "$(cat /tmp/site-qk/.wheels 2>/dev/null)" != "$wheels" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-qk .whl/quantkit/*.whl || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-llmc .whl/llmc/*.whl || exit 1
    # bytecode, as a normal pip install leaves it: without it every process of either tool compiles torchao,
    # compressed-tensors and the rest again (7.6 s of a 38.6 s run in the first H100 profile)
    tf=$(cd /tmp && python3 -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('transformers').origin))")
    ls "$tf"/__pycache__/*.pyc >/dev/null 2>&1 && echo "transformers has bytecode" >> "$OUT/bytecode.txt" || compile_tf=$tf
    ( time python3 -m compileall -q -j 16 /tmp/site-qk /tmp/site-llmc ${compile_tf:-} ) >> "$OUT/bytecode.txt" 2>&1
    echo "$wheels" > /tmp/site-qk/.wheels
else
    echo "the same wheels are installed already (an earlier call on this machine)" >> "$OUT/bytecode.txt"
fi
printf '#!/bin/sh\nPYTHONPATH=/tmp/site-llmc exec python3 "$@"\n' > /tmp/llmc-python && chmod +x /tmp/llmc-python
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nproc
    (cd /tmp && python3 -c "import torch, transformers, torchao, compressed_tensors, quantkit; print('torch', torch.__version__, 'transformers', transformers.__version__, 'torchao', torchao.__version__, 'compressed-tensors', compressed_tensors.__version__, 'quantkit', quantkit.__file__)")
    /tmp/llmc-python -c "import llmcompressor, compressed_tensors; print('llmcompressor', llmcompressor.__version__, 'compressed-tensors', compressed_tensors.__version__)"
    python3 -m pip list 2>/dev/null | grep -i -E "^(pyarrow|accelerate|fsspec|huggingface)"
} 2>&1 | tee "$OUT/versions.txt"

status=0
# the tests run from outside the checkout, so that `python -m ...` in their subprocesses imports the installed
# quantkit (the checkout's quantkit/ lacks quantkit.cli, which the wheel maps from cli/)
mkdir -p /tmp/run && cd /tmp/run
if [[ " $STEPS " == *" tests "* ]]; then
    # bit-identity across processes, with every core of this machine visible (16 here, 2 in CI): CPU work, run
    # beside the GPU suite
    timeout ${THREAD_TIMEOUT:-150} python3 -m pytest -c "$REPO/pyproject.toml" --rootdir "$REPO" -q -p no:cacheprovider -rfE \
        "$REPO/tests/unit/runtime/test_distributed.py" "$REPO/tests/unit/calibration/test_autoround_step.py" \
        > "$OUT/thread-tests.txt" 2>&1 &
    threads=$!
    timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -c "$REPO/pyproject.toml" --rootdir "$REPO" -q -m gpu "$REPO/tests/gpu" \
        -p no:cacheprovider -n ${GPU_WORKERS:-6} --timeout 150 -rfEs --durations 15 --junitxml="$OUT/gpu-tests.xml" 2>&1 \
        | tail -100 | tee "$OUT/gpu-tests.txt" || status=1
    wait $threads || status=1
    tail -40 "$OUT/thread-tests.txt"
fi
if [[ " $STEPS " == *" bench "* ]]; then
    data=$REPO/.whl/data/wikitext-2
    timeout ${BENCH_TIMEOUT:-450} python3 "$REPO/scripts/bench_gpu.py" --llmc-python /tmp/llmc-python --workdir /tmp/bench-gpu \
        --train-text "$data/valid.txt" --calib-data "$data/valid.txt" --eval-data "$data/test.txt" \
        --train-steps 200 --json "$OUT/bench-gpu.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-gpu.txt" || status=1
    tar czf "$OUT/bench-logs.tgz" -C /tmp/bench-gpu logs 2>/dev/null || true
fi
if [[ " $STEPS " == *" scale-rest "* ]]; then
    # what is still unmeasured on a GPU, in one call (a second on the same warm machine goes on where it stopped):
    #   the whole GPU suite while the model is built (two of its tests failed on 2026-11-28 and were fixed without a
    #   GPU: test_train_with_a_qat_recipe_on_cuda and test_a_hessian_given_up_on_cuda_is_factored_in_its_own_memory);
    #   the round-to-nearest recipes on the whole 8B (issue 44's target: each within a minute). Calibration options
    #   are given to every job alike; round-to-nearest recipes note them unused.
    # A job is not started with less than SCALE_MIN_LEFT seconds before the call's deadline.
    SCALE_JOBS=${SCALE_JOBS:-qk:int4-weight-only:8b:1 qk:float8-dynamic-act-float8-weight:8b:1 qk:nvfp4-a16:8b:1}
    if [[ -f /tmp/bench-scale/tested ]]; then first_call=; else first_call=1; fi
    SCALE_DONE=/tmp/bench-scale/done.txt SCALE_DEADLINE=${SCALE_DEADLINE:-${first_call:+380}} SCALE_DEADLINE=${SCALE_DEADLINE:-450}
    SCALE_JOB_TIMEOUT=${SCALE_JOB_TIMEOUT:-440} SCALE_MIN_LEFT=${SCALE_MIN_LEFT:-120}
    SCALE_TESTS=${SCALE_TESTS:-all} STEPS="$STEPS scale"
fi
if [[ " $STEPS " == *" scale "* ]]; then
    # real sizes (scripts/bench_gpu_scale.py): the offloaded path's GPU test first, then the jobs in SCALE_JOBS, in
    # order, none started after SCALE_DEADLINE seconds; the models are built here, on the machine's local disk
    data=$REPO/.whl/data
    scale=(python3 "$REPO/scripts/bench_gpu_scale.py" --llmc-python /tmp/llmc-python --workdir /tmp/bench-scale
        --text "$data/wikitext-2/valid.txt" "$data/wikitext-2/test.txt" "$data/tinyshakespeare/input.txt"
        --jobs ${SCALE_JOBS:-qk:gptq-w4a16:8b:512 qk:awq-w4a16:8b:512 qk:gptq-w4a16:8b-l4:512:22GiB} ${SCALE_DONE:+--done $SCALE_DONE})
    # the jobs' models are built (CPU and disk) while the GPU runs the GPU tests (SCALE_TESTS: a -k selection, or all)
    ( time "${scale[@]}" --build-only ) > "$OUT/scale-build.txt" 2>&1 &
    building=$!
    if [[ ! -f /tmp/bench-scale/tested ]]; then  # once a machine (scale-rest's second call skips them)
        selected=(-k "${SCALE_TESTS:-offloaded or tf32 or gguf}")  # SCALE_TESTS=all: the whole GPU suite
        [[ "${SCALE_TESTS:-}" == all ]] && selected=(-n ${GPU_WORKERS:-6} --timeout 150 --durations 10 --junitxml="$OUT/gpu-tests.xml")
        timeout ${OFFLOAD_TEST_TIMEOUT:-170} python3 -m pytest -c "$REPO/pyproject.toml" --rootdir "$REPO" -q -m gpu \
            "$REPO/tests/gpu/test_cuda.py" "${selected[@]}" -p no:cacheprovider -rfE 2>&1 \
            | tail -40 | tee "$OUT/offload-tests.txt" || status=1
        mkdir -p /tmp/bench-scale && touch /tmp/bench-scale/tested
    fi
    wait $building || status=1
    cat "$OUT/scale-build.txt"
    "${scale[@]}" --deadline ${SCALE_DEADLINE:-420} --timeout ${SCALE_JOB_TIMEOUT:-300} --min-left ${SCALE_MIN_LEFT:-30} \
        --json "$OUT/bench-scale.json" 2>&1 \
        | tee "$OUT/bench-scale.txt" || status=1
    tar czf "$OUT/scale-logs.tgz" -C /tmp/bench-scale logs 2>/dev/null || true
fi
if [[ " $STEPS " == *" profile "* ]]; then
    data=$REPO/.whl/data/wikitext-2
    src=$(python3 -c "import sys; sys.path.insert(0, '$REPO/scripts'); from pathlib import Path; import bench_gpu; print(bench_gpu.big_model(Path('/tmp/bench-gpu'), Path('$data/valid.txt'), 16))" | tail -1)
    OMP_NUM_THREADS=8 timeout ${PROFILE_TIMEOUT:-150} python3 "$REPO/scripts/profile_cli.py" "$OUT/gptq-big.prof" finalize \
        "$src" /tmp/profiled -q gptq-w4a16 --calib-data "$data/valid.txt" --num-samples 64 \
        --seq-len 2048 --device cuda --threads 8 --overwrite 2>&1 | tail -25 | tee "$OUT/profile.txt" || status=1
fi
exit $status
