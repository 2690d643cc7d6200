"""Hugging Face datasets as input: `hf://datasets/ORG/NAME[@REVISION]` on the Hub, a directory
written by `save_to_disk` (a Dataset, or a DatasetDict with a folder per split), or a dataset
repository's directory (its data files and a README.md whose YAML front matter declares `configs:`).

A `save_to_disk` directory is its Arrow stream files, in the order state.json lists them, read as
Parquet files are (inputs.py: pyarrow only, a record batch at a time). A repository, local or on
the Hub, is read through `datasets` in streaming mode: `load_dataset_builder` then
`as_streaming_dataset`, which is what `load_dataset(path, name=subset, split=split,
streaming=True)` runs, so memory does not grow with the dataset. Offline (HF_HUB_OFFLINE=1),
`datasets` 5 does not look in the Hub's cache for a dataset named by its id (only in its own cache
of prepared Arrow files, which streaming never writes), so the snapshot is found with
huggingface_hub (`refs/main` -> `snapshots/<commit>/`) and read as the local repository it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mega_tokenize.inputs import RowBatch, read_tables
from megacore.artifacts import manifest as mf
from megacore.artifacts.reader import hub_snapshot
from megacore.errors import UserError

HUB = "hf://datasets/"
EXTRA = "pip install 'mega-tokenize[datasets]'"
_COMMIT = re.compile(r"[0-9a-f]{40}")
_ROWS = 1000  # rows per table taken from `datasets` (its own default batch size)


@dataclass
class DatasetSource:
    """A dataset input resolved: what the manifest records, the local files it is read from (a
    saved dataset's Arrow files, read as files; a repository's data files of the split), and for a
    repository the split as `datasets` streams it, with its schema."""

    record: mf.InputDataset
    files: list[Path]
    label: str  # where its rows are, in messages
    stream: object | None = None  # a datasets.IterableDataset; None: read `files`
    schema: object | None = None  # the stream's pyarrow schema

    def rows(self, columns: list[str], batch_bytes: int | Callable[[int], int]) -> Iterator[RowBatch]:
        """The streamed split's rows of `columns`, in batches of about `batch_bytes`."""
        return read_tables(self.label, _tables(self.stream, columns, self.label), columns, batch_bytes)


def dataset_kind(spec: str) -> str | None:
    """`hub`, `saved` or `repository` when the input names a dataset, else None (files)."""
    if spec.startswith("hf://"):
        return "hub"
    d = Path(spec)
    if not d.is_dir():
        return None
    if (d / "dataset_dict.json").is_file() or (d / "state.json").is_file():
        return "saved"
    if _snapshot_commit(d) or _declares_configs(d / "README.md") or (d / f"{_repo_name(d)}.py").is_file():
        return "repository"
    return None


def open_dataset(spec: str, subset: str | None, split: str | None) -> DatasetSource:
    """The dataset `spec` names (see `dataset_kind`), its subset and split chosen and checked."""
    kind = dataset_kind(spec)
    if kind == "hub":
        return _hub(spec, subset, split)
    if kind == "saved":
        return _saved(Path(spec), spec, subset, split)
    return _repository(Path(spec), spec, subset, split, "repository")


def _declares_configs(readme: Path) -> bool:
    """A dataset card whose YAML front matter has `configs:` (read without a YAML library)."""
    try:
        text = readme.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    if not text.startswith("---"):
        return False
    end = text.find("\n---", 3)
    return end > 0 and re.search(r"^configs\s*:", text[3:end], re.MULTILINE) is not None


def _snapshot_commit(d: Path) -> str | None:
    """The commit of a Hub cache snapshot (`datasets--ORG--NAME/snapshots/<commit>`), else None."""
    snapshot = hub_snapshot(d, "datasets")
    return snapshot[1] if snapshot is not None else None


def _repo_name(d: Path) -> str:
    """The dataset's name: a snapshot's repository's, else the directory's (a loading script's)."""
    snapshot = hub_snapshot(d, "datasets")
    return snapshot[0].rpartition("/")[2] if snapshot is not None else d.name


def _one_line(e: BaseException) -> str:
    """A library's error message on one line (up to its usage example, where it gives one)."""
    text = str(e).split("Example of usage")[0]
    return " ".join(text.split()) or type(e).__name__


# --- save_to_disk: Arrow files, pyarrow only -----------------------------------------------------


def _saved(d: Path, spec: str, subset: str | None, split: str | None) -> DatasetSource:
    if subset is not None:
        raise UserError("a dataset written by save_to_disk has no subsets; drop --subset", spec)
    if (d / "dataset_dict.json").is_file():
        splits = _json(d / "dataset_dict.json").get("splits", [])
        split = split or "train"
        if split not in splits:
            have = ", ".join(f'"{s}"' for s in splits)
            raise UserError(f'no split "{split}" (it has {have}; choose one with --split)', spec)
        files = _arrow_files(d / split)
    else:
        own = _json(d / "state.json").get("_split")
        if split is not None and split != own:
            said = f'its split "{own}"' if own else "no split name"
            raise UserError(f"this is one Dataset ({said}), not a DatasetDict of splits; drop --split", spec)
        split, files = own, _arrow_files(d)
    record = mf.InputDataset(path=spec, kind="saved", split=split)
    return DatasetSource(record, files, spec)


def _json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot be read as save_to_disk's JSON ({e})", str(path)) from None
    if not isinstance(obj, dict):
        raise UserError("expected a JSON object", str(path))
    return obj


