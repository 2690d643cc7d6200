"""mega-convert command line: parse, call the library, report."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from mega_convert import __version__
from megacore.artifacts.header import FloatName
from megacore.cli import add_group_options, main_for, make_app
from megacore.config import DEFAULT_PAD_MULTIPLE
from megacore.progress import plural

app = make_app(
    "Hugging Face Llama / Code Llama / Mistral / Falcon / Qwen 2, 2.5, 3 / Gemma 3 weights to a "
    "checkpoint artifact, with a "
    "logits-parity check.\n\n"
    "Example:\n\n"
    "  mega-convert hf ./Llama-2-7b-hf ckpt/llama2-7b --dtype bfloat16\n\n"
    "  mega-convert verify ckpt/llama2-7b ./Llama-2-7b-hf"
)
add_group_options(app, "mega-convert", __version__)


@app.command()
def hf(
    model_dir: Path = typer.Argument(
        ..., metavar="MODEL_DIR", help="Hugging Face model directory (config.json + *.safetensors)."
    ),
    out: Path = typer.Argument(..., metavar="OUT", help="Output checkpoint artifact directory."),
    dtype: FloatName | None = typer.Option(
        None, "--dtype", help="Weight dtype of the checkpoint (default: the dtype the weights are stored in)."
    ),
    pad_vocab_multiple: int = typer.Option(
        DEFAULT_PAD_MULTIPLE,
        "--pad-vocab-multiple",
        help="Pad the embedding / lm_head rows to a multiple of this (zero rows).",
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace OUT when it is a checkpoint these tools wrote (even this conversion)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable summary on stdout."),
) -> None:
    """Convert a Hugging Face model directory to a tp1/pp1 checkpoint artifact, tensor by tensor.

    Example: mega-convert hf ./Mistral-7B-v0.1 ckpt/mistral --dtype bfloat16
    """
    from mega_convert.convert import convert_hf

    s = convert_hf(model_dir, out, dtype=dtype, pad_multiple=pad_vocab_multiple, force=force)
    if as_json:
        typer.echo(json.dumps(s))
    elif not s["reused"]:
        typer.echo(
            f"wrote {s['out']}: {s['family']}, {plural(s['tensors'], 'tensor')}, {plural(s['parameters'], 'parameter')}, "
            f"{s['dtype']}, vocab {s['vocab_size']} padded to {s['padded_vocab_size']} ({s['seconds']:.1f}s)"
        )


@app.command()
def peft(
    adapter_dir: Path = typer.Argument(
        ...,
        metavar="ADAPTER_DIR",
        help="PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors).",
    ),
    out: Path = typer.Argument(..., metavar="OUT", help="Output adapter checkpoint artifact directory."),
    base: Path = typer.Option(
        ..., "--base", metavar="CKPT", help="The checkpoint of the model the adapter was trained on."
    ),
    dtype: FloatName | None = typer.Option(None, "--dtype", help="Weight dtype (default: the adapter's)."),
    force: bool = typer.Option(
        False, "--force", help="Replace OUT when it is a checkpoint these tools wrote (even this conversion)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable summary on stdout."),
) -> None:
    """Convert a PEFT LoRA adapter of BASE into an adapter checkpoint a run continues from
    (`"lora": {"init": OUT}`).

    Example: mega-convert peft ./my-lora ckpt/my-lora --base ckpt/llama2-7b
    """
    from mega_convert.peft import convert_peft

    s = convert_peft(adapter_dir, out, base, dtype=dtype, force=force)
    if as_json:
        typer.echo(json.dumps(s))
    elif not s["reused"]:
        typer.echo(
            f"wrote {s['out']}: a {s['family']} LoRA adapter, rank {s['rank']}, {plural(s['tensors'], 'tensor')}"
        )


@app.command()
def verify(
    checkpoint: Path = typer.Argument(
        ...,
        metavar="CHECKPOINT",
        help="Checkpoint artifact (any layout), e.g. made by `mega-convert hf`, or a LoRA adapter's.",
    ),
    model_dir: Path = typer.Argument(
        ...,
        metavar="MODEL_DIR",
        help="The Hugging Face model directory to compare with; for an adapter, its merged export or a "
        "PEFT adapter directory (run on the model its base was converted from).",
    ),
    base: Path | None = typer.Option(
        None, "--base", metavar="CKPT", help="A LoRA adapter's base checkpoint, when it moved since training."
    ),
    tolerance: float | None = typer.Option(
        None,
        "--tolerance",
        help="Largest allowed max abs logit error (default 1e-4 in float32, 1.0 otherwise).",
    ),
    mean_tolerance: float | None = typer.Option(
        None,
        "--mean-tolerance",
        help="Largest allowed mean abs logit error (default 0.01 float32, 0.1 otherwise).",
    ),
    dtype: FloatName | None = typer.Option(
        None, "--dtype", help="Compute dtype for both models (default: the checkpoint's dtype)."
    ),
    seq_len: int = typer.Option(64, "--seq-len", min=2, help="Tokens per sequence."),
    batch: int = typer.Option(2, "--batch", min=1, help="Sequences."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable summary on stdout."),
) -> int:
    """Run the checkpoint (megacore) and the HF model (transformers) on the same random tokens and
    compare logits; exit 1 above the tolerance.

    Example: mega-convert verify ckpt/mistral ./Mistral-7B-v0.1 --tolerance 1e-4
    """
    from mega_convert.verify import verify as run_verify

    r = run_verify(
        checkpoint,
        model_dir,
        dtype=dtype,
        tolerance=tolerance,
        mean_tolerance=mean_tolerance,
        batch=batch,
        seq_len=seq_len,
        base=base,
    )
    if as_json:
        typer.echo(json.dumps(r))
    else:
        typer.echo(
            f"{r['tokens']} tokens compared in {r['dtype']}, {r['dtype_from']}: "
            f"max abs logit error {r['max_abs_error']:.3g} "
            f"(tolerance {r['tolerance']:.3g}), mean {r['mean_abs_error']:.3g} "
            f"(tolerance {r['mean_tolerance']:.3g}), loss {r['loss_ours']:.6f} vs {r['loss_hf']:.6f} "
            f"(diff {r['loss_diff']:.3g}): {'PASS' if r['passed'] else 'FAIL'}"
        )
    return 0 if r["passed"] else 1


main = main_for(app, "mega-convert")
