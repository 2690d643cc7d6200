"""Checkpoint artifacts: the one place that writes and reads them (docs/architecture.md).

Writing (`CheckpointWriter`, inside `write_artifact(out, "checkpoint", ...)`, which applies the
output policy and stages the directory): `open_file` declares a safetensors file with the slices
of tensors it will hold, the caller streams them in, `close_file` records its checksum and each
piece's (`Piece.sha256`, hashed on a helper thread while written); `add_file`
copies tokenizer and other side files in; `commit` writes the manifest, whose tensor entries are
the pieces recorded on the way. mega-convert writes one file, mega-shard one per (stage, tp rank),
a training job one per rank (rank 0 `merge`s the others' `records`).

Reading (`CheckpointReader`): the manifest with its paths, files and pieces checked
(`open_artifact`), every tensor its config implies present with that shape (`check_model_tensors`),
and `read(name, box)`: any slice of any tensor from whatever layout the checkpoint has, reading
only the bytes the slice needs. mega-shard, mega-export, mega-convert verify and a training job
loading its shard all read through it. Files are checked while read, confirmed before anything
made from them is kept (`TensorReader`): each file's size when first opened, and on a helper
thread meanwhile the sha256 of each piece read (of the whole file for a checkpoint without piece
sums); `confirm()` waits for the sums and raises `DamagedFile` for a damaged file. A reader vouches
for what it reads: damage to a piece it does not read (an optimizer moment, on export) is not its
to see, `--verify sha256` checks whole files.
mega-shard and mega-export confirm before committing their output, a training job's load and
`decoder()` before they return; `close()` and leaving a `with` block without an error confirm too.

File names: one scheme for every layout, `shard_file`.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import msgspec
import torch

from megacore.artifacts import (
    MANIFEST_NAME,
    ArtifactWriter,
    Box,
    CheckpointManifest,
    Piece,
    SafetensorsStreamWriter,
    TensorEntry,
    TensorReader,
    dtype_name,
    new_header_fields,
    open_artifact,
    piece_entry,
)
from megacore.artifacts.header import Parent
from megacore.artifacts.manifest import Adapter, HFSource, Layout, License, TrainedTokenizer, TrainingState
from megacore.artifacts.reader import (
    Verify,
    artifact_root,
    base_paths,
    base_record,
    check_model_tensors,
    read_manifest_bytes,
)
from megacore.artifacts.writer import sha256_bytes
from megacore.config import ModelConfig, is_adapter_tensor
from megacore.errors import UserError
from megacore.models import Decoder
from megacore.models.adapters import adapter_settings, modules
from megacore.models.lora import add_lora

# A slice of a tensor that a file holds: (tensor name, global shape, dtype, box).
Slice = tuple[str, Sequence[int], str, Box]

# Whether a CheckpointWriter records each piece's sha256 (`Piece.sha256`). Only
# bench/bench_checkpoint.py turns it off, to measure what the sums cost a save; nothing else may.
PIECE_SHA256 = True


def shard_file(pp: int, tp: int, dp: int | None = None) -> str:
    """`model-pp{stage}-tp{rank}.safetensors`, with `-dp{rank}` when the layout also splits tensors
    over data-parallel ranks (FSDP shards of a training job): one scheme for every layout."""
    return f"model-pp{pp:02d}-tp{tp:02d}" + ("" if dp is None else f"-dp{dp:02d}") + ".safetensors"


class CheckpointWriter:
    """Builds a checkpoint artifact in the staging directory of an `ArtifactWriter`."""

    def __init__(self, w: ArtifactWriter) -> None:
        self.w = w
        self.files: list[str] = []
        self.bytes_written = 0
        self._sums: list[tuple[str, str, int]] = []  # (file, sha256, size) of the files written here
        self._tensors: dict[str, tuple[list[int], str, list[Piece]]] = {}
        self._open: dict[str, list[Piece]] = {}  # a file's pieces, given their sums at close_file

    def open_file(
        self, file: str, slices: Sequence[Slice], metadata: dict | None = None
    ) -> SafetensorsStreamWriter:
        """Declare `file` and the slices it holds, in the order they will be written."""
        decl = []
        self._open[file] = []
        for name, shape, dtype, (offset, size) in slices:
            decl.append((name, dtype, list(size)))
            piece = Piece(file=file, key=name, offset=list(offset), shape=list(size))
            self._tensors.setdefault(name, (list(shape), dtype, []))[2].append(piece)
            self._open[file].append(piece)
        return SafetensorsStreamWriter(self.w.path(file), decl, metadata, piece_sums=PIECE_SHA256)

    def close_file(self, file: str, sw: SafetensorsStreamWriter) -> None:
        """Finish `file`: its sha256 and size into `$.files`, each piece's sha256 into its piece."""
        sha = sw.close()
        sums = sw.piece_sha256s() if PIECE_SHA256 else {}
        for piece in self._open.pop(file):
            piece.sha256 = sums.get(piece.key)
        self.w.record(file, sha, sw.size)
        self._sums.append((file, sha, sw.size))
        self.files.append(file)
        self.bytes_written += sw.size

    def write_file(self, file: str, tensors: Sequence[tuple[str, Sequence[int], Box, torch.Tensor]]) -> None:
        """A whole file at once: (name, global shape, box, local tensor) per slice, in memory."""
        slices = [(n, shape, dtype_of(t), box) for n, shape, box, t in tensors]
        sw = self.open_file(file, slices)
        for n, _, _, t in tensors:
            sw.write(n, t)
        self.close_file(file, sw)

    def add_file(self, src: Path, relpath: str) -> str:
        """Copy a side file (tokenizer, RNG state) into the artifact as `relpath`."""
        shutil.copyfile(src, self.w.path(relpath))
        return relpath

    def add_tokenizer(self, root: Path, tokenizer: TrainedTokenizer) -> TrainedTokenizer:
        """Copy the files of a tokenizer recorded relative to `root` (a tokens artifact or another
        checkpoint) into `tokenizer/`; returns the record with the new paths."""
        files = [self.add_file(root / rel, f"tokenizer/{Path(rel).name}") for rel in tokenizer.info.files]
        return msgspec.structs.replace(tokenizer, info=msgspec.structs.replace(tokenizer.info, files=files))

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def records(self) -> tuple[list[tuple[str, str, int]], dict[str, tuple[list[int], str, list[Piece]]]]:
        """What this writer wrote (checksums and pieces), for the process that commits."""
        return list(self._sums), dict(self._tensors)

    def merge(
        self, records: tuple[list[tuple[str, str, int]], dict[str, tuple[list[int], str, list[Piece]]]]
    ) -> None:
        """Add another process's `records` (same staging directory, other files)."""
        sums, tensors = records
        for file, sha, size in sums:
            self.w.record(file, sha, size)
            self.files.append(file)
            self.bytes_written += size
        for name, (shape, dtype, pieces) in tensors.items():
            self._tensors.setdefault(name, (shape, dtype, []))[2].extend(pieces)

    def commit(
        self,
        *,
        config: ModelConfig,
        dtype: str,
        layout: Layout,
        producer: tuple[str, str],
        parents: Sequence[Parent] = (),
        tokenizer_files: Sequence[str] = (),
        tokenizer: TrainedTokenizer | None = None,
        training: TrainingState | None = None,
        license: License | None = None,
        order: Sequence[str] | None = None,
        adapter: Adapter | None = None,
        hf_source: HFSource | None = None,
    ) -> CheckpointManifest:
        """Write the manifest (tensors in `order`, default as declared) and move the artifact in."""
        names = list(self._tensors) if order is None else list(order)
        tensors = {n: piece_entry(*self._tensors[n]) for n in names}
        manifest = CheckpointManifest(
            **new_header_fields(*producer),
            parents=list(parents),
            config=config,
            dtype=dtype,
            layout=layout,
            tensors=tensors,
            tokenizer_files=list(tokenizer_files),
            tokenizer=tokenizer,
            training=training,
            license=license,
            adapter=adapter,
            hf_source=hf_source,
        )
        return self.w.commit(manifest)


