"""Logits parity: the converted checkpoint in megacore's Decoder against the HF model in transformers,
on the same random tokens. Reports max / mean absolute logit error and the loss difference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mega_convert.convert import check_hf_tensors, read_hf_config, weight_files
from megacore.artifacts import TORCH_DTYPES
from megacore.artifacts.manifest import float_dtype
from megacore.checkpoint import CheckpointReader
from megacore.errors import UserError
from megacore.models import config_from_hf, mxfp4
from megacore.models.families import differences_from_hf

# Defaults: the bar (max abs error 1e-4 in fp32) and the seed document's mean-error bars.
DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 1.0, "float16": 1.0}
DEFAULT_MEAN_TOLERANCE = {"float32": 0.01, "bfloat16": 0.1, "float16": 0.1}


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
) -> dict[str, Any]:
    """Run both models in `dtype` (default: the checkpoint's, since a bf16 conversion held to fp32's
    tolerance fails on rounding alone); `passed` is False when max or mean error is above its
    tolerance."""
    model_dir = Path(model_dir)
    hf_json, at = read_hf_config(model_dir), str(model_dir / "config.json")
    hf_config = config_from_hf(hf_json, at)
    pairs = mxfp4.check_quantization(hf_json, at)  # MXFP4 experts (gpt-oss) are read dequantized
    # Everything transformers would trip over is checked first, as one-line errors: the same
    # architecture (vocab padding aside), and safetensors weights of the shapes config.json implies.
    with CheckpointReader(Path(checkpoint)) as ckpt:
        dtype, dtype_from = _dtype(ckpt, dtype, checkpoint)
        torch_dtype = TORCH_DTYPES[dtype]
        diff = differences_from_hf(ckpt.config, hf_config)
        if diff:
            raise UserError(
                f"the checkpoint's model config differs from {model_dir / 'config.json'} in {', '.join(diff)}",
                str(checkpoint),
            )
        check_hf_tensors(hf_config, weight_files(model_dir, mxfp4_pairs=pairs), model_dir)
        ours = ckpt.decoder(torch_dtype).eval()  # confirms the files' sums: no verdict on damaged ones
    hf = _load_transformers(model_dir, torch_dtype)
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


def _load_transformers(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The HF model in transformers (SDPA, or its family's `hf_attention`), without its progress
    bars and load reports on our output."""
    import transformers
    from transformers import AutoModelForCausalLM

    from megacore.models.families import hf_attention

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    impl = hf_attention(json.loads((model_dir / "config.json").read_text()).get("model_type"))
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=impl).eval()
