"""A checkpoint as a model to run forward in any layout outside a run (lm-eval's `mega` model,
`harness.py`): the mesh from `tp`, `pp`, `cp`, `ep` (dp the rest of the world, every replica
computing alike), the weights loaded as a run loads its `init`, and the tokenizer mega-export
would write beside them. A LoRA adapter checkpoint runs on its base (`base=` where it moved since
training), its adapters applied beside the frozen linears as in training, dropout off.
"""

from __future__ import annotations

import typing
from pathlib import Path

from megacore.artifacts import open_artifact
from megacore.artifacts.manifest import CheckpointManifest
from megacore.artifacts.run_spec import ParallelSpec
from megacore.checkpoint import CheckpointReader, adapter_base
from megacore.config import LoRA, is_adapter_tensor
from megacore.errors import UserError
from megacore.models.adapters import adapter_settings
from megacore.models.hf_tokenizer import checkpoint_tokenizer_files, load_tokenizer
from megacore.parallel.checkpoint_io import load_checkpoint
from megacore.parallel.engine import ParallelModel
from megacore.parallel.layout import Parallelism, check_parallelism, check_sharding
from megacore.parallel.mesh import build_mesh, device_type, dp_mesh

LAYOUT = ("tp", "pp", "cp", "ep")
CHOICES = {"precision": ("fp32", "bf16", "fp16"), "attention": ("auto", "sdpa", "flash")}


def _settings(args: dict[str, str], where: str) -> tuple[ParallelSpec, str, str]:
    """The layout, precision and attention kernel `args` name (lm-eval's `--model_args`)."""
    known = ["pretrained", "base", *LAYOUT, *CHOICES]
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise UserError(f"unknown model argument {unknown[0]!r} (known: {', '.join(known)})", where)
    sizes = {}
    for name in LAYOUT:
        value = args.get(name, "1")
        if not value.isdigit() or int(value) < 1:
            raise UserError(f"{name}={value}: expected a positive integer", where)
        sizes[name] = int(value)
    picked = {"precision": "bf16" if device_type() == "cuda" else "fp32", "attention": "auto"}
    for name, allowed in CHOICES.items():
        picked[name] = args.get(name, picked[name])
        if picked[name] not in allowed:
            raise UserError(f"{name}={picked[name]}: expected one of {', '.join(allowed)}", where)
    return ParallelSpec(**sizes), picked["precision"], picked["attention"]


def open_checkpoint_model(args: dict[str, str]) -> tuple[ParallelModel, typing.Any]:
    """(this rank's part of the model of the checkpoint `args["pretrained"]` (lm-eval's name for
    what to evaluate, which also names its results' folder), loaded; its tokenizer)."""
    where = "--model_args"
    if "pretrained" not in args:
        raise UserError("pretrained=DIR is required (a mega checkpoint artifact)", where)
    path = Path(args["pretrained"])
    spec, precision, attention = _settings(args, where)
    manifest = open_artifact(path, "checkpoint")
    base, lora = _adapter(path, manifest, args.get("base"), where)
    par = Parallelism(spec, precision, attention=attention, lora=lora)
    check_parallelism(manifest.config, par, f"{where}: tp/pp/cp/ep")
    mesh = build_mesh(spec.tp, spec.pp, spec.cp, spec.ep)
    check_sharding(manifest.config, par, par.dims(dp_mesh(mesh).size()), f"{where}: tp/pp/cp/ep")
    device = "cuda" if device_type() == "cuda" else "cpu"
    pm = ParallelModel(manifest.config, par, mesh, device)
    if base is not None:  # the frozen base from its checkpoint, the adapters from theirs
        load_checkpoint(base, pm, only=lambda name: not is_adapter_tensor(name))
        load_checkpoint(path, pm, only=is_adapter_tensor)
    else:
        load_checkpoint(path, pm)
    with CheckpointReader(path) as ckpt:
        try:
            files = checkpoint_tokenizer_files(ckpt.root, ckpt.manifest, ckpt.config)
        except ValueError as e:
            raise UserError(f"tokenizer: {e}", str(path)) from None
    return pm, load_tokenizer(files)


def _adapter(
    path: Path, manifest: CheckpointManifest, given: str | None, where: str
) -> tuple[Path | None, LoRA | None]:
    """A LoRA adapter checkpoint's base and adapters' settings (dropout off: evaluation; a QLoRA
    adapter's base in NF4, as it trained); (None, None) for a whole model, which takes no `base=`."""
    info = manifest.adapter
    if info is None:
        if given is not None:
            raise UserError(f"base={given}: {path} is not a LoRA adapter; it has no base", where)
        return None, None
    base = adapter_base(path, info, None if given is None else Path(given), "base=")
    return base, adapter_settings(info, base_dtype=info.base_dtype)  # QLoRA's base: NF4, as trained