def dtype_of(t: torch.Tensor) -> str:
    return dtype_name(t.dtype)


class CheckpointReader:
    """A checkpoint artifact opened for reading slices. On opening: its paths, files (as `verify`
    says: all of them, before anything is read) and pieces, and the tensors against its config;
    what is read is also hashed while read (each piece, or the whole file for a checkpoint without
    piece sums) unless `verify="sha256"` already hashed the file: `confirm()` before keeping
    anything made from what was read (see the module's docstring)."""

    def __init__(self, path: Path, verify: Verify = "size") -> None:
        self.path = Path(path)
        self.manifest = open_artifact(self.path, "checkpoint", verify=verify)
        self.root = artifact_root(self.path)
        check_model_tensors(self.manifest, str(self.root / MANIFEST_NAME))
        files = self.manifest.files
        verified = [e.path for e in files] if verify == "sha256" else []
        self._reader = TensorReader(self.root, files, verified)

    @property
    def config(self) -> ModelConfig:
        return self.manifest.config

    def entry(self, name: str) -> TensorEntry:
        entry = self.manifest.tensors.get(name)
        if entry is None:
            raise UserError(f"tensor {name!r} is not in the checkpoint", str(self.path))
        return entry

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        """The slice `box` (offset, shape) of tensor `name`; the whole tensor when None."""
        return self._reader.read(name, self.entry(name), box)

    def decoder(
        self, dtype: torch.dtype | None = None, base: Path | None = None, option: str = "--base"
    ) -> Decoder:
        """A whole Decoder with this checkpoint's weights (one process); optimizer moments and other
        training state are left out. A LoRA adapter's: its base's Decoder (`base`, the tool's
        `option`, else where the adapter says: `adapter_base`) with the adapters on its linears as
        a run trains them (`megacore.models.lora`), not merged."""
        info = self.manifest.adapter
        if info is None and base is not None:
            raise UserError(f"{self.path} is not a LoRA adapter; it has no base", option)
        if info is not None:
            with CheckpointReader(adapter_base(self.path, info, base, option)) as base_ckpt:
                model = base_ckpt.decoder()
            lora = adapter_settings(info)
            add_lora(model, modules(self.config, lora.targets), lora.rank, lora.scale)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if is_adapter_tensor(name):
                        p.copy_(self.read(name))
        else:
            with torch.device("meta"):
                model = Decoder(self.config)
            model.to_empty(device="cpu")
            model.load_state_dict({name: self.read(name) for name in model.state_dict()}, strict=True)
        self.confirm()
        return model if dtype is None else model.to(dtype)

    def confirm(self) -> None:
        """Wait for the sums of what was read so far: `DamagedFile` naming the first damaged file (and
        tensor). Call it before keeping (committing, returning) anything made from what was read."""
        self._reader.confirm()

    def release(self) -> None:
        """Unmap the files read so far: pages of a mapping left open count as resident memory, so
        a reader streaming a large model calls this between tensors or blocks (their sums go on)."""
        self._reader.release()

    def close(self) -> None:
        """`confirm`, then let go of the files."""
        self._reader.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self._reader.__exit__(exc_type, *rest)


