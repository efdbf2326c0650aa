#!/usr/bin/env bash
# llama.cpp's command-line tools (llama-quantize, llama-imatrix, llama-perplexity, llama-bench), built once
# from the llama.cpp source inside PyPI's llama-cpp-python sdist (the only route to its source on a machine that
# reaches nothing but the package registries) into a cache outside the repository. About 7 minutes on 2 cores.
#   scripts/build_llama_cpp.sh            -> prints the folder holding the binaries
#   LLAMA_CPP_VERSION=0.3.36 LLAMA_CPP_CACHE=~/.cache/quantkit/llama.cpp scripts/build_llama_cpp.sh
set -euo pipefail
VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
CACHE="${LLAMA_CPP_CACHE:-$HOME/.cache/quantkit/llama.cpp}"
PREFIX="$CACHE/$VERSION"
TOOLS=(llama-quantize llama-imatrix llama-perplexity llama-bench)
if [[ -x "$PREFIX/bin/llama-quantize" && -x "$PREFIX/bin/llama-perplexity" ]]; then
    echo "$PREFIX/bin"; exit 0
fi
mkdir -p "$CACHE"
WORK="$(mktemp -d "$CACHE/build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK" >&2
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$WORK/build" -j "$(nproc)" --target "${TOOLS[@]}" >&2
mkdir -p "$PREFIX/bin"
for tool in "${TOOLS[@]}"; do cp "$WORK/build/bin/$tool" "$PREFIX/bin/"; done
"$PREFIX/bin/llama-perplexity" --version 2>&1 | grep -m1 "^version" > "$PREFIX/VERSION" || true  # e.g. "version: 0.5.0-dev (build 1, commit 0c1e570)"
echo "$PREFIX/bin"
