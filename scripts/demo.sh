#!/usr/bin/env bash
# The offline demo: what quantization-aware training (QAT) is for, in about two minutes on 2 CPU cores.
#
# A tiny Llama is trained from scratch (200 steps), then fine-tuned 100 more steps twice, from the same weights,
# on the same batches with the same schedule: once plain (the float model), once under int2-weight-only's fake
# quantization (QAT). The float model is quantized by round-to-nearest (PTQ, at 2 and at 4 bits); the QAT model
# is converted with the same recipe. One eval compares them: PTQ at 2 bits loses clearly, QAT wins most of it back.
# Run from the repository root after `make install` (or just `make demo`). Writes under demo/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
QK="${QUANTKIT:-quantkit}"
DATA_DIR="${QUANTKIT_DATA:-../shared/data}"
OUT=demo
RECIPE=int2-weight-only
began=$SECONDS
rm -rf "$OUT" && mkdir -p "$OUT"
step() { printf '\n== [%s/5, %d s] %s\n' "$1" $((SECONDS - began)) "$2"; }

# Local text: Tiny Shakespeare to train on, its last part to evaluate on; generated text when absent.
if [ -f "$DATA_DIR/tinyshakespeare/input.txt" ]; then
  head -c 900000 "$DATA_DIR/tinyshakespeare/input.txt" > "$OUT/train.txt"
  tail -c 30000 "$DATA_DIR/tinyshakespeare/input.txt" > "$OUT/eval.txt"
else
  python -c "import sys; sys.path.insert(0, 'scripts'); from build_tiny_model import generated_text; print(generated_text(150000))" > "$OUT/train.txt"
  python -c "import sys; sys.path.insert(0, 'scripts'); from build_tiny_model import generated_text; print(generated_text(15000, seed=1))" > "$OUT/eval.txt"
fi

step 1 "a tokenizer trained on $OUT/train.txt"
python scripts/build_tiny_model.py "$OUT/tiny-llama" --text "$OUT/train.txt" --hidden 64 --intermediate 192

step 2 "train a tiny Llama (0.23M parameters) from scratch: 200 steps"
$QK train scripts/configs/tiny-llama.yaml

# Independent commands run side by side, one thread each (a model this small gains nothing from a second one),
# each printing into its own log, shown in order once all have finished.
side_by_side() {
  local logs=() pids=() i=0 status=0
  for cmd in "$@"; do
    logs+=("$OUT/.log-$i"); (eval "$cmd") > "$OUT/.log-$i" 2>&1 & pids+=($!); i=$((i + 1))
  done
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || status=$?; done
  for i in "${!logs[@]}"; do printf '$ %s\n' "${@:$((i + 1)):1}"; cat "${logs[$i]}"; rm -f "${logs[$i]}"; done
  return $status
}

step 3 "fine-tune it 100 more steps twice, side by side: plainly (the float model), and under $RECIPE fake quantization (QAT)"
side_by_side "$QK train scripts/configs/tiny-llama-finetune.yaml --threads 1" \
  "$QK train scripts/configs/tiny-llama-finetune.yaml --qat-recipe $RECIPE --output-dir $OUT/runs/qat --threads 1"

step 4 "finalize: PTQ of the float model (2 and 4 bits), QAT convert"
side_by_side "$QK finalize $OUT/runs/float/final $OUT/ptq-$RECIPE --quantize $RECIPE --threads 1" \
  "$QK finalize $OUT/runs/float/final $OUT/ptq-int4-weight-only --quantize int4-weight-only --threads 1" \
  "$QK finalize $OUT/runs/qat/final $OUT/qat-$RECIPE --quantize $RECIPE --threads 1"

step 5 "eval: all against the float model, with an accuracy gate (25%)"
$QK eval "$OUT/runs/float/final" "$OUT/ptq-int4-weight-only" "$OUT/ptq-$RECIPE" "$OUT/qat-$RECIPE" \
  --data "$OUT/eval.txt" --seq-len 128 --max-samples 48 \
  --baseline "$OUT/runs/float/final" --max-ppl-increase 25 --json "$OUT/eval.json"

python - "$OUT" "$RECIPE" <<'EOF'
import json
import sys

out, recipe = sys.argv[1:]
ppl = {r["path"]: r["perplexity"]["perplexity"] for r in json.load(open(f"{out}/eval.json"))["results"]}
base, int4, ptq, qat = (ppl[f"{out}/{p}"] for p in ("runs/float/final", "ptq-int4-weight-only", f"ptq-{recipe}", f"qat-{recipe}"))
rise = lambda p: f"{100 * (p / base - 1):+.1f}%"  # noqa: E731
won = f"won back {(ptq - qat) / (ptq - base):.0%} of what PTQ lost" if ptq > base else "(PTQ lost nothing here)"
print(f"""
What the table shows (perplexity on {out}/eval.txt, lower is better; every model
has had the same 300 training steps, the last 100 from the same 200-step model):
  PTQ int4, round-to-nearest     {rise(int4):>6}  4 bits hardly hurt a model this small
  PTQ int2, round-to-nearest     {rise(ptq):>6}  2 bits do
  QAT int2, 100 steps + convert  {rise(qat):>6}  QAT {won}""")
EOF

cat <<EOF

== done in $((SECONDS - began)) s
  trained:   $OUT/runs/plain/final (200 steps from scratch), then 100 more:
             $OUT/runs/float/final (plain), $OUT/runs/qat/final (QAT)
  quantized: $OUT/ptq-$RECIPE, $OUT/ptq-int4-weight-only (PTQ),
             $OUT/qat-$RECIPE (the QAT convert step)
  measured:  $OUT/eval.json (the table above), $OUT/runs/*/log.jsonl (training)
next, for example:
  quantkit recipes list
  quantkit eval $OUT/runs/float/final --data $OUT/eval.txt --seq-len 128 \\
    --max-samples 48 -q int8-weight-only -q int8-dynamic-act-int4-weight
  quantkit finalize $OUT/runs/float/final $OUT/gptq -q gptq-w4a16 \\
    --calib-data $OUT/train.txt --num-samples 32 --seq-len 128
EOF
