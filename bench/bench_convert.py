"""mega-convert on a 7B-shaped checkpoint: peak RSS and wall time against copying the same bytes.

The benchmark writes its own random bf16 Llama-2-7B-shaped HF checkpoint (32 layers, hidden 4096,
ffn 11008, vocab 32000: 13.5 GB in 3 safetensors shards + index) into bench-out/convert/ (git-ignored;
kept for reruns). Conversion and copy each run in a child process; peak RSS is the child's own
(benchlib's `launch`).
The copy baseline fsyncs its files, as the artifact writer does. When the disk has less free space than
two copies need (the source and one output at a time), the layer count is scaled down (said in the note). --quick: 2 layers, hidden 1024.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import torch

from benchlib import OUT, launch, main
from run import Row

ROOT = OUT / "convert"
SHARD_BYTES = 5 << 30

CONVERT = """
import sys, json, time
from mega_convert.convert import convert_hf
t = time.perf_counter()
s = convert_hf(sys.argv[1], sys.argv[2], force=True, log=lambda _: None, progress=False)
print(json.dumps({"seconds": time.perf_counter() - t, "tensors": s["tensors"]}))
"""
COPY = """
import os, shutil, sys, json, time
from pathlib import Path
t = time.perf_counter()
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir(parents=True, exist_ok=True)
for f in sorted(src.glob("*.safetensors")):
    shutil.copyfile(f, dst / f.name)
    with open(dst / f.name, "rb") as h:
        os.fsync(h.fileno())
print(json.dumps({"seconds": time.perf_counter() - t}))
"""


def hf_config(quick: bool, layers: int | None = None) -> dict:
    if quick:
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
                "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 2,
                "num_attention_heads": 8, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}  # fmt: skip
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
            "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": layers or 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}  # fmt: skip


def write_random_hf(out: Path, config: dict) -> int:
    """A random bf16 HF checkpoint, written shard by shard with bounded memory; returns its bytes."""
    from megacore.artifacts import SafetensorsStreamWriter
    from megacore.models import config_from_hf, hf_shapes

    marker = out / "bench-spec.json"
    if marker.is_file() and json.loads(marker.read_text()) == config:
        return sum(f.stat().st_size for f in out.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shapes = hf_shapes(config_from_hf(config))
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    block = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with SafetensorsStreamWriter(
            out / file, [(n, "bfloat16", shapes[n]) for n in names], {"format": "pt"}
        ) as w:
            for n in names:
                numel = math.prod(shapes[n])
                reps = block.repeat(math.ceil(numel / block.numel()))[:numel]  # random-looking, cheap
                w.write(n, reps.view(shapes[n]))
        weight_map.update(dict.fromkeys(names, file))
    total = sum(math.prod(s) * 2 for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(config))
    marker.write_text(json.dumps(config))
    return total


def _child(script: str, *args: Path) -> tuple[float, int]:
    """Run `script` in a fresh interpreter: (seconds of the work itself, its peak RSS in bytes)."""
    child = launch([sys.executable, "-c", script, *args])
    return child.result()["seconds"], child.rss


def run(quick: bool) -> list[Row]:
    ROOT.mkdir(parents=True, exist_ok=True)
    note = "7B-shaped (Llama-2-7B), bf16"
    config = hf_config(quick)
    if quick:
        note = "quick: 2 layers, hidden 1024"
    else:
        from megacore.models import config_from_hf, hf_shapes

        need = 2 * sum(math.prod(s) * 2 for s in hf_shapes(config_from_hf(config)).values())
        src = ROOT / "hf"
        have = shutil.disk_usage(ROOT).free + sum(f.stat().st_size for f in src.glob("*.safetensors"))
        if have < need * 1.1:
            layers = max(1, int(32 * have / (need * 1.1)))
            config = hf_config(quick, layers)
            note = f"disk short: scaled to {layers} of 32 layers"
    src = ROOT / ("hf-quick" if quick else "hf")
    total = write_random_hf(src, config)
    out, copy_dir = ROOT / "ckpt", ROOT / "copy"
    copy_s, copy_rss = _child(COPY, src, copy_dir)
    shutil.rmtree(copy_dir)
    conv_s, conv_rss = _child(CONVERT, src, out)
    shutil.rmtree(out)
    copy2_s, _ = _child(COPY, src, copy_dir)
    shutil.rmtree(copy_dir)
    copy_mean = (copy_s + copy2_s) / 2
    largest = 32000 * config["hidden_size"] * 2
    rss_gb = conv_rss / 2**30
    return [
        Row("convert", "wall time (s) vs copying the bytes", f"{conv_s:.1f}", f"{copy_mean:.1f}",
            copy_mean / conv_s, ">= 0.67x (1.5x copy time)", f"{note}, {total / 2**30:.1f} GiB, copy runs {copy_s:.1f}/{copy2_s:.1f}s"),
        Row("convert", "peak RSS (GiB)", f"{rss_gb:.2f}", f"{copy_rss / 2**30:.2f}", None,
            "< 1.5 GB", f"largest tensor {largest / 2**20:.0f} MiB; peer column = the copy process"),
    ]  # fmt: skip


if __name__ == "__main__":
    main(run)
