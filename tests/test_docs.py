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
