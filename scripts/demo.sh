#!/usr/bin/env bash
# The offline demo: build a tiny Llama and its tokenizer, train it (plain and with QAT), quantize it with several
# recipes (PTQ and the QAT convert step), evaluate everything side by side with an accuracy gate.
# Run from the repository root after `make install` (or just `make demo`). Writes under demo/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
QK="${QUANTKIT:-quantkit}"
DATA_DIR="${QUANTKIT_DATA:-../shared/data}"
OUT=demo
rm -rf "$OUT" && mkdir -p "$OUT"

# Local text: Tiny Shakespeare to train on, its last part to evaluate on; generated text when absent.
if [ -f "$DATA_DIR/tinyshakespeare/input.txt" ]; then
  head -c 900000 "$DATA_DIR/tinyshakespeare/input.txt" > "$OUT/train.txt"
  tail -c 30000 "$DATA_DIR/tinyshakespeare/input.txt" > "$OUT/eval.txt"
else
  python -c "import sys; sys.path.insert(0, 'scripts'); from build_tiny_model import generated_text; print(generated_text(150000))" > "$OUT/train.txt"
  python -c "import sys; sys.path.insert(0, 'scripts'); from build_tiny_model import generated_text; print(generated_text(15000, seed=1))" > "$OUT/eval.txt"
fi

echo "== a tokenizer (and an untrained model) built from the training text"
python scripts/build_tiny_model.py "$OUT/tiny-llama" --text "$OUT/train.txt"

echo "== train: plain, then with quantization-aware training for int8-dynamic-act-int4-weight"
$QK train scripts/configs/tiny-llama.yaml
$QK train scripts/configs/tiny-llama.yaml --qat-recipe int8-dynamic-act-int4-weight --output-dir "$OUT/runs/qat"

echo "== recipes"
$QK recipes list

echo "== finalize: PTQ of the plain model, and the QAT convert step"
for recipe in int8-dynamic-act-int4-weight int4-weight-only int8-dynamic-act-int8-weight float8-dynamic-act-float8-weight; do
  $QK finalize "$OUT/runs/plain/final" "$OUT/ptq-$recipe" --quantize "$recipe"
done
$QK finalize "$OUT/runs/qat/final" "$OUT/qat-int8-dynamic-act-int4-weight" --quantize int8-dynamic-act-int4-weight

echo "== eval: every model against the full-precision one, with an accuracy gate"
$QK eval "$OUT/runs/plain/final" "$OUT"/ptq-* "$OUT/qat-int8-dynamic-act-int4-weight" --data "$OUT/eval.txt" \
  --seq-len 128 --max-samples 48 --baseline "$OUT/runs/plain/final" --max-ppl-increase 25 --json "$OUT/eval.json"
cat <<EOF
== done
  trained models:   $OUT/runs/plain/final (plain), $OUT/runs/qat/final (QAT for int8-dynamic-act-int4-weight)
  quantized:        $OUT/ptq-* (post-training), $OUT/qat-int8-dynamic-act-int4-weight (the QAT convert step)
  measurements:     $OUT/eval.json (the table above)
next, for example:
  quantkit recipes show gptq-w4a16
  quantkit finalize $OUT/runs/plain/final $OUT/gptq -q gptq-w4a16 --calib-data $OUT/train.txt --num-samples 32 --seq-len 128
  quantkit eval $OUT/runs/plain/final $OUT/gptq --data $OUT/eval.txt --seq-len 128 --max-samples 48
EOF
