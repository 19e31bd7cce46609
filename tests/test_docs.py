"""The user's documentation: the README's map matches the source, it links every page, and the pages
build with ``mkdocs build --strict``, which a broken link fails."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from test_layers import LAYERS  # the layering the README's Layout table draws

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _layout_rows() -> dict[str, int]:
    """unit -> layer, from the README's Layout table (`| layer | `a.py`, `b/` | what |`)."""
    section = README.read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, int] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            for name in re.findall(r"`([a-z_]+)(?:\.py|/)`", cells[1]):
                rows["rollyard" if name == "__init__" else name] = int(cells[0])
    return rows


def _source_units() -> set[str]:
    src = ROOT / "src" / "rollyard"
    units = {p.stem for p in src.glob("*.py") if p.stem != "__init__"}
    units |= {p.name for p in src.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return units | {"rollyard"}


def test_the_readme_layout_lists_every_unit_in_its_layer():
    rows = _layout_rows()
    assert set(rows) == _source_units(), (
        f"README Layout table vs src/rollyard: missing {sorted(_source_units() - set(rows))}, "
        f"extra {sorted(set(rows) - _source_units())}")
    layer = {u: i for i, units in enumerate(LAYERS) for u in units}
    wrong = {u: (n, layer.get(u)) for u, n in rows.items() if layer.get(u) != n}
    assert not wrong, f"README layer vs tests/test_layers.py LAYERS (unit: (README, LAYERS)): {wrong}"


def _nav_pages() -> list[str]:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [next(iter(item.values())) for item in nav]


def test_the_readme_is_short_starts_with_the_quickstart_and_links_every_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    quick = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert quick.index("make demo") < quick.index("make test")
    pages = [p for p in _nav_pages() if p != "index.md"]
    assert pages and not [p for p in pages if f"(docs/{p}" not in text], "README: link every page in mkdocs.yml's nav"
    assert sorted(p.name for p in (ROOT / "docs").glob("*.md")) == sorted(_nav_pages())


def _build(docs: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    return subprocess.run([str(mkdocs), "build", "--strict", "-f", str(docs.parent / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)


def test_the_docs_build_strict_and_a_broken_link_fails_it(tmp_path):
    work = tmp_path / "tree"
    shutil.copytree(ROOT / "docs", work / "docs")
    shutil.copy(ROOT / "mkdocs.yml", work / "mkdocs.yml")
    ok = _build(work / "docs", tmp_path)
    assert ok.returncode == 0, ok.stderr
    page = work / "docs" / "usage.md"
    page.write_text(page.read_text() + "\nSee [the demo](../examples/demo.toml).\n")
    broken = _build(work / "docs", tmp_path)
    assert broken.returncode != 0 and "../examples/demo.toml" in broken.stderr


# How the work went, not what rollyard does: an issue or work session by number, the work period, who else
# was on the machine. User-facing text states the product and what was measured (command, date, CPU class,
# figure); superseded figures go to bench/README.md's "Results history", dated.
NARRATION = re.compile(r"\bissues? #?\d+|\bthe issue's|\bsessions? \d+|\b(?:this|previous|last|next) session\b"
                       r"|\bwork period|\bother (?:engineers|agents|sessions)\b|\bbefore the deadline", re.IGNORECASE)


def _user_pages() -> list[Path]:
    return [README, ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# A citation of another project's issue tracker is a source, not narration.
CITATION = re.compile(r"[\w.-]+/[\w.-]+ (?:issue|pull request|PR) #\d+|https?://\S+")


def _narration(text: str) -> list[str]:
    return [f"{i}: {line.strip()[:100]}" for i, line in enumerate(text.splitlines(), 1)
            if NARRATION.search(CITATION.sub("", line))]


def test_user_pages_state_the_product_and_its_measurements_not_how_the_work_went():
    found = {p.relative_to(ROOT).as_posix(): hits for p in _user_pages() if (hits := _narration(p.read_text()))}
    assert not found, f"issue / session numbers or work narration in user-facing text (state the figure, its date, " \
                      f"machine and command instead): {found}"


def _message_strings(path: Path) -> list[tuple[int, str]]:
    """The string literals of a module that are not docstrings: what its messages, warnings and help say."""
    import ast

    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_no_message_a_user_sees_cites_an_issue():
    found = [f"{p.relative_to(ROOT)}:{line}: {text.strip()[:80]!r}" for p in sorted((ROOT / "src").rglob("*.py"))
             for line, text in _message_strings(p) if NARRATION.search(text)]
    assert not found, f"a message cites an issue or a work session (state the measured figure and the bench): {found}"


def test_the_narration_check_sees_an_issue_number_and_a_session(tmp_path):
    assert _narration("Measured in session 7 of issue 12 (2-core CPU)") and _narration("the issue's target")
    assert _narration("shared with ~7 other agents' test runs") and _narration("dated by work period")
    assert not _narration("Measured 2026-11-23, 2-core AMD EPYC with AVX512-BF16, `bench/vs_trl.py`: 2.2x")
    assert not _narration("a per-session token; one Ray session per test run; a multi-turn session")
    assert not _narration("| same system | vllm-project/vime issue #175 | ~3.0 s |")
    module = tmp_path / "m.py"
    module.write_text('"""Docstring: issue 7 is history."""\n\n\ndef f():\n    """issue 8"""\n'
                      '    raise ValueError("slower (in issue 44\'s probe)")\n')
    assert [line for line, text in _message_strings(module) if NARRATION.search(text)] == [6]


def test_every_test_the_reliability_table_cites_exists():
    """docs/reliability.md's table names a test for each fault: `tests/f.py::name`, or a bare `test_name` of the
    row's last named file (tests/test_reliability.py where the row names none). A renamed or removed test fails here."""
    missing = []
    for line in (ROOT / "docs" / "reliability.md").read_text().splitlines():
        if not line.startswith("| ") or line.startswith("| fault "):
            continue
        path = "tests/test_reliability.py"
        for m in re.finditer(r"`(tests/[\w/]+\.py)(?:::(\w+))?`|`(test_\w+)`", line.rstrip().rstrip("|").rsplit("|", 1)[1]):
            path, name = (m.group(1), m.group(2)) if m.group(1) else (path, m.group(3))
            if name and not re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M):
                missing.append(f"{path}::{name}")
    assert not missing, f"docs/reliability.md cites tests that do not exist: {missing}"
