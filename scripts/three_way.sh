#!/usr/bin/env bash
# The three-way comparison: float model vs post-training quantization (PTQ) vs quantization-aware training (QAT).
#
#   scripts/three_way.sh [WORK_DIR]        # default WORK_DIR: /tmp/quantkit-three-way
#
# Run from anywhere with the venv active (`quantkit` on PATH). What it does, all on this machine, offline:
#
# 1. Data (from ../shared/data relative to the repository root, or $QUANTKIT_DATA): the training text is
#    WikiText-2 valid + Tiny Shakespeare concatenated into WORK_DIR/train.txt; the evaluation text is the first
#    $EVAL_BYTES bytes of WikiText-2 test (cut at a line end), WORK_DIR/eval.txt.
# 2. A byte-level BPE tokenizer (quantkit.models.tiny.train_tokenizer, vocab $VOCAB) trained on train.txt.
# 3. A small Llama trained FROM SCRATCH three times with the same config, seed and batches (WORK_DIR/config.yaml):
#    plain, with `--qat-recipe int8-dynamic-act-int4-weight` (W4A8) and with `--qat-recipe int4-weight-only` (W4A16).
#    Default model: hidden 256, 4 layers, intermediate 688 (128 does not divide it: down_proj falls back to
#    groups of 16 for int4-weight-only, the others keep 128), 4 heads, vocab 4096, untied embeddings (5.3M
#    parameters); seq_len 128, global batch 16, $STEPS optimizer steps, AdamW lr 2e-3, cosine, fp32 on CPU.
# 4. finalize: the plain model with each recipe (PTQ, round-to-nearest); each QAT model with its own recipe
#    (the convert step).
# 5. ONE `quantkit eval` over float (the plain model in fp32), PTQ-w4a8, QAT-w4a8, PTQ-int4, QAT-int4 on eval.txt
#    (seq_len 128, no overlap) -> WORK_DIR/eval.json; then a table with perplexity, size and, per recipe, how much of
#    the PTQ perplexity rise QAT recovers: (ppl_PTQ - ppl_QAT) / (ppl_PTQ - ppl_float). It can be negative (QAT
#    worse than PTQ) or above 100% (QAT better than the float model); with a PTQ rise near zero it means little.
#    The table and the final training losses go to WORK_DIR/summary.md too.
#
# Knobs (environment): STEPS (400), THREADS (2), EVAL_BYTES (300000), VOCAB (4096), QUANTKIT_DATA.
# The three training runs take most of the time: about 6-8 minutes each on a quiet 2-core CPU, QAT a little more.
# Note: QAT usually fine-tunes a pretrained model for a short while; here both arms train from scratch.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-/tmp/quantkit-three-way}"
DATA="${QUANTKIT_DATA:-$REPO/../shared/data}"
STEPS="${STEPS:-400}"
THREADS="${THREADS:-2}"
EVAL_BYTES="${EVAL_BYTES:-300000}"
VOCAB="${VOCAB:-4096}"
W4A8=int8-dynamic-act-int4-weight
INT4=int4-weight-only
export WORK W4A8 INT4

mkdir -p "$WORK"
began=$SECONDS
stamp() { echo "== [$(date +%H:%M:%S), $((SECONDS - began)) s] $*"; }

stamp "data and tokenizer under $WORK"
cat "$DATA/wikitext-2/valid.txt" "$DATA/tinyshakespeare/input.txt" > "$WORK/train.txt"
head -c "$EVAL_BYTES" "$DATA/wikitext-2/test.txt" | sed '$d' > "$WORK/eval.txt"  # drop the cut last line
python - "$WORK" "$VOCAB" <<'EOF'
import sys
from pathlib import Path
from quantkit.models.tiny import train_tokenizer

work, vocab = Path(sys.argv[1]), int(sys.argv[2])
train_tokenizer((work / "train.txt").read_text(encoding="utf-8"), vocab).save_pretrained(work / "tokenizer")
EOF

cat > "$WORK/config.yaml" <<EOF
# written by scripts/three_way.sh
model:
  config:
    model_type: llama
    hidden_size: 256
    intermediate_size: 688
    num_hidden_layers: 4
    num_attention_heads: 4
    num_key_value_heads: 4
    vocab_size: $VOCAB
    max_position_embeddings: 512
  tokenizer: $WORK/tokenizer
