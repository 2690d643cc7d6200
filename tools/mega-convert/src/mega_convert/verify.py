"""Logits parity: the converted checkpoint in megacore's Decoder against the HF model in transformers,
on the same random tokens. Reports max / mean absolute logit error and the loss difference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mega_convert.convert import read_hf_config, weight_files
from megacore.artifacts.layout import TORCH_DTYPES
from megacore.errors import UserError
from megacore.models import config_from_hf, load_decoder

# Defaults: the bar (max abs error 1e-4 in fp32) and the seed document's mean-error bars.
DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 1.0, "float16": 1.0}
DEFAULT_MEAN_TOLERANCE = {"float32": 0.01, "bfloat16": 0.1, "float16": 0.1}


def verify(
    checkpoint: Path,
    model_dir: Path,
    *,
    dtype: str = "float32",
    tolerance: float | None = None,
    mean_tolerance: float | None = None,
    batch: int = 2,
    seq_len: int = 64,
    seed: int = 0,
) -> dict[str, Any]:
    """Run both models; `passed` is False when max or mean error is above its tolerance."""
    from transformers import AutoModelForCausalLM

    if dtype not in TORCH_DTYPES or dtype not in DEFAULT_TOLERANCE:
        raise UserError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    torch_dtype = TORCH_DTYPES[dtype]
    hf_config = config_from_hf(read_hf_config(Path(model_dir)), str(Path(model_dir) / "config.json"))
    weight_files(Path(model_dir))  # the same safetensors-only rule as conversion, before loading
    ours = load_decoder(Path(checkpoint), torch_dtype).eval()
    if ours.config.vocab_size != hf_config.vocab_size or ours.config.num_layers != hf_config.num_layers:
        raise UserError(
            "the checkpoint's config does not match config.json (vocab size / layers)", str(checkpoint)
        )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, attn_implementation="sdpa").eval()
    vocab = hf_config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = hf(ids).logits.float()
        got = ours(ids)[..., :vocab].float()
    err = (got - ref).abs()

    def loss(logits: torch.Tensor) -> float:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()

    tol = DEFAULT_TOLERANCE[dtype] if tolerance is None else tolerance
    mean_tol = DEFAULT_MEAN_TOLERANCE[dtype] if mean_tolerance is None else mean_tolerance
    result = {
        "dtype": dtype,
        "tokens": batch * seq_len,
        "max_abs_error": err.max().item(),
        "mean_abs_error": err.mean().item(),
        "loss_ours": loss(got),
        "loss_hf": loss(ref),
        "tolerance": tol,
        "mean_tolerance": mean_tol,
    }
    result["loss_diff"] = abs(result["loss_ours"] - result["loss_hf"])
    result["passed"] = bool(result["max_abs_error"] <= tol and result["mean_abs_error"] <= mean_tol)
    return result
