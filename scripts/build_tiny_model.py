"""Build a tiny Llama with a BPE tokenizer trained on local text; nothing is downloaded.

    python scripts/build_tiny_model.py OUT_DIR [--text FILE] [--hidden 128] [--layers 2] [--intermediate 352]

Without --text (or when the file is missing) it trains the tokenizer on generated text.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from quantkit.cli.console import quiet_libraries
from quantkit.tiny import build_tiny_llama


def generated_text(n_words: int = 20000, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = "the model weight scale group token layer river stone light king queen ship sea wind song".split()
    return "\n".join(" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(n_words // 12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--text", type=Path, help="local text file for the tokenizer")
    parser.add_argument("--max-chars", type=int, default=300_000)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=352, help="352: a width 128 does not divide")
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()
    quiet_libraries()
    text = args.text.read_text()[: args.max_chars] if args.text and args.text.is_file() else generated_text()
    out = build_tiny_llama(
        args.out_dir, text, hidden_size=args.hidden, num_hidden_layers=args.layers,
        intermediate_size=args.intermediate, vocab_size=args.vocab,
    )
    print(f"built {out}")


if __name__ == "__main__":
    main()