def _arrow_files(d: Path) -> list[Path]:
    """A saved Dataset's Arrow stream files, in its state.json's order (the rows' order)."""
    state = d / "state.json"
    entries = _json(state).get("_data_files")
    if not isinstance(entries, list) or not entries:
        raise UserError("lists no data files (_data_files)", str(state))
    files = []
    for entry in entries:
        f = d / str(entry.get("filename", "")) if isinstance(entry, dict) else d
        if not f.is_file() or f.parent != d:
            raise UserError(f"lists {entry}, which is not a file of {d}", str(state))
        files.append(f)
    return files


# --- repositories, local or on the Hub: through `datasets`, streamed -----------------------------


def _datasets(where: str):
    """The `datasets` library (the extra), quiet: its progress bars and notes are not ours to show."""
    try:
        import datasets
    except ImportError:
        raise UserError(f"reading this dataset needs the datasets library: {EXTRA}", where) from None
    import huggingface_hub

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors are raised, and said once
    huggingface_hub.utils.logging.set_verbosity_error()  # its retry notes; an error is ours to say
    return datasets


def _refuse_script(d: Path, where: str) -> None:
    script = d / f"{_repo_name(d)}.py"
    if script.is_file():
        raise UserError(_script_message(script.name), where)


def _script_message(name: str) -> str:
    return (
        f"the dataset needs remote code (its loading script {name}), which is never run; "
        "use its data files (Parquet, jsonl) instead"
    )


def _repository(d: Path, spec: str, subset: str | None, split: str | None, kind: str) -> DatasetSource:
    """A repository's directory (a Hub snapshot's too: its commit is the revision), streamed."""
    _refuse_script(d, spec)
    return _streamed(str(d), spec, subset, split, kind, commit=_snapshot_commit(d))


def _hub(spec: str, subset: str | None, split: str | None) -> DatasetSource:
    if not spec.startswith(HUB):
        raise UserError(f"expected {HUB}ORG/NAME (only Hub datasets are read from hf://)", spec)
    repo, _, revision = spec.removeprefix(HUB).partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise UserError(f"expected {HUB}ORG/NAME[@REVISION]", spec)
    datasets = _datasets(spec)
    if datasets.config.HF_HUB_OFFLINE and (snapshot := _cached_snapshot(repo, revision or None)):
        return _repository(snapshot, spec, subset, split, "hub")
    return _streamed(repo, spec, subset, split, "hub", revision=revision or None)


def _cached_snapshot(repo: str, revision: str | None) -> Path | None:
    """The Hub cache's snapshot of the dataset at `revision` (a branch, tag or commit), if any."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        found = snapshot_download(repo, repo_type="dataset", revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        return None
    return Path(found)


def _streamed(
    path: str,
    spec: str,
    subset: str | None,
    split: str | None,
    kind: str,
    revision: str | None = None,
    commit: str | None = None,
) -> DatasetSource:
    """`load_dataset(path, name=subset, split=split, revision=revision, streaming=True)` in its two
    steps, so that the builder tells the subset chosen, the data files and, on the Hub, the commit
    it resolved (`commit`: already known, a snapshot's)."""
    datasets = _datasets(spec)
    split = split or "train"
    try:
        builder = datasets.load_dataset_builder(path, name=subset, revision=revision)
    except RuntimeError as e:  # datasets 5 refuses loading scripts this way
        if "scripts" not in str(e):
            raise
        raise UserError(_script_message(f"{path.split('/')[-1]}.py"), spec) from None
    except (ValueError, OSError) as e:
        hint = " (choose one with --subset)" if "config" in str(e).lower() else ""
        raise UserError(_one_line(e) + hint, spec) from None
    try:
        with _without_torch(datasets):
            stream = builder.as_streaming_dataset(split=split)
    except (ValueError, KeyError, OSError) as e:
        hint = " (choose one with --split)" if "split" in str(e).lower() else ""
        raise UserError(_one_line(e) + hint, spec) from None
    if _COMMIT.fullmatch(str(builder.hash)):
        commit = builder.hash  # the commit the Hub resolved: datasets' module hash for a Hub repository
    record = mf.InputDataset(path=spec, kind=kind, revision=commit, subset=builder.config.name, split=split)
    label = f"{spec} (subset {builder.config.name}, split {split})"
    files = [Path(f) for f in (builder.config.data_files or {}).get(split, []) if Path(f).is_file()]
    return DatasetSource(record, files, label, stream, _schema(stream, label))


def _schema(stream, where: str):
    """The streamed split's columns: its features, or those of its first rows where none are known."""
    import pyarrow as pa

    if stream.features is not None:
        return stream.features.arrow_schema
    first = next(_tables(stream, None, where, rows=1), None)
    return first.schema if first is not None else pa.schema([])


def _tables(stream, columns: list[str] | None, where: str, rows: int = _ROWS) -> Iterator:
    """The split as pyarrow tables of `rows` rows, only `columns`; a file that cannot be read is
    one line naming the dataset."""
    import pyarrow as pa

    with _without_torch(_datasets(where)):
        if columns is not None:
            stream = stream.select_columns(columns)
        stream = stream.with_format("arrow")
    try:
        yield from stream.iter(batch_size=rows)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise UserError(f"cannot be read ({_one_line(e)})", where) from None


@contextmanager
def _without_torch(datasets) -> Iterator[None]:
    """`datasets` imports torch (~180 MiB resident, seconds) for every IterableDataset it builds, to
    share its epoch with DataLoader workers, which a stream read here never meets: off while ours are
    built (iterating them imports nothing)."""
    was = datasets.config.TORCH_AVAILABLE
    datasets.config.TORCH_AVAILABLE = False
    try:
        yield
    finally:
        datasets.config.TORCH_AVAILABLE = was