data:
  train: $WORK/train.txt
  eval: $WORK/eval.txt
  seq_len: 128
train:
  micro_batch_size: 16
  global_batch_size: 16
  max_steps: $STEPS
  lr: 2.0e-3
  warmup_steps: 40
  schedule: cosine
  min_lr_ratio: 0.1
  precision: auto
  seed: 0
  log_interval: 25
  eval_interval: 0
  eval_max_samples: 32
output_dir: $WORK/runs/float
EOF

train() {  # NAME [--qat-recipe R]
  local name="$1"; shift
  stamp "train $name $*"
  local t0=$SECONDS
  quantkit train "$WORK/config.yaml" --output-dir "$WORK/runs/$name" --overwrite --quiet --threads "$THREADS" "$@"
  echo "$name $((SECONDS - t0))" >> "$WORK/train_seconds.txt"
}
rm -f "$WORK/train_seconds.txt"
train float
train qat-w4a8 --qat-recipe "$W4A8"
train qat-int4 --qat-recipe "$INT4"

finalize() {  # SRC DST RECIPE
  stamp "finalize $1 -> $2 ($3)"
  quantkit finalize "$WORK/$1" "$WORK/models/$2" --quantize "$3" --overwrite --quiet --threads "$THREADS"
}
finalize runs/float/final ptq-w4a8 "$W4A8"
finalize runs/qat-w4a8/final qat-w4a8 "$W4A8"
finalize runs/float/final ptq-int4 "$INT4"
finalize runs/qat-int4/final qat-int4 "$INT4"

stamp "eval"
quantkit eval "$WORK/runs/float/final" "$WORK/models/ptq-w4a8" "$WORK/models/qat-w4a8" \
  "$WORK/models/ptq-int4" "$WORK/models/qat-int4" \
  --data "$WORK/eval.txt" --seq-len 128 --threads "$THREADS" --json "$WORK/eval.json"

stamp "summary"
python - <<'EOF' | tee "$WORK/summary.md"
import json, os
from pathlib import Path

work = Path(os.environ["WORK"])
labels = {str(work / "runs/float/final"): "float (fp32)", str(work / "models/ptq-w4a8"): "PTQ w4a8",
          str(work / "models/qat-w4a8"): "QAT w4a8", str(work / "models/ptq-int4"): "PTQ int4",
          str(work / "models/qat-int4"): "QAT int4"}
reports = json.loads((work / "eval.json").read_text())["results"]
ppl = {labels[r["path"]]: r["perplexity"]["perplexity"] for r in reports}
size = {labels[r["path"]]: r["size_bytes"] for r in reports}
tokens = reports[0]["perplexity"]["tokens"]

def final_loss(run):
    records = [json.loads(line) for line in (work / "runs" / run / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r][-1]

seconds = dict(line.split() for line in (work / "train_seconds.txt").read_text().splitlines())
print(f"WikiText-2 test, first {tokens} scored tokens, seq_len 128 (no overlap)\n")
print("| model | perplexity | vs float | size on disk |")
print("|---|---:|---:|---:|")
for label in labels.values():
    print(f"| {label} | {ppl[label]:.2f} | {100 * (ppl[label] / ppl['float (fp32)'] - 1):+.2f}% | {size[label] / 2**20:.2f} MiB |")
print("\n| recipe | ppl float | ppl PTQ | ppl QAT | QAT recovers of the PTQ rise |")
print("|---|---:|---:|---:|---:|")
for key, recipe in (("w4a8", os.environ["W4A8"]), ("int4", os.environ["INT4"])):
    f, p, q = ppl["float (fp32)"], ppl[f"PTQ {key}"], ppl[f"QAT {key}"]
    recovery = f"{100 * (p - q) / (p - f):.0f}%" if p != f else "n/a (PTQ did not raise perplexity)"
    print(f"| {recipe} | {f:.2f} | {p:.2f} | {q:.2f} | {recovery} |")
print("\n| training run | final training loss | wall time |")
print("|---|---:|---:|")
for run, key in (("float", "float"), ("qat-w4a8", "qat-w4a8"), ("qat-int4", "qat-int4")):
    print(f"| {run} | {final_loss(run):.4f} | {int(seconds[key]) / 60:.1f} min |")
EOF
stamp "done: $WORK/summary.md, $WORK/eval.json"
