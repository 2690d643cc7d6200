"""`mega-export --push-to-hub REPO`: an export directory published on the Hugging Face Hub through
huggingface_hub: the repo created when missing (`private` then), the branch (`revision`) too, and
the folder uploaded in one commit with the library's protocol (Xet or LFS, large files chunked as
it does; what the Hub already holds is not sent again, so rerunning after a failure resumes).

The token is the library's: `HF_TOKEN`, else `hf auth login`'s. It is only ever handed to the
library, never printed, logged or written. A network or auth failure is one line and exit 1; the
local export stays as it is. `manifest.json` stays local: it records local paths (lineage).
"""

from __future__ import annotations

from pathlib import Path

from megacore.artifacts import MANIFEST_NAME
from megacore.errors import UserError

HTTP_LIBRARIES = ("requests", "urllib3", "httpx", "httpx2", "httpcore")


class HubError(UserError):
    """The Hub could not be reached or refused: exit 1, the export untouched."""

    exit_code = 1


def upload_files(out: Path) -> list[tuple[str, int]]:
    """The files a push uploads (relative path, bytes), in upload order."""
    return sorted(
        (str(p.relative_to(out)), p.stat().st_size)
        for p in out.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME
    )


def push(
    out: Path,
    repo: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload export directory `out` to model repo `repo`; returns the commit's URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # its bars would interleave with our one-line report
    api = HfApi()
    message = commit_message or f"Upload {out.name} with mega-export"
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        if revision not in (None, "main"):
            api.create_branch(repo, branch=revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo, folder_path=out, revision=revision, commit_message=message,
            ignore_patterns=[MANIFEST_NAME],
        )  # fmt: skip
    except LocalTokenNotFoundError:
        raise HubError(
            "no Hugging Face token: set HF_TOKEN or run `hf auth login`", "--push-to-hub"
        ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "no response"
        raise HubError(
            f"{repo}: the Hub answered {status} ({_first_line(e)}); {out} is intact, rerun to resume",
            "--push-to-hub",
        ) from None
    except RuntimeError as e:  # an upload that failed: the library wraps the cause
        cause = e.__cause__ or e
        raise HubError(
            f"{repo}: {e} ({_first_line(cause)}); {out} is intact, rerun to resume", "--push-to-hub"
        ) from None
    except Exception as e:
        # Connection refused, DNS, timeouts: the errors of whichever HTTP library this
        # huggingface_hub uses (requests, httpx or httpx2, by version), or the OS's.
        if not isinstance(e, OSError) and type(e).__module__.split(".")[0] not in HTTP_LIBRARIES:
            raise
        raise HubError(
            f"{repo}: {_first_line(e)}; {out} is intact, rerun to resume", "--push-to-hub"
        ) from None
    return info.commit_url


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
