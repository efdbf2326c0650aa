#!/usr/bin/env bash
# What a user installs, run where the source tree cannot help it: the wheel goes into a fresh virtual environment in
# a temporary directory (torch first, as the README says), and quantkit runs from there: `--version`, `recipes list`,
# a calibrated finalize of a tiny model built on the spot, and `eval` of the artifact against the model. Before
# that, every module and recipe of the source tree must be in the wheel. A file the package needs that the wheel
# lacks fails here, as it would for a user.
#
#     make wheel-smoke                            # builds dist/ (make dist), then this; CI runs it
#     bash scripts/wheel_smoke.sh dist/quantkit_llm-*.whl
#
# PYTHON (default python3) makes the environment; TORCH_SPEC (default torch==2.13.0, the CPU wheel) is installed
# first. KEEP=1 leaves the temporary directory for a look.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL=$(realpath "${1:?usage: scripts/wheel_smoke.sh WHEEL}")
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VERSION=$(sed -n 's/^__version__ = "\([^"]*\)".*/\1/p' quantkit/version.py)
RECIPES=$(git ls-files 'recipes/*.yaml' | wc -l)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/quantkit-wheel-smoke.XXXXXX")
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
began=$SECONDS
step() { printf '\n== [%d s] %s\n' $((SECONDS - began)) "$1"; }

step "the wheel holds every module and recipe of the source tree"
git ls-files quantkit cli recipes | "$PYTHON" -c '
import sys, zipfile
# cli/ and recipes/ install as quantkit/cli and quantkit/recipes (pyproject.toml, [tool.setuptools.package-dir])
installed_as = {"cli/": "quantkit/cli/", "recipes/": "quantkit/recipes/", "quantkit/": "quantkit/"}
needed = set()
for path in sys.stdin.read().split():
    if path.endswith((".py", ".yaml")):
        top = path.split("/")[0] + "/"
        needed.add(installed_as[top] + path[len(top):])
missing = sorted(needed - set(zipfile.ZipFile(sys.argv[1]).namelist()))
if missing:
    sys.exit(f"the wheel lacks {len(missing)} file(s) of the source tree (pyproject.toml: packages, package-data): {missing}")
print(f"{len(needed)} modules and recipes, all in the wheel")
' "$WHEEL"

step "a fresh environment in $WORK: $TORCH_SPEC first, then the wheel"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --no-compile --disable-pip-version-check "$TORCH_SPEC"
"$WORK/venv/bin/python" -m pip install -q --no-compile --disable-pip-version-check "$WHEEL"

# From here on nothing of the source tree is reachable: another directory, no PYTHONPATH, the environment's own
# `quantkit` (PYTHONDONTWRITEBYTECODE cleared: the first command compiles what it imports, once).
cd "$WORK"
export PATH="$WORK/venv/bin:$PATH"
unset PYTHONPATH PYTHONDONTWRITEBYTECODE
step "the installed package: $(command -v quantkit)"
python - "$VERSION" <<'EOF'
import sys
from importlib import metadata
from pathlib import Path

import quantkit

site = Path(sys.prefix).resolve()
assert site in Path(quantkit.__file__).resolve().parents, f"quantkit imported from {quantkit.__file__}, not {site}"
assert quantkit.__version__ == metadata.version("quantkit-llm") == sys.argv[1], (quantkit.__version__, sys.argv[1])
print(f"quantkit {quantkit.__version__} from {Path(quantkit.__file__).parent}")
EOF
line=$(quantkit --version)
echo "$line"
case "$line" in "quantkit $VERSION (torch "*", transformers "*", compressed-tensors "*", torchao "*) ;;
  *) echo "wheel smoke: quantkit --version printed '$line'" >&2; exit 1 ;; esac

step "recipes list"
quantkit recipes list --json - | python -c '
import json, sys
names = [r["name"] for r in json.load(sys.stdin)["recipes"]]
expected = int(sys.argv[1])
assert len(names) == expected, f"{len(names)} recipes listed, {expected} shipped"
print(f"{len(names)} recipes: {names[0]} ... {names[-1]}")
' "$RECIPES"
quantkit recipes show gptq-w4a16 > gptq-w4a16.yaml

step "a tiny Llama and its text, made here"
python - <<'EOF'
import random

from quantkit.cli.console import quiet_libraries
from quantkit.models.tiny import build_tiny_llama

quiet_libraries()

rng = random.Random(0)
words = ["".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(1, 3))) for _ in range(300)]
def text(lines: int, seed: int) -> str:
    draw = random.Random(seed)
    return "\n".join(" ".join(draw.choice(words) for _ in range(12)) + "." for _ in range(lines))
open("calib.txt", "w").write(text(400, 1))
open("eval.txt", "w").write(text(100, 2))
build_tiny_llama("tiny", text(400, 0), hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512)
print("tiny/, calib.txt, eval.txt")
EOF

step "finalize, calibrated (GPTQ, from the recipe file recipes show wrote)"
quantkit finalize tiny tiny-gptq -q gptq-w4a16.yaml --calib-data calib.txt --num-samples 8 --seq-len 64 --threads 2
python - "$VERSION" <<'EOF'
import json, sys

made = json.load(open("tiny-gptq/quantkit.json"))
assert made["quantkit_version"] == sys.argv[1] and made["recipe"]["name"] == "gptq-w4a16", made["recipe"]["name"]
assert made["modules"]["quantized"], "nothing was quantized"
EOF

step "eval: the artifact against the model, with the accuracy gate"
quantkit eval tiny tiny-gptq --data eval.txt --seq-len 64 --max-samples 8 --threads 2 \
  --baseline tiny --max-ppl-increase 50 --json eval.json
python -c '
import json
rows = json.load(open("eval.json"))["results"]
assert len(rows) == 2 and all(r["perplexity"]["perplexity"] > 0 for r in rows), rows
'

step "eval --tasks without the tasks extra names the extra to install"
if quantkit eval tiny --data eval.txt --tasks arc_easy 2> tasks.err; then
  echo "wheel smoke: eval --tasks ran without lm-eval installed" >&2; exit 1
fi
cat tasks.err
grep -qF "pip install 'quantkit-llm[tasks]'" tasks.err

step "eval of a .gguf file without the gguf extra names the extra to install"
printf 'GGUF' > tiny.gguf  # the magic bytes: past the path check, to the missing llama-cpp-python
if quantkit eval tiny tiny.gguf --data eval.txt 2> gguf.err; then
  echo "wheel smoke: eval of a .gguf ran without llama-cpp-python installed" >&2; exit 1
fi
cat gguf.err
grep -qF "pip install 'quantkit-llm[gguf]'" gguf.err

step "wheel smoke passed: $(basename "$WHEEL") installs and runs"
