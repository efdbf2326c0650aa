"""llm-compressor's own FP8-static artifacts of a model, to run beside quantkit's `fp8-static` in vLLM (docs/formats.md,
"fp8-static in vLLM on a CPU"). Runs in an environment with llm-compressor, not quantkit's:

    python -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0
    /tmp/llmc/bin/pip install torch==2.13.0 llmcompressor        # 0.14.0.1: compressed-tensors 0.19, transformers 5.17
    /tmp/llmc/bin/python scripts/llmcompressor_fp8_static.py MODEL CALIB.txt OUT_DIR

Writes two artifacts, calibrated on the first 8 blocks of 64 tokens of CALIB.txt (`lm_head` left out, as quantkit's):
OUT_DIR/fp8 (llm-compressor's `FP8` preset: float8 weights per tensor, static per-tensor input scale) and
OUT_DIR/fp8-channel (float8 weights per channel, static per-tensor input scale: quantkit's fp8-static scheme).
"""

from __future__ import annotations

import sys
from pathlib import Path

NUM_SAMPLES, SEQ_LEN = 8, 64


def channel_scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    fp8 = dict(num_bits=8, type="float", symmetric=True, dynamic=False)
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**fp8, strategy="channel"),
                                          input_activations=QuantizationArgs(**fp8, strategy="tensor",
                                                                             observer="static_minmax"))}


def write(model_dir: str, calib: str, out: Path, **modifier) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(Path(calib).read_text(), add_special_tokens=False)["input_ids"]
    blocks = [ids[i * SEQ_LEN:(i + 1) * SEQ_LEN] for i in range(NUM_SAMPLES)]
    data = Dataset.from_dict({"input_ids": blocks, "attention_mask": [[1] * SEQ_LEN for _ in blocks]})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    oneshot(model=model, dataset=data, recipe=QuantizationModifier(ignore=["lm_head"], **modifier),
            max_seq_length=SEQ_LEN, num_calibration_samples=NUM_SAMPLES)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}")


def main() -> None:
    model_dir, calib, out = sys.argv[1:4]
    write(model_dir, calib, Path(out) / "fp8", targets="Linear", scheme="FP8")
    write(model_dir, calib, Path(out) / "fp8-channel", config_groups=channel_scheme())


if __name__ == "__main__":
    main()
