"""The newcomer path (`make demo`, then `make test`, as .ci/run walks it): what a run writes at the
repository root (runs/, .cache/) must not change what lint sees, and the linters are pinned."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A test helper module named like a folder a run writes at the root, imported the way ruff sorts a
# third-party module when no such folder exists: the case that turned `make test` red after `make demo`.
PROBE = '"""probe"""\n\nimport pytest\nfrom runs import helper\n\nfrom rollyard import config\n\n\ndef test_probe():\n    assert pytest and helper and config\n'


def _ruff(root: Path) -> str:
    ruff = Path(sys.executable).with_name("ruff")
    out = subprocess.run([str(ruff), "check", "--no-cache", "--output-format", "concise", "src", "tests"], cwd=root,
                         capture_output=True, text=True, timeout=300)
    return out.stdout + out.stderr


def test_lint_is_the_same_with_and_without_a_run_on_disk(tmp_path):
    for part in ("src", "tests"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "tests" / "runs.py").write_text('"""helper"""\n\nhelper = 1\n')
    (tmp_path / "tests" / "test_probe.py").write_text(PROBE)
    clean = _ruff(tmp_path)
    (tmp_path / "runs" / "demo-20261125-040840" / "model").mkdir(parents=True)
    (tmp_path / "runs" / "stray.py").write_text("import os\n")  # never linted either
    (tmp_path / ".cache" / "warmstart" / "0123456789abcdef").mkdir(parents=True)
    assert _ruff(tmp_path) == clean
    assert "test_probe.py" not in clean


def test_the_linters_are_pinned():
    text = (ROOT / "pyproject.toml").read_text()
    test_extra = re.search(r"^test = \[(.*)\]", text, re.M).group(1)
    assert re.search(r'"ruff==[\d.]+"', test_extra) and re.search(r'"pytest==[\d.]+"', test_extra)
