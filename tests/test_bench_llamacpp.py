"""bench/llamacpp.py's argument errors, without llama.cpp: a missing side environment is one line and exit 2."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "llamacpp.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=60)


def test_a_missing_llamacpp_environment_is_one_line_and_exit_2(tmp_path):
    r = _run("--venv", str(tmp_path / "none"))
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no llama.cpp environment at" in lines[0] and "--venv" in lines[0], r.stderr


def test_token_counts_below_two_are_refused():
    r = _run("--new-tokens", "1")
    assert r.returncode == 2 and "--new-tokens >= 2" in r.stderr
