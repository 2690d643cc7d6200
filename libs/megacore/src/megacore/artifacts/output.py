"""The one output-directory policy of all five tools: what may be reused, replaced or refused.

A tool never deletes or overwrites anything it cannot prove it wrote itself, `--force` included.

OUT may be written when it is:
- absent, or an empty directory;
- an artifact of the same kind, complete, holding exactly the files its manifest lists: reused
  when made from the same recipe (`reusable`), replaced only with `--force`.

Refused, with `--force` or not, everything left byte-identical:
- an existing file, or a directory that is not an artifact (no `manifest.json`), an artifact of
  another kind, or one holding files its manifest does not list (a user's notes);
- the input itself, a path inside an input, or a directory that contains an input.

Staging (`<out>.partial/`, see writer.py): a leftover carrying the staging mark of a run that is
gone is removed; one without the mark, or one that a live run is writing, is refused. On any
failure, Ctrl-C or SIGTERM the staging directory is removed; only a hard kill leaves it behind.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from megacore.artifacts.codec import decode_manifest
from megacore.artifacts.header import MANIFEST_NAME, Kind
from megacore.artifacts.manifest import Manifest, kind_of
from megacore.artifacts.reader import open_artifact
from megacore.artifacts.writer import STAGING_MARK, ArtifactWriter, sha256_bytes, staging_dir
from megacore.errors import UserError

NOT_REPLACED = "it is not replaced, even with --force"


def recipe_sha256(**parts: object) -> str:
    """The recipe of an artifact: sha256 over what decides its content (JSON-able parts)."""
    return sha256_bytes(json.dumps(parts, sort_keys=True, default=str).encode())


def reusable(out: Path, kind: Kind, recipe: str) -> Manifest | None:
    """The complete artifact at `out` when it was made from this recipe, else None."""
    if not (Path(out) / MANIFEST_NAME).is_file():
        return None
    try:
        manifest = open_artifact(Path(out), kind, verify="size")
    except UserError:
        return None
    return manifest if manifest.recipe_sha256 == recipe else None


def check_inputs(out: Path, inputs: Sequence[Path], where: str) -> None:
    """Refuse an output that is an input, lies inside one, or contains one."""
    real_out = os.path.realpath(out)
    real = [(inp, os.path.realpath(inp)) for inp in inputs]
    for inp, real_in in real:
        if real_out == real_in:
            raise UserError(f"the output is the input {inp}; choose another path", where)
    for inp, real_in in real:
        if real_out.startswith(real_in.rstrip(os.sep) + os.sep):
            raise UserError(f"the output lies inside the input {inp}; choose a path outside it", where)
    for inp, real_in in real:
        if real_in.startswith(real_out.rstrip(os.sep) + os.sep):
            raise UserError(f"the output contains the input {inp}; choose another path", where)


def _own_artifact(out: Path, kind: Kind, where: str) -> Manifest:
    """The manifest of `out` when it is an artifact of `kind` holding only its own files."""
    mf = out / MANIFEST_NAME
    if not mf.is_file():
        raise UserError(f"exists and is not an artifact (no {MANIFEST_NAME}); {NOT_REPLACED}", where)
    try:
        manifest = decode_manifest(mf.read_bytes(), str(mf))
    except UserError as e:
        raise UserError(f"its {MANIFEST_NAME} cannot be read ({e}); {NOT_REPLACED}", where) from None
    if kind_of(manifest) != kind:
        raise UserError(f"is a {kind_of(manifest)} artifact, not a {kind}; {NOT_REPLACED}", where)
    listed = {e.path for e in manifest.files} | {MANIFEST_NAME}
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out).as_posix()
        if (p.is_symlink() or p.is_file()) and rel not in listed:
            raise UserError(
                f"holds {rel}, which is not part of the artifact; move it away or choose another path "
                f"({NOT_REPLACED})",
                where,
            )
    return manifest


def _remove_leftover_staging(stage: Path, where: str) -> None:
    if not (stage.exists() or stage.is_symlink()):
        return
    mark = stage / STAGING_MARK
    if stage.is_symlink() or not stage.is_dir() or not mark.is_file():
        raise UserError(
            f"{stage} exists and was not made by these tools; remove it or choose another path", where
        )
    try:
        info = json.loads(mark.read_text())
        pid, host = int(info["pid"]), str(info["host"])
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{stage}: unreadable staging mark; remove the directory by hand", where) from None
    if host == socket.gethostname() and pid != os.getpid() and pid_alive(pid):
        raise UserError(f"another run (pid {pid}) is writing this output now", where)
    shutil.rmtree(stage)  # the leftover of an interrupted run of these tools


def pid_alive(pid: int) -> bool:
    """Whether a process of this host with that pid exists (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prepare_output(out: Path, kind: Kind, *, inputs: Sequence[Path] = (), force: bool = False) -> Path:
    """Apply the policy to `out` before writing a `kind` artifact there: raise a UserError when it
    must not be touched, remove a leftover staging directory of ours. Returns the path to write:
    a symlinked output is written where it points (its staging directory beside it there), so the
    link stays. Reuse is decided before this, with `reusable`."""
    where = str(out)
    out = Path(os.path.realpath(out)) if Path(out).is_symlink() else Path(out)
    check_inputs(out, inputs, where)
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise UserError(f"exists and is not a directory; {NOT_REPLACED}", where)
        if any(out.iterdir()):
            _own_artifact(out, kind, where)
            if not force:
                raise UserError(
                    "already exists; pass --force to replace it (it was made from other inputs or settings)",
                    where,
                )
    _remove_leftover_staging(staging_dir(out), where)
    return out


@contextmanager
def write_artifact(
    out: Path,
    kind: Kind,
    *,
    inputs: Sequence[Path] = (),
    force: bool = False,
    recipe: str | None = None,
) -> Iterator[ArtifactWriter]:
    """Stage a `kind` artifact at `<out>.partial/` after applying the output policy; the body must
    call `writer.commit(manifest)`. On any exception (Ctrl-C included) the staging is removed."""
    out = prepare_output(out, kind, inputs=inputs, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = ArtifactWriter(out, kind, recipe)
    writer.stage()
    try:
        yield writer
    finally:
        if not writer.committed:
            writer.abort()


def remove_artifact(path: Path, kind: Kind, producer: str) -> bool:
    """Delete `path` when it provably is what `producer` wrote: a complete `kind` artifact of that
    producer holding only the files its manifest lists (keep-last-K checkpoints). Returns whether it
    was removed; anything else is left as it is."""
    try:
        manifest = _own_artifact(Path(path), kind, str(path))
    except UserError:
        return False
    if manifest.producer is None or manifest.producer.name != producer:
        return False
    doomed = Path(path).with_name(f".{Path(path).name}.removing-{os.getpid()}")
    os.replace(path, doomed)  # gone from view at once: never a half-deleted artifact
    shutil.rmtree(doomed)
    return True
