"""A LoRA adapter checkpoint exported: merged into its base (W + scale · B A, a model transformers
loads alone) or as a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`)
that `peft.PeftModel.from_pretrained(base, OUT)` loads on the base's Hugging Face export.

The base is the checkpoint the adapter names (`Adapter.base`: its path then and its manifest's
sha256); `--base` says where it is now, and it must be that checkpoint (same sha256).
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
from megacore.checkpoint import CheckpointReader, adapter_base
from megacore.config import LORA_A, LORA_B, OPTIM_PREFIX
from megacore.errors import UserError
from megacore.models.adapters import adapter_settings, peft_names
from megacore.models.lora import merged


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


def open_weights(ckpt: CheckpointReader, adapter: bool, base: Path | None, stack: ExitStack) -> Weights:
    """The model tensors an export writes: the checkpoint's, or an adapter's merged into its base
    (opened on `stack`). `adapter`: a PEFT directory is asked for (the checkpoint must be one)."""
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

    def get(name: str) -> torch.Tensor:
        t = read_base(name)
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
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": _base_name(ckpt),
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
    return ["adapter_model.safetensors"], len(tensors)


def _base_name(ckpt: CheckpointReader) -> str:
    """The base model for PEFT's config (informational: `PeftModel.from_pretrained` takes the base
    model it is given): the base checkpoint's path as the adapter records it."""
    return ckpt.manifest.adapter.base.path
