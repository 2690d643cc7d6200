"""Logits parity: the converted checkpoint in megacore's Decoder against the HF model in transformers,
on the same random tokens. Reports max / mean absolute logit error and the loss difference.

A LoRA adapter checkpoint runs on its base with its adapters as a run trains them
(`CheckpointReader.decoder`), against a Hugging Face model directory (its merged export, `mega-export
CKPT OUT`) or a PEFT adapter directory (the one `mega-convert peft` imported, or `mega-export
--adapter`'s), which PEFT runs on the Hugging Face model the base checkpoint was converted from."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mega_convert.convert import check_hf_tensors, language_model, read_hf_config, weight_files
from megacore.artifacts import TORCH_DTYPES
from megacore.artifacts.header import float_dtype
from megacore.checkpoint import CheckpointReader
from megacore.errors import UserError
from megacore.models import config_from_hf, mxfp4
from megacore.models.families import differences_from_hf

# Defaults: the bar (max abs error 1e-4 in fp32) and the seed document's mean-error bars.
DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 1.0, "float16": 1.0}
DEFAULT_MEAN_TOLERANCE = {"float32": 0.01, "bfloat16": 0.1, "float16": 0.1}
PEFT_CONFIG = "adapter_config.json"


def verify(
    checkpoint: Path,
    model_dir: Path,
    *,
    dtype: str | None = None,
    tolerance: float | None = None,
    mean_tolerance: float | None = None,
    batch: int = 2,
    seq_len: int = 64,
    seed: int = 0,
    base: Path | None = None,
) -> dict[str, Any]:
    """Run both models in `dtype` (default: the checkpoint's, since a bf16 conversion held to fp32's
    tolerance fails on rounding alone); `passed` is False when max or mean error is above its
    tolerance. `base`: a LoRA adapter's base checkpoint, where it is now (`--base`)."""
    # Everything transformers would trip over is checked first, as one-line errors: the same
    # architecture (vocab padding aside), and safetensors weights of the shapes config.json implies.
    with CheckpointReader(Path(checkpoint)) as ckpt:
        hf_dir, peft_dir = _compared(ckpt, Path(model_dir))
        hf_json, at = read_hf_config(hf_dir), str(hf_dir / "config.json")
        hf_config = config_from_hf(hf_json, at)
        pairs = mxfp4.check_quantization(hf_json, at)  # MXFP4 experts (gpt-oss) are read dequantized
        dtype, dtype_from = _dtype(ckpt, dtype, checkpoint)
        torch_dtype = TORCH_DTYPES[dtype]
        diff = differences_from_hf(ckpt.config, hf_config)
        if diff:
            raise UserError(
                f"the checkpoint's model config differs from {at} in {', '.join(diff)}", str(checkpoint)
            )
        check_hf_tensors(hf_config, language_model(hf_json, weight_files(hf_dir, mxfp4_pairs=pairs)), hf_dir)
        # Confirms the files' sums: no verdict on damaged ones.
        ours = ckpt.decoder(torch_dtype, base=base).eval()
    hf = _load_transformers(hf_dir, torch_dtype, peft_dir)
    ids = torch.randint(
        0, hf_config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed)
    )
    tol = DEFAULT_TOLERANCE[dtype] if tolerance is None else tolerance
    mean_tol = DEFAULT_MEAN_TOLERANCE[dtype] if mean_tolerance is None else mean_tolerance
    result = {
        "dtype": dtype,
        "dtype_from": dtype_from,
        **_errors(ours, hf, ids, hf_config.vocab_size),
        "tolerance": tol,
        "mean_tolerance": mean_tol,
    }
    result["loss_diff"] = abs(result["loss_ours"] - result["loss_hf"])
    result["passed"] = bool(result["max_abs_error"] <= tol and result["mean_abs_error"] <= mean_tol)
    return result


def _compared(ckpt: CheckpointReader, model_dir: Path) -> tuple[Path, Path | None]:
    """(the Hugging Face model directory transformers loads, the PEFT adapter directory PEFT puts on
    it or None): `model_dir` itself, or, for a PEFT adapter directory, the model the adapter
    checkpoint's base was converted from (its `hf_source`) under it."""
    if not (model_dir / PEFT_CONFIG).is_file():
        return model_dir, None
    info = ckpt.manifest.adapter
    if info is None:
        raise UserError(
            f"a PEFT adapter directory, and {ckpt.path} is a whole model: give a Hugging Face model directory",
            str(model_dir),
        )
    source = info.base.hf_source
    if source is None or not Path(source.path).is_dir():
        said = (
            "records no Hugging Face model"
            if source is None
            else f"was converted from {source.path}, not there now"
        )
        raise UserError(
            f"the adapter's base {said}, which PEFT's adapter would run on; compare with the adapter's "
            "merged export instead (mega-export CHECKPOINT OUT)",
            str(model_dir),
        )
    if importlib.util.find_spec("peft") is None:
        raise UserError(
            "a PEFT adapter directory needs peft to run, which is not installed (pip install peft)",
            str(model_dir),
        )
    return Path(source.path), model_dir


def _dtype(ckpt: CheckpointReader, dtype: str | None, checkpoint: Path) -> tuple[str, str]:
    """(the dtype both models run in, where it came from): `dtype` (either spelling), else the
    checkpoint's; a float dtype, or a UserError."""
    if dtype is None:
        dtype, dtype_from = ckpt.manifest.dtype, "the checkpoint's dtype"
    else:
        dtype, dtype_from = float_dtype(dtype), "from --dtype"
    if dtype not in DEFAULT_TOLERANCE:
        raise UserError(f"the checkpoint's dtype {dtype} is not a float dtype; pass --dtype", str(checkpoint))
    return dtype, dtype_from


def _errors(ours: torch.nn.Module, hf: torch.nn.Module, ids: torch.Tensor, vocab: int) -> dict[str, Any]:
    """Both models' logits on `ids` (ours without the padded vocab rows): their absolute error and
    each one's next-token loss."""
    with torch.no_grad():
        ref = hf(ids).logits.float()
        got = ours(ids)[..., :vocab].float()
    err = (got - ref).abs()

    def loss(logits: torch.Tensor) -> float:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()

    return {
        "tokens": ids.numel(),
        "max_abs_error": err.max().item(),
        "mean_abs_error": err.mean().item(),
        "loss_ours": loss(got),
        "loss_hf": loss(ref),
    }


def _load_transformers(model_dir: Path, dtype: torch.dtype, peft_dir: Path | None = None) -> torch.nn.Module:
    """The HF model in transformers (SDPA, or its family's `hf_attention`), with PEFT's adapter of
    `peft_dir` on it when given, without their progress bars and load reports on our output."""
    import transformers
    from transformers import AutoModelForCausalLM

    from megacore.models.families import hf_attention

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    impl = hf_attention(json.loads((model_dir / "config.json").read_text()).get("model_type"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=impl)
    if peft_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, peft_dir)
    return model.eval()
