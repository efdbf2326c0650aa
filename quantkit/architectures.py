"""How a decoder layer is wired: the one module that knows module names inside a layer.

Calibration needs facts about a decoder layer that no Linear knows about itself:
- the order its Linears run in, grouped by the input they read (GPTQ's true-sequential stages; Linears that
  read one tensor share one Hessian);
- which op produces each group's input: a norm, or a Linear whose output reaches the group through a
  channel-wise op (SmoothQuant and AWQ fold their scales into it);
- which block's output measures AWQ's error for each group.

Which Linears read the very same tensor is also observed at run time (`calibration.hooks.observe`, by tensor
identity), so the statistics never depend on this table; the table is needed where nothing runs
(`--dry-run`'s plan) and where scales are folded. Today one wiring is known: the layout Llama, Qwen2 and
Mistral layers share. A new layout is a new `LayerWiring` in `WIRINGS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from quantkit.errors import UnsupportedModelError


@dataclass(frozen=True)
class LayerWiring:
    """Module names relative to the decoder layer. The layer computes

        h = h + attention(input_norm(h))              attention ends with o(attention core(q, k, v))
        h = h + mlp(post_attention_norm(h))           mlp = down(act(gate(x)) * up(x))
    """

    name: str
    input_norm: str
    attention: str
    q: str
    k: str
    v: str
    o: str
    post_attention_norm: str
    mlp: str
    gate: str
    up: str
    down: str

    @property
    def stages(self) -> tuple[tuple[str, ...], ...]:
        """The Linears in the order the layer runs them, grouped by shared input."""
        return (self.q, self.k, self.v), (self.o,), (self.gate, self.up), (self.down,)

    @property
    def smoothing(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(norm, the Linears it feeds): where SmoothQuant folds its scales."""
        return (self.input_norm, (self.q, self.k, self.v)), (self.post_attention_norm, (self.gate, self.up))

    @property
    def awq_mappings(self) -> tuple[tuple[str, tuple[str, ...], str], ...]:
        """(the op feeding the Linears, the Linears, the block whose output measures the error)."""
        return (
            (self.input_norm, (self.q, self.k, self.v), self.attention),
            (self.v, (self.o,), self.o),
            (self.post_attention_norm, (self.gate, self.up), self.mlp),
            (self.up, (self.down,), self.down),
        )

    @property
    def parts(self) -> tuple[str, ...]:
        return (self.input_norm, self.post_attention_norm, self.attention, self.mlp) + tuple(n for s in self.stages for n in s)

    def missing(self, layer: nn.Module) -> str | None:
        """The first part `layer` lacks, or None if it has them all."""
        for name in self.parts:
            try:
                layer.get_submodule(name)
            except AttributeError:
                return name
        return None


LLAMA = LayerWiring(
    name="Llama-style (Llama, Qwen2, Mistral)",
    input_norm="input_layernorm", attention="self_attn",
    q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
    post_attention_norm="post_attention_layernorm", mlp="mlp",
    gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj",
)
WIRINGS = (LLAMA,)


def find_wiring(layer: nn.Module) -> LayerWiring | None:
    """The first known wiring whose every part `layer` has."""
    return next((wiring for wiring in WIRINGS if wiring.missing(layer) is None), None)


def wiring_of(layer: nn.Module) -> LayerWiring:
    """`find_wiring`, or UnsupportedModelError naming what the layer lacks."""
    wiring = find_wiring(layer)
    if wiring is None:
        missing = WIRINGS[0].missing(layer)
        supported = ", ".join(w.name for w in WIRINGS)
        raise UnsupportedModelError(
            f"calibration needs {missing} in each decoder layer ({type(layer).__name__} has none); supported: {supported}"
        )
    return wiring


def shared_input_leaders(names: list[str]) -> dict[str, str]:
    """For planned Linear names (`model.layers.3.self_attn.q_proj`), the first module of its input-sharing group
    (q/k/v; gate/up; itself otherwise), as `observe` finds them at run time on these layers; `--dry-run` plans
    with this before any weight is loaded."""
    present = set(names)
    leaders = {name: name for name in names}
    for wiring in WIRINGS:
        for layer in {name.rsplit(".", 2)[0] for name in names}:
            for stage in wiring.stages:
                members = [f"{layer}.{n}" for n in stage if f"{layer}.{n}" in present]
                for name in members:
                    leaders[name] = members[0]
    return leaders