def adapter_base(adapter: Path, info: Adapter, given: Path | None, option: str) -> Path:
    """A LoRA adapter checkpoint's base: `given` (the tool's `option`, for a base that moved since
    training) or where the adapter says (`base_paths`: relative to the adapter, then absolute),
    checked to be the one it names (its manifest's sha256)."""
    tried = [Path(given)] if given is not None else base_paths(adapter, info.base)
    where = option if given is not None else str(adapter)
    there = [p for p in tried if (p / MANIFEST_NAME).is_file()]
    for path in there:
        if sha256_bytes(read_manifest_bytes(path)[1]) == info.base.manifest_sha256:
            return path
    if not there:
        shown = tried[0] if given is not None else info.base.path
        raise UserError(
            f"the adapter's base checkpoint {shown} is not there; give where it is now with {option}", where
        )
    raise UserError(f"{there[0]} is not the adapter's base checkpoint (its manifest differs)", where)


def adapter_copied(adapter: Path, info: Adapter, out: Path) -> Adapter:
    """What a copy at `out` of the adapter checkpoint `adapter` (resharded: mega-shard) records: the
    same base, found as `adapter_base` finds it and recorded relative to `out`; a base not found
    keeps its absolute path alone (the relative one was from `adapter`)."""
    base = info.base
    try:
        found = adapter_base(adapter, info, None, "--base")
    except UserError:
        return msgspec.structs.replace(info, base=msgspec.structs.replace(base, relative=None))
    moved = base_record(found, base.manifest_sha256, out, base.hf_source)
    return msgspec.structs.replace(info, base=moved)
