#!/usr/bin/env bash
# The offline demo: build a tiny Llama, quantize it with several recipes, evaluate all side by side, gate on accuracy.
# Run from the repository root after `make install` (or just `make demo`). Writes under demo/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
QK="${QUANTKIT:-quantkit}"
DATA_DIR="${QUANTKIT_DATA:-../shared/data}"
OUT=demo
rm -rf "$OUT" && mkdir -p "$OUT"

# Local text: Tiny Shakespeare for the tokenizer, WikiText-2 test for evaluation; generated text when absent.
if [ -f "$DATA_DIR/tinyshakespeare/input.txt" ]; then TRAIN_TEXT="$DATA_DIR/tinyshakespeare/input.txt"; else TRAIN_TEXT=""; fi
if [ -f "$DATA_DIR/wikitext-2/test.txt" ]; then
  head -c 200000 "$DATA_DIR/wikitext-2/test.txt" > "$OUT/eval.txt"
else
  python -c "import sys; sys.path.insert(0, 'scripts'); from build_tiny_model import generated_text; print(generated_text(seed=1))" > "$OUT/eval.txt"
fi

echo "== build a tiny Llama (hidden 128, MLP 352: group size 128 does not divide it)"
python scripts/build_tiny_model.py "$OUT/tiny-llama" ${TRAIN_TEXT:+--text "$TRAIN_TEXT"}

echo "== recipes"
$QK recipes list

for recipe in int4-weight-only int8-dynamic-act-int8-weight float8-dynamic-act-float8-weight int8-dynamic-act-int4-weight; do
  echo "== finalize $recipe"
  $QK finalize "$OUT/tiny-llama" "$OUT/tiny-llama-$recipe" --quantize "$recipe"
done

echo "== eval: every artifact against the full-precision model, with an accuracy gate"
$QK eval "$OUT/tiny-llama" "$OUT"/tiny-llama-*-* --data "$OUT/eval.txt" --seq-len 256 \
  --baseline "$OUT/tiny-llama" --max-ppl-increase 25 --json "$OUT/eval.json"
echo "== done: artifacts and eval.json under $OUT/"
