"""`make gpu-check` (bench/gpu_check.py) where it can run without a GPU: without CUDA it exits 0 in
seconds with a report whose every part is skipped; its runner cuts a part (a real subprocess, and
what that started) at its timeout, skips what the budget or a missing module leaves no room for,
and reads a part's record or its crash; and the parts' CPU-sized pieces: context parallel simulated
in one process equals the whole row's attention (and a wrong reassembly is caught), the checks of
the fp8 and grouped-matmul parts, pytest's junit counts, the peers' models chosen by the time left."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
PY = sys.executable


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gc = _load("gpu_check")
parts = _load("gpu_check_parts")


def fake(name: str, code: str, timeout_s: float = 30, needs: tuple[str, ...] = ()):
    """A part that is `python -c code` (its record file in $GPU_CHECK_RESULT)."""
    return gc.Part(name, timeout_s, needs, (PY, "-c", code))


WRITES_PASSED = (
    "import json, os, time; time.sleep(1); "
    "open(os.environ['GPU_CHECK_RESULT'], 'w').write(json.dumps({'status': 'passed', 'figures': {'x': 1}}))"
)


def test_without_cuda_every_part_is_skipped_and_it_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    t0 = time.monotonic()
    proc = subprocess.run([PY, BENCH / "gpu_check.py", "--out", out, "--logs", tmp_path / "logs"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 60  # importing torch, nothing else
    report = json.loads(out.read_text())
    assert {k: report[k] for k in ("kind", "format_version", "peers")} == {
        "kind": "gpu-check", "format_version": 1, "peers": []
    }  # fmt: skip
    assert report["machine"]["gpu"] is None and report["machine"]["torch"] == torch.__version__
    assert report["parts"] == {p.name: {"status": "skipped", "reason": "no CUDA device"} for p in gc.PARTS}
    assert list(report["parts"]) == ["cuda_tests", "fp8", "grouped_mm", "cp_32k", "peers"]
    assert report["summary"] == {"passed": 0, "failed": 0, "skipped": 5}
    assert "0 passed, 0 failed, 5 skipped" in proc.stdout


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_part_is_cut_at_its_timeout_with_what_it_started(tmp_path: Path) -> None:
    """A part that started a process of its own and sleeps past its 1 s: both are gone, the part
    failed, `timed_out`, in about its timeout."""
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")  # fmt: skip
    t0 = time.monotonic()
    record = gc.run_part(fake("sleepy", code, timeout_s=3), 100, tmp_path)
    assert time.monotonic() - t0 < 3 + gc.GRACE_S
    assert record["status"] == "failed" and record["timed_out"] is True, record
    assert record["reason"] == "cut at its timeout, 3 s" and record["timeout_s"] == 3
    # Signalled with its group, the orphan it started exits as the kernel gets to it: on a loaded
    # machine a moment after the part's own end (the full suite once saw it still running).
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 2
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_the_budget_skips_what_it_leaves_no_room_for(tmp_path: Path) -> None:
    """A part's record is read from its file; the next part, with less than MIN_PART_S left, is
    skipped, and one needing a module not installed too."""
    plan = (fake("first", WRITES_PASSED), fake("second", WRITES_PASSED))
    with mock.patch.object(gc, "MIN_PART_S", 9.5):
        records = gc.run_parts(plan, 10, tmp_path)
    assert records["first"]["status"] == "passed" and records["first"]["figures"] == {"x": 1}
    assert 1 <= records["first"]["duration_s"] < 10 and records["first"]["timeout_s"] == 10
    assert records["second"]["status"] == "skipped", records
    assert records["second"]["reason"].startswith("the total budget is spent (")
    missing = gc.run_part(fake("needs", WRITES_PASSED, needs=("numpy", "no_such_module_x")), 100, tmp_path)
    assert missing["status"] == "skipped" and missing["reason"].startswith(
        "not installed: no_such_module_x ("
    )


def test_a_crash_is_a_failure_with_its_last_line(tmp_path: Path) -> None:
    record = gc.run_part(fake("crash", "raise SystemExit('boom: no device')"), 100, tmp_path)
    assert (record["status"], record["reason"]) == ("failed", "exit 1: boom: no device")
    assert Path(record["log"]).read_text().strip() == "boom: no device"


ROW = dict(seq=256, heads=4, kv_heads=2, head_dim=16)


@pytest.mark.parametrize(("window", "documents"), [(None, False), (48, False), (None, True)])
def test_context_parallel_simulated_in_one_process_is_the_whole_row(window, documents) -> None:
    """On the CPU, small: every cp size's output and gradients as close to fp32 as the whole row's
    own bf16 attention (cp 1) is."""
    case = parts.attention_case(ROW, window, documents, "cpu", sizes=(2, 4))
    assert parts.case_failures({"case": case}) == []
    for cp in ("cp2", "cp4"):
        for what in ("output", "grad_q", "grad_k", "grad_v"):
            assert case[cp][what] < 2 * case["cp1"][what] + 1e-3, (cp, what, case)


def test_a_wrong_reassembly_of_the_ranks_fails_the_check() -> None:
    from megacore.parallel import cp as cpm

    real = cpm.unshard_sequence

    def reversed_ranks(t: torch.Tensor, cp: int) -> torch.Tensor:
        return real(torch.cat(t.split(t.shape[0] // cp)[::-1]), cp)

    with mock.patch.object(cpm, "unshard_sequence", reversed_ranks):
        case = parts.attention_case(ROW, None, False, "cpu", sizes=(2,))
    assert case["cp2"]["output"] > 0.5 and parts.case_failures({"causal": case}), case


def test_the_fp8_checks() -> None:
    bf16 = {"losses": [10.0, 9.0, 8.0], "float8_linears": 0, "emulated": []}
    fp8 = {"losses": [10.01, 9.02, 8.01], "float8_linears": 14, "emulated": [False]}
    worst, failures = parts.fp8_failures(bf16, fp8, layers=2)
    assert worst == pytest.approx(0.02 / 9) and failures == []
    off = {**fp8, "losses": [10.0, 9.0, 8.3], "emulated": [True]}
    worst, failures = parts.fp8_failures(bf16, off, layers=2)
    assert failures == ["float8 emulated ([True])", "fp8 3.750% from bf16 at its worst step (bound 2%)"]
    _, failures = parts.fp8_failures(bf16, {**fp8, "losses": bf16["losses"]}, layers=3)
    assert failures == [
        "fp8 made 14 float8 linears, not 21",
        "fp8's losses are bf16's: nothing rounded to float8",
    ]


def test_the_grouped_matmul_checks_and_the_loop_path() -> None:
    good = {"grouped_vs_fp32": 0.004, "loop_vs_fp32": 0.004, "grouped_vs_loop": 0.003}
    bad = {"grouped_vs_fp32": 0.5, "loop_vs_fp32": 0.004, "grouped_vs_loop": 0.5}
    assert parts.experts_failures({"output": good}) == []
    assert parts.experts_failures({"grad_x": bad}) == [
        "grad_x: grouped 5.00e-01 from fp32 (the loop 4.00e-03)", "grad_x: grouped 5.00e-01 from the loop"
    ]  # fmt: skip
    inputs = parts.expert_inputs(experts=4, hidden=32, ffn=48, rows=100)
    assert inputs[1][1] == 0 and int(inputs[1].sum()) == 100  # an expert without rows
    with parts.loop_path():
        assert not hasattr(torch, "_grouped_mm")
        got = parts.run_experts(parts.placed(inputs, torch.bfloat16, "cpu"))
    assert hasattr(torch, "_grouped_mm")
    want = parts.run_experts(parts.placed(inputs, torch.float32, "cpu"))
    assert all(parts.rel(a, b) < parts.BF16_REL for a, b in zip(got, want, strict=True))


def test_junit_counts(tmp_path: Path) -> None:
    (tmp_path / "test_three.py").write_text(
        "import pytest\n\ndef test_ok(): pass\n\ndef test_bad(): assert False\n\n"
        "@pytest.mark.skip(reason='needs a CUDA device')\ndef test_gpu(): pass\n"
    )
    xml = tmp_path / "junit.xml"
    subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "test_three.py"],
                   cwd=tmp_path, capture_output=True, check=False)  # fmt: skip
    figures = parts.junit_figures(xml)
    assert {k: figures[k] for k in ("tests", "failures", "errors", "skipped")} == {
        "tests": 3, "failures": 1, "errors": 0, "skipped": 1
    }  # fmt: skip
    assert figures["failed"] == ["test_three::test_bad"] and figures["skip_reasons"] == [
        "needs a CUDA device"
    ]


def test_the_peers_models_fit_the_time_left() -> None:
    assert parts.peers_models(float("inf")) == (["1.1B", "3B"], [])
    assert parts.peers_models(400) == (["1.1B"], ["3B: 210 s left of the part's time, its documented ~215 s"])
    chosen, left_out = parts.peers_models(100)
    assert chosen == [] and len(left_out) == 2


@dataclass
class Row:  # bench/run.py's, the fields the part reads
    metric: str
    note: str = ""
    passed: bool | None = None


def test_the_peers_part_keeps_each_models_rows(tmp_path: Path, monkeypatch) -> None:
    """bench_gpu_peers stood in for: with time for the 1.1B only, its rows are the record (written
    to the result file), the 3B left out saying why; a row of ours that failed fails the part."""
    ran = []

    def model_rows(name: str, setup: object, quick: bool) -> list[Row]:
        ran.append((name, setup, quick))
        return [
            Row(
                f"{name}: mega-train eager, tokens/s",
                "12.3 TFLOP/s",
                passed=None if name == "1.1B" else False,
            )
        ]

    bench = types.SimpleNamespace(MODELS={"1.1B": "small", "3B": "big"}, model_rows=model_rows,
                                  absolute_pythonpath=lambda: None)  # fmt: skip
    monkeypatch.setitem(sys.modules, "bench_gpu_peers", bench)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv(parts.RESULT_ENV, str(tmp_path / "peers.json"))
    monkeypatch.setenv(parts.SECONDS_ENV, "400")
    record = parts.peers()
    assert ran == [("1.1B", "small", False)]
    assert record == json.loads((tmp_path / "peers.json").read_text())
    assert record["status"] == "passed" and record["figures"]["models"] == ["1.1B"]
    assert record["figures"]["rows"] == [
        {"metric": "1.1B: mega-train eager, tokens/s", "note": "12.3 TFLOP/s", "passed": None}
    ]
    assert record["figures"]["left_out"] == ["3B: 210 s left of the part's time, its documented ~215 s"]
    monkeypatch.setenv(parts.SECONDS_ENV, "1000")
    record = parts.peers()
    assert record["status"] == "failed" and record["figures"]["models"] == ["1.1B", "3B"]
    assert record["reason"] == "3B: mega-train eager, tokens/s: 12.3 TFLOP/s"
