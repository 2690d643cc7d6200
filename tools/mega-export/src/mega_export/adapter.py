"""A LoRA adapter checkpoint exported: merged into its base (W + scale · B A, a model transformers
loads alone) or as a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`)
that `peft.PeftModel.from_pretrained(base, OUT)` loads on the base's Hugging Face model, and
`AutoPeftModelForCausalLM.from_pretrained(OUT)` on the one its `base_model_name_or_path` names
(the Hugging Face model the base was converted from: `_base_model`).

The base is the checkpoint the adapter names (`Adapter.base`: its path, relative to the adapter
and absolute, and its manifest's sha256); `--base` says where it is now, and it must be that
checkpoint (same sha256).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from megacore.artifacts import TORCH_DTYPES, ArtifactWriter
from megacore.artifacts.manifest import Adapter, BaseModel
from megacore.checkpoint import CheckpointReader, adapter_base
from megacore.config import LORA_A, LORA_B, OPTIM_PREFIX, is_block_projection
from megacore.errors import UserError
from megacore.models.adapters import adapter_settings, peft_names
from megacore.models.lora import merged
from megacore.models.nf4 import dequantized


@dataclass
class Weights:
    """Where an export's model tensors come from: `get(name)` (a whole tensor), and the base
    checkpoint read beside an adapter (None for a whole model)."""

    get: Callable[[str], torch.Tensor]
    confirm: Callable[[], None]
    base: Path | None = None


def _reader(ckpt: CheckpointReader) -> Callable[[str], torch.Tensor]:
    def get(name: str) -> torch.Tensor:
        t = ckpt.read(name)
        ckpt.release()  # unmap: pages of a mapping left open count as resident (RSS ~ model)
        return t

    return get


def merge_target(ckpt: CheckpointReader, adapter: bool, merge_into: str | None) -> str | None:
    """What an adapter is merged into (`--merge-into`): the base as QLoRA trained against it (nf4,
    the default for a QLoRA adapter) or as stored (original, any other's default); None when
    nothing is merged (a whole model, or a PEFT directory)."""
    info = ckpt.manifest.adapter
    if info is None or adapter:
        if merge_into is not None:
            what = "a PEFT adapter directory is not merged" if adapter else "it holds a whole model"
            raise UserError(f"{ckpt.path}: {what}; leave --merge-into out", "--merge-into")
        return None
    if merge_into == "nf4" and info.base_dtype != "nf4":
        raise UserError(
            f"{ckpt.path} was trained on its base as stored, not on an NF4 one (QLoRA); merge it into "
            "the original",
            "--merge-into",
        )
    return merge_into or ("nf4" if info.base_dtype == "nf4" else "original")


def open_weights(
    ckpt: CheckpointReader, adapter: bool, base: Path | None, stack: ExitStack, merge_into: str | None = None
) -> Weights:
    """The model tensors an export writes: the checkpoint's, or an adapter's merged into its base
    (opened on `stack`; `merge_into` nf4: the base's block projections as QLoRA held them, its NF4
    round trip). `adapter`: a PEFT directory is asked for (the checkpoint must be one)."""
    info = ckpt.manifest.adapter
    if adapter and info is None:
        raise UserError(f"{ckpt.path} holds a whole model, not a LoRA adapter", "--adapter")
    if info is None:
        if base is not None:
            raise UserError(f"{ckpt.path} is not a LoRA adapter; it has no base", "--base")
        return Weights(_reader(ckpt), ckpt.confirm)
    path = adapter_base(ckpt.path, info, base, "--base")
    if adapter:
        return Weights(_reader(ckpt), ckpt.confirm, path)
    base_ckpt = stack.enter_context(CheckpointReader(path))
    read_base = _reader(base_ckpt)
    scale = adapter_settings(info).scale
    nf4_blocks = info.nf4 if merge_into == "nf4" else None

    def get(name: str) -> torch.Tensor:
        t = read_base(name)
        if nf4_blocks is not None and is_block_projection(name):
            t = dequantized(t, nf4_blocks.block, nf4_blocks.scaler_block)
        module = name.removesuffix(".weight")
        if f"{module}.{LORA_A}" in ckpt.manifest.tensors:
            t = merged(t, ckpt.read(f"{module}.{LORA_A}"), ckpt.read(f"{module}.{LORA_B}"), scale)
        return t

    def confirm() -> None:
        ckpt.confirm()
        base_ckpt.confirm()

    return Weights(get, confirm, path)


def write_peft(ckpt: CheckpointReader, w: ArtifactWriter, dtype: str) -> tuple[list[str], int]:
    """The adapter as PEFT saves one: its tensors under PEFT's names and its config; (the files,
    the tensors)."""
    info, config = ckpt.manifest.adapter, ckpt.config
    names = peft_names(config)
    tensors = {}
    for name in ckpt.manifest.tensors:
        if name.startswith(OPTIM_PREFIX):  # the moments stay behind
            continue
        module, _, tensor = name.rpartition(".lora_")
        tensors[f"{names[module]}.lora_{tensor}"] = ckpt.read(name).to(TORCH_DTYPES[dtype]).contiguous()
    save_file(tensors, w.path("adapter_model.safetensors"), metadata={"format": "pt"})
    base, revision = _base_model(info.base)
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "revision": revision,
        "r": info.rank,
        "lora_alpha": info.alpha,
        "lora_dropout": info.dropout,
        "target_modules": sorted(info.targets),
        "use_rslora": info.rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    w.path("adapter_config.json").write_text(json.dumps(peft_config, indent=2) + "\n")
    if info.base_dtype == "nf4":  # PEFT's config has no field for it: the side file says it
        w.path(BASE_QUANTIZATION).write_text(json.dumps(base_quantization(info), indent=2) + "\n")
    return ["adapter_model.safetensors"], len(tensors)


BASE_QUANTIZATION = "base_quantization.json"  # beside a QLoRA adapter's adapter_config.json


def base_quantization(info: Adapter) -> dict:
    """How the base a QLoRA adapter trained against was held, in bitsandbytes' terms (what
    `BitsAndBytesConfig` users load a base with), and torchao's tensor it was."""
    return {
        "base_dtype": "nf4",
        "quant_type": "nf4",
        "blocksize": info.nf4.block,
        "double_quant": True,
        "double_quant_blocksize": info.nf4.scaler_block,
        "quantized_from": "float32",
        "layers": "every block's q/k/v/o and gate/up/down projection, each tensor whole",
        "library": "torchao NF4Tensor (to_nf4)",
    }


def _base_model(base: BaseModel) -> tuple[str, str | None]:
    """The model PEFT's `AutoPeftModelForCausalLM` loads under the adapter (`base_model_name_or_path`,
    `revision`): the Hugging Face model the base checkpoint was converted from, its Hub id at its
    commit, else its directory; the base checkpoint's path when it records none (a trained base,
    or one converted before it was recorded: load the adapter on the base's own export then)."""
    source = base.hf_source
    if source is None:
        return base.path, None
    return (source.repo, source.revision) if source.repo else (source.path, None)
