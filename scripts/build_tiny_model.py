"""Build a tiny Llama with a BPE tokenizer trained on local text; nothing is downloaded.

    python scripts/build_tiny_model.py OUT_DIR [--text FILE] [--hidden 128] [--layers 2] [--intermediate 352]

Without --text (or when the file is missing) it trains the tokenizer on generated text.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from quantkit.cli.console import quiet_libraries
from quantkit.models.tiny import build_tiny_llama


def generated_text(n_words: int = 20000, seed: int = 0) -> str:
    """Text in a made-up language, for when no real text is at hand. 256 made-up words; which four words may come
    next (weighted 8:4:2:1) depends on the last word and on whether the word before it is odd or even. So a model
    has structure to learn, attention to the word before last included (and quantization something to lose).
    The language is fixed; `seed` draws another text from it."""
    language = random.Random("quantkit-demo-language")
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = sorted({"".join(language.choice(syllables) for _ in range(language.randint(1, 3))) for _ in range(400)})[:256]
    parity = {word: i % 2 for i, word in enumerate(words)}
    weights = [8, 4, 2, 1]
    successors: dict[tuple[str, int], list[str]] = {}

    def next_words(before: str, last: str) -> list[str]:
        key = (last, parity[before])
        if key not in successors:
            successors[key] = random.Random(f"quantkit-demo:{last}:{parity[before]}").sample(words, len(weights))
        return successors[key]

    rng = random.Random(seed)
    before, last = words[0], words[0]
    lines, line = [], []
    for _ in range(n_words):
        before, last = last, rng.choices(next_words(before, last), weights)[0]
        line.append(last)
        if len(line) >= 12 and rng.random() < 0.3:
            lines.append(" ".join(line) + ".")
            line = []
    return "\n".join(lines)


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
