"""Models: where a model comes from and how it is built.

- `sources.py`: a directory or a hub id, resolved before torch loads (safetensors headers, sizes).
- `loading.py`: config, weights and tokenizer through plain transformers; decoder-layer discovery; fingerprints.
- `streaming.py`: a model whose decoder layers stay on disk until their turn (the meta skeleton, per-layer reads).
- `architectures.py`: how a decoder layer is wired: the only module that names `q_proj`, `input_layernorm`, ...
- `moe.py`: MoE experts split into per-expert Linear modules; routers and gates.
- `compat.py`: every reach into transformers' internals, for each release in the declared range.
- `tiny.py`: tiny models and tokenizers built from configs (tests, the demo, benchmarks).

Imports: `quantkit.errors` and `quantkit.runtime` only (`loading.load_model` also reads quantkit's own artifacts,
through their format's reader, `quantkit.export.reader_for`, imported when it is called).
"""
