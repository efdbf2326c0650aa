"""Options shared by several commands, defined once so every command says the same thing the same way."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from quantkit.quant.registry import Format  # the formats' one list (a format is registered there and in export/)


class DtypeChoice(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


FormatOpt = Annotated[
    Optional[Format], typer.Option("--format", help="Output format; default: the recipe's.", show_default=False)
]
DtypeOpt = Annotated[DtypeChoice, typer.Option("--dtype", help="dtype to load the model in; auto keeps the checkpoint's.")]
ThreadsOpt = Annotated[
    Optional[int], typer.Option("--threads", min=1, help="torch threads; default: the cores available.", show_default=False)
]
QuietOpt = Annotated[bool, typer.Option("--quiet", help="No progress bars or tables; errors only.")]
TrustRemoteCodeOpt = Annotated[
    bool, typer.Option("--trust-remote-code", help="Allow model code from the model directory to run (off by default).")
]
ModelDirArg = Annotated[
    Path, typer.Argument(help="A Hugging Face causal-LM directory (config.json, *.safetensors, tokenizer), or a hub id (org/name) "
                              "resolved through the Hugging Face cache (HF_HOME; HF_HUB_OFFLINE=1 stays offline).")
]
RevisionOpt = Annotated[
    Optional[str], typer.Option("--revision", help="With a hub id: the branch, tag or commit; default: main.", show_default=False)
]
NprocOpt = Annotated[
    int, typer.Option("--nproc-per-node", min=1, help="Processes on this machine; N > 1 re-runs the command under torchrun.")
]


class RdzvBackend(str, Enum):
    static = "static"
    c10d = "c10d"


NnodesOpt = Annotated[
    int, typer.Option("--nnodes", min=1, help="Machines taking part; M > 1: run the same command on each, with its --node-rank.")
]
NodeRankOpt = Annotated[
    int, typer.Option("--node-rank", min=0, help="This machine's index among --nnodes, 0 to M-1; node 0 holds rank 0, which writes.")
]
RdzvEndpointOpt = Annotated[
    Optional[str],
    typer.Option("--rdzv-endpoint", metavar="HOST:PORT", show_default=False,
                 help="With --nnodes > 1: node 0's address and a free port there, the same on every node."),
]
RdzvBackendOpt = Annotated[
    RdzvBackend,
    typer.Option("--rdzv-backend", help="torchrun's rendezvous: static keeps --node-rank; c10d numbers the nodes itself "
                                         "(by host name), so rank 0 may land on another node."),
]
CalibDataOpt = Annotated[
    Optional[str],
    typer.Option("--calib-data", help="Calibration text for calibrated recipes (gptq, smoothquant, static scales): a file or a datasets spec."),
]
def _writable_json(target: Optional[Path]) -> Optional[Path]:
    """--json FILE checked when the command line is read: a file that cannot be written is refused before the work
    whose result it would hold (not after it, with the work's output written and the result lost)."""
    if target is None or str(target) == "-":
        return target
    import os

    if target.is_dir():
        raise typer.BadParameter(f"{target} is a directory; give a file path")
    parent = target.absolute().parent
    if not parent.is_dir():
        raise typer.BadParameter(f"{parent} does not exist; create it or give another path")
    if not os.access(target if target.exists() else parent, os.W_OK):
        raise typer.BadParameter(f"{target} is not writable; give another path")
    return target


TextFieldOpt = Annotated[
    str, typer.Option("--text-field", metavar="NAME", help="The field of the data (a .jsonl key, a .parquet or datasets column) that holds the text.")
]
JsonOpt = Annotated[
    Optional[Path],
    typer.Option("--json", help="Also write the result as JSON to this file; `-` prints only the JSON to stdout.", show_default=False,
                 callback=_writable_json),
]
NumSamplesOpt = Annotated[Optional[int], typer.Option("--num-samples", min=1, help="Calibration samples; default: the recipe's.")]
SeqLenOpt = Annotated[Optional[int], typer.Option("--seq-len", min=2, help="Tokens per calibration sample; default: the recipe's.")]
DeviceOpt = Annotated[
    str, typer.Option("--device", help="Compute device for calibration (cpu, cuda, cuda:1): the model stays in CPU memory, one layer at a time moves there. "
                                       "With --nproc-per-node N, cuda gives each rank its own GPU.")
]
EvalDeviceOpt = Annotated[
    str, typer.Option("--device", help="Where the models run (and -q calibrates): auto (a GPU when there is one, else the CPU), cpu, cuda, cuda:1.")
]
