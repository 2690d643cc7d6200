"""`mega-export --push-to-hub` against a Hub stand-in on loopback (fakehub.py, HF_ENDPOINT): the
files of the export arrive in one commit (the weights through LFS), the token is sent and appears
in no output or file, a failure is one line and exit 1 with the export intact and a rerun resumes
(nothing uploaded twice), `--dry-run` lists the files and sizes without a network or a token, and
the model card carries the lineage (data and its token count, steps, final losses, layout)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fakehub import FakeHub
from helpers import assert_one_line_error, run_tool
from mega_export.hub import upload_files
from runlib import TINY_LLAMA, ok, train, write_run
from tokenize_testlib import corpus, write_jsonl

TOKEN = "hf_SECRETtoken1234567890abcdefgh"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, sp_model: Path) -> Path:
    """The final checkpoint of 4 steps of the tiny Llama on real text (evaluated at the end)."""
    root = tmp_path_factory.mktemp("trained")
    src = write_jsonl(root / "docs.jsonl", [{"text": t} for t in corpus(300)])
    run_tool("mega-tokenize", src, root / "tokens", "-t", sp_model, check=True)
    run_json = write_run(root, root / "tokens", train_steps=4, eval={"every": 4, "iters": 1})
    ok(train(run_json))
    return root / "run" / "checkpoints" / "latest"


@pytest.fixture
def hub():
    h = FakeHub()
    yield h
    h.close()


def env(tmp_path: Path, endpoint: str, token: str | None = TOKEN) -> dict[str, str]:
    # HF_HOME: no saved login of this machine is read; Xet off: the stand-in speaks LFS; online
    # (`make test` sets HF_HUB_OFFLINE=1 for everything else).
    e = {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1",
         "HF_HUB_OFFLINE": "0"}  # fmt: skip
    return e | ({"HF_TOKEN": token} if token else {"HF_TOKEN": ""})


def assert_push_error(proc, *fragments: str) -> None:
    """Exit 1 and one error line (a rerun's stderr may also say the export was reused), no traceback."""
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(f in errors[0] for f in fragments), (fragments, errors[0])


def export(trained: Path, out: Path, *args: str, **kw):
    return run_tool("mega-export", trained, out, *args, **kw)


def test_push_uploads_every_file_and_never_shows_the_token(tmp_path: Path, trained: Path, hub) -> None:
    out = tmp_path / "hf"
    proc = export(trained, out, "--push-to-hub", "tester/tiny", "--private", "--revision", "dev",
                  "--commit-message", "first upload", env=env(tmp_path, hub.url))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "pushed" in proc.stdout and "tester/tiny" in proc.stdout
    assert hub.repos["tester/tiny"]["private"]
    (commit,) = hub.commits
    assert (commit["revision"], commit["summary"]) == ("dev", "first upload")
    local = {p: (out / p).read_bytes() for p, _ in upload_files(out)}
    assert commit["files"] == local and "manifest.json" not in local
    assert {
        "README.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
    } <= set(local)
    weights = hashlib.sha256(local["model.safetensors"]).hexdigest()
    assert weights in hub.lfs  # through LFS, not inline
    writes = [(r, a) for r, a in zip(hub.requests, hub.auth, strict=True) if r.startswith("POST /api/")]
    assert len(writes) >= 3 and all(a == f"Bearer {TOKEN}" for _, a in writes), writes  # sent ...
    texts = [proc.stdout, proc.stderr] + [
        p.read_bytes().decode(errors="replace") for p in out.rglob("*") if p.is_file()
    ]
    assert not any(TOKEN in t for t in texts)  # ... and nowhere else


def test_dry_run_lists_files_and_sizes_without_network(tmp_path: Path, trained: Path) -> None:
    out = tmp_path / "hf"
    proc = export(trained, out, "--push-to-hub", "tester/tiny", "--dry-run",
                  env=env(tmp_path, "http://127.0.0.1:9", token=None))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for path, size in upload_files(out):
        assert f"{size:,}  {path}" in proc.stdout
    assert "manifest.json" not in proc.stdout


def test_failures_are_one_line_and_a_rerun_resumes(tmp_path: Path, trained: Path, hub) -> None:
    out = tmp_path / "hf"
    hub.fail_once = ("/commit/", 400)  # after the weights went up
    proc = export(trained, out, "--push-to-hub", "tester/tiny", env=env(tmp_path, hub.url))
    assert_one_line_error(proc, "--push-to-hub: tester/tiny: the Hub answered 400", "rerun to resume", code=1)
    assert not hub.commits and hub.lfs
    sent = sum(r.startswith("PUT /lfs-upload") for r in hub.requests)
    before = {p: (out / p).read_bytes() for p, _ in upload_files(out)}
    proc = export(trained, out, "--push-to-hub", "tester/tiny", env=env(tmp_path, hub.url))
    assert proc.returncode == 0, proc.stderr
    assert sum(r.startswith("PUT /lfs-upload") for r in hub.requests) == sent  # nothing sent twice
    assert hub.commits[0]["files"] == before
    # No token at all: refused by the Hub, one line, exit 1.
    proc = export(trained, out, "--push-to-hub", "tester/other", env=env(tmp_path, hub.url, token=None))
    assert_push_error(proc, "--push-to-hub: tester/other: the Hub answered 401")
    # Down: the same.
    proc = export(trained, out, "--push-to-hub", "tester/tiny", env=env(tmp_path, "http://127.0.0.1:9"))
    assert_push_error(proc, "--push-to-hub: tester/tiny", "intact")


def test_push_options_need_push_to_hub(tmp_path: Path, trained: Path) -> None:
    assert_one_line_error(
        export(trained, tmp_path / "hf", "--dry-run"), "--dry-run is an option of --push-to-hub"
    )
    assert not (tmp_path / "hf").exists()


def test_model_card_carries_the_lineage(tmp_path: Path, trained: Path) -> None:
    out = tmp_path / "hf"
    ok(export(trained, out))
    card = (out / "README.md").read_text()
    assert "library_name: transformers" in card
    assert "| steps | 4 (32 sequences) |" in card  # what the batch sizes count
    assert "| base model | none: trained from fresh weights |" in card
    assert "| training data | `tokens` (manifest sha256 " in card
    assert "documents," in card and "tokens (text, sentencepiece tokenizer)" in card
    assert str(tmp_path.parent) not in card and "/tmp" not in card  # no local path is published
    assert "| final train loss |" in card and "| final valid loss |" in card
    assert "| layout | tp 1 x pp 1 x dp 1, float32 |" in card
    assert "| experts |" not in card and "| parameters |" not in card  # a dense model: no experts rows
    assert f"vocab {TINY_LLAMA['vocab_size']}" in card


def test_an_adapter_export_is_pushed_as_peft_files(tmp_path: Path, trained: Path, hub) -> None:
    """A LoRA run's checkpoint exported with --adapter and pushed: the PEFT files (the config and the
    adapter's safetensors, through LFS), its card and tokenizer, and nothing of the base."""
    tokens = trained.parents[2] / "tokens"
    run_json = write_run(tmp_path / "lora", tokens, init=trained, train_steps=2, eval={"every": 0},
                         lora={"rank": 4, "targets": ["q_proj", "v_proj"]})  # fmt: skip
    ok(train(run_json))
    out = tmp_path / "adapter"
    ckpt = tmp_path / "lora" / "run" / "checkpoints" / "latest"
    proc = export(ckpt, out, "--adapter", "--push-to-hub", "tester/adapter", env=env(tmp_path, hub.url))
    assert proc.returncode == 0, proc.stderr
    (commit,) = hub.commits
    local = {p: (out / p).read_bytes() for p, _ in upload_files(out)}
    assert commit["files"] == local
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "tokenizer.json"} <= set(local)
    assert "model.safetensors" not in local and "manifest.json" not in local
    assert hashlib.sha256(local["adapter_model.safetensors"]).hexdigest() in hub.lfs
