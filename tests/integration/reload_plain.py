"""Run in a fresh interpreter: load artifacts with plain transformers (never importing quantkit), save logits,
the dequantized weight of every Linear and every fused MoE experts parameter to a safetensors file per artifact;
an artifact that does not load gets a NAME.error.txt with the error instead.

usage: python reload_plain.py INPUT_IDS.safetensors OUT_DIR ARTIFACT [ARTIFACT ...]
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def dense(weight: torch.Tensor) -> torch.Tensor:
    return weight.dequantize() if hasattr(weight, "dequantize") and type(weight) is not torch.nn.Parameter else weight


def main() -> None:
    ids = load_file(sys.argv[1])["input_ids"]
    out_dir = Path(sys.argv[2])
    for artifact in sys.argv[3:]:
        try:
            model = AutoModelForCausalLM.from_pretrained(artifact).eval()
            with torch.no_grad():  # compressed-tensors decompresses on the first forward
                tensors = {"logits": model(ids).logits.float().contiguous()}
        except Exception as exc:  # noqa: BLE001 - reported to the test, which knows which artifacts must load
            (out_dir / f"{Path(artifact).name}.error.txt").write_text(f"{type(exc).__name__}: {exc}")
            continue
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                tensors[name] = dense(module.weight.data).float().contiguous()
        for name, param in model.named_parameters():
            if param.dim() == 3:  # MoE experts, fused again by transformers' loader
                tensors[name] = param.data.float().contiguous()
        save_file(tensors, out_dir / f"{Path(artifact).name}.safetensors")
    assert not any(name.startswith("quantkit") for name in sys.modules), "quantkit was imported"


if __name__ == "__main__":
    main()
