#!/usr/bin/env bash
# Builds .whl/ for scripts/gpu_check.sh: what a GPU machine with no package registry lacks, as wheels for its
# Python 3.12 on x86-64. The image the device tool lends has torch, transformers, safetensors, typer, rich, pyyaml,
# pyarrow and pandas, not torchao, compressed-tensors, gguf, datasets or pydantic.
#   .whl/quantkit  quantkit's own wheel (built from this checkout) and the dependencies the image lacks
#   .whl/llmc      llm-compressor 0.14 and what it pins (compressed-tensors 0.19, auto-round), for the benchmark's peer:
#                  a second folder, because the two tools pin different compressed-tensors releases
#   .whl/data      WikiText-2 (valid, test) and Tiny Shakespeare from ../shared/data, the benchmarks' text (../shared
#                  does not travel)
# Usage: bash scripts/gpu_wheels.sh   (from any directory; needs PyPI; about 20 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl
mkdir -p .whl/quantkit .whl/llmc

download() {
    local dest=$1
    shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "$@"
}

PYDANTIC=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5)
# datasets 4.8: pyarrow >= 21 (5.x wants 24, newer than some images hold); inside quantkit's datasets range
download .whl/quantkit torchao==0.18.0 compressed-tensors==0.20.0 gguf==0.19.0 datasets==4.8.4 dill==0.4.1 multiprocess==0.70.19 \
    loguru==0.7.3 typer==0.29.2 "${PYDANTIC[@]}"
download .whl/llmc llmcompressor==0.14.0.1 compressed-tensors==0.19.0 auto-round==0.15.1 torchao==0.18.0 \
    datasets==4.8.4 dill==0.4.1 multiprocess==0.70.19 loguru==0.7.3 "${PYDANTIC[@]}"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl/quantkit .
mkdir -p .whl/data/wikitext-2
cp ../shared/data/wikitext-2/valid.txt ../shared/data/wikitext-2/test.txt .whl/data/wikitext-2/
mkdir -p .whl/data/tinyshakespeare
cp ../shared/data/tinyshakespeare/input.txt .whl/data/tinyshakespeare/
ls -la .whl/quantkit .whl/llmc
du -sh .whl
