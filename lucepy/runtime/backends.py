"""ggml builds, one per backend ("built twice", decision 1): where they live, and building them.

A build directory holds ``libggml*.so`` of the pinned source; ``LUCEPY_GGML_LIB`` pointed at it
makes a process (a worker, or the whole server) run on that build. The recipe is data, in
``vendor/ggml/recipes.toml``; ``plan_build`` turns it into commands and runs nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from lucepy.errors import BuildError, ConfigError
from lucepy.ggml import _decls

log = logging.getLogger(__name__)

VENDOR = Path(__file__).resolve().parents[2] / "vendor" / "ggml"


def cache_root() -> Path:
    base = os.environ.get("LUCEPY_CACHE_DIR")
    return Path(base).expanduser() if base else Path.home() / ".cache" / "lucepy"


def default_prefix(backend: str) -> Path:
    return cache_root() / "ggml" / backend


def find_build(backend: str) -> Path | None:
    path = default_prefix(backend)
    return path if (path / "libggml-base.so").exists() else None


def list_builds() -> list[tuple[str, Path]]:
    root = cache_root() / "ggml"
    if not root.is_dir():
        return []
    return [(d.name, d) for d in sorted(root.iterdir()) if (d / "libggml-base.so").exists()]


KERNELS_MARK = "KERNELS"  # in a build directory: "lucepy" or "ggml", whose kernels it runs


def build_kernels(path: Path) -> str | None:
    """Whose kernels a build directory holds, as its build recorded it (None: not recorded)."""
    mark = path / KERNELS_MARK
    return mark.read_text().strip() if mark.exists() else None


def recipes() -> dict:
    path = VENDOR / "recipes.toml"
    if not path.exists():
        raise BuildError(
            f"no build recipe at {path}; `lucepy backends build` needs a source "
            f"checkout of lucepy (pip install -e .)"
        )
    return tomllib.loads(path.read_text())


@dataclass(frozen=True)
class Kernels:
    """lucepy's own kernels for a backend (decision 12): ``files`` copied into ``dir`` of the
    source, and ``patch``, which hooks them into ggml. ``sha256`` maps each file the patch touches
    to its hash in the pinned source and its hash once patched."""

    dir: str
    files: tuple[Path, ...]
    patch: Path
    sha256: dict[str, tuple[str, str]]


@dataclass(frozen=True)
class BuildPlan:
    backend: str
    prefix: Path
    cmake_args: tuple[str, ...]
    targets: tuple[str, ...]
    jobs: int
    kernels: Kernels | None = None  # the backend's own kernels of lucepy's, if it has any
    own: bool = False  # hook them in (else the build runs ggml's kernels only)

    @property
    def which_kernels(self) -> str:
        return "lucepy" if self.own else "ggml"


def plan_build(
    backend: str,
    prefix: Path | None = None,
    arch: str | None = None,
    with_bench: bool = False,
    jobs: int | None = None,
    kernels: str | None = None,
) -> BuildPlan:
    """``kernels``: "lucepy" (the default where lucepy has kernels for the backend) or "ggml";
    a build of ggml's kernels for such a backend goes to BACKEND-ggml by default."""
    r = recipes()
    known = sorted(k for k in r if k != "common")
    if backend not in known:
        raise ConfigError(f"unknown backend {backend!r}; lucepy can build: {', '.join(known)}")
    spec = r[backend]
    ours = spec.get("kernels")
    kernels = kernels or ("lucepy" if ours else "ggml")
    if kernels not in ("lucepy", "ggml"):
        raise ConfigError(f"--kernels {kernels!r}: use lucepy or ggml")
    if kernels == "lucepy" and not ours:
        raise ConfigError(f"lucepy has no kernels of its own for {backend}; use --kernels ggml")
    own = kernels == "lucepy"
    if prefix is None:
        prefix = default_prefix(backend if own or not ours else f"{backend}-ggml")
    args = list(r["common"]["cmake"]) + list(spec.get("cmake", []))
    if "arch" in spec:
        args.append(spec["arch"].format(arch=arch or spec["default_arch"]))
    elif arch:
        raise ConfigError(f"--arch does not apply to the {backend} backend")
    targets = list(r["common"]["targets"]) + (
        list(r["common"]["bench_targets"]) if with_bench else []
    )
    return BuildPlan(
        backend,
        Path(prefix),
        tuple(args),
        tuple(targets),
        jobs or os.cpu_count() or 2,
        _kernels(ours) if ours else None,
        own,
    )


def _kernels(spec: dict) -> Kernels:
    return Kernels(
        spec["dir"],
        tuple(VENDOR / f for f in spec["files"]),
        VENDOR / spec["patch"],
        {path: (pair[0], pair[1]) for path, pair in spec["sha256"].items()},
    )


def download_sdist(work: Path, version: str = _decls.LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The pinned llama-cpp-python sdist, fetched with pip into ``work``."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"llama-cpp-python=={version}",
            "-d",
            str(work),
        ],
        check=True,
    )
    return next(work.glob("llama_cpp_python-*.tar.gz"))


def fetch_source(work: Path, sdist: Path | None) -> Path:
    """vendor/llama.cpp of the pinned sdist (downloaded with pip unless ``sdist`` is given)."""
    if sdist is None:
        sdist = download_sdist(work)
    if sdist.is_dir():
        found = list(sdist.glob("**/vendor/llama.cpp/CMakeLists.txt"))
        if not found:
            raise BuildError(f"{sdist} holds no vendor/llama.cpp")
        return found[0].parent
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if "/vendor/llama.cpp/" in m.name
            and "/models/" not in m.name
            and "/docs/" not in m.name
        ]
        tar.extractall(work, members=members, filter="data")
    return next(work.glob("*/vendor/llama.cpp"))


def build(plan: BuildPlan, sdist: Path | None = None) -> Path:
    """Configure, compile and install the build into ``plan.prefix``; returns the prefix.
    ``LUCEPY_BUILD_DIR`` keeps the build tree there, so that a build cut short resumes."""
    keep = os.environ.get("LUCEPY_BUILD_DIR")
    with tempfile.TemporaryDirectory(prefix="lucepy-build-") as tmp:
        work = Path(keep).expanduser() if keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        src = fetch_source(work, sdist)
        if plan.kernels is not None:
            hook_kernels(src, plan.kernels, plan.own)
        out = work / "build"
        _run(["cmake", "-S", str(src), "-B", str(out), *plan.cmake_args], "configure")
        _run(
            ["cmake", "--build", str(out), "-j", str(plan.jobs), "--target", *plan.targets],
            "compile",
        )
        install(out / "bin", plan)
    log.info("built ggml for %s into %s", plan.backend, plan.prefix)
    return plan.prefix


def install(built: Path, plan: BuildPlan) -> None:
    """Copy a build's libraries (symlinks as symlinks) and targets into ``plan.prefix``, over
    those of a build before it, and record whose kernels they run."""
    plan.prefix.mkdir(parents=True, exist_ok=True)
    for path in built.iterdir():
        if path.name.startswith(("libggml", "libllama")) or path.name in plan.targets:
            target = plan.prefix / path.name
            if target.is_symlink() or target.exists():
                target.unlink()
            shutil.copy2(path, target, follow_symlinks=False)
    (plan.prefix / KERNELS_MARK).write_text(plan.which_kernels + "\n")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hook_kernels(src: Path, kernels: Kernels, on: bool) -> None:
    """Put lucepy's kernels into the source tree ``src`` (vendor/llama.cpp) and patch ggml to call
    them, or (``on`` false) take them out again: a kept or given source tree may be patched
    already. Refuses a source whose patched files are not the pinned ones."""
    state = {}
    for rel, (pinned, patched) in kernels.sha256.items():
        digest = _sha256(src / rel)
        state[rel] = "pinned" if digest == pinned else "patched" if digest == patched else None
    if on and None in state.values():
        rel = next(r for r, v in state.items() if v is None)
        raise BuildError(
            f"{src / rel} is not the pinned ggml's: lucepy's kernels patch only the source of "
            f"llama-cpp-python {_decls.LLAMA_CPP_PYTHON_VERSION} (ggml {_decls.GGML_VERSION}, "
            f"commit {_decls.GGML_COMMIT}); build ggml's own kernels with --kernels ggml"
        )
    target = src / kernels.dir
    text = kernels.patch.read_text()
    if on:
        for f in kernels.files:
            # a changed file only, stamped now: a copy that kept its source's time could be older
            # than an object built from the tree's last copy (a source edited during a build), so
            # that the next build's ninja kept the stale object
            dest = target / f.name
            if not dest.is_file() or dest.read_bytes() != f.read_bytes():
                shutil.copyfile(f, dest)
        if "pinned" in state.values():
            apply_patch(src, text, only=[r for r, v in state.items() if v == "pinned"])
    else:
        for f in kernels.files:
            (target / f.name).unlink(missing_ok=True)
        if "patched" in state.values():
            apply_patch(
                src, text, reverse=True, only=[r for r, v in state.items() if v == "patched"]
            )
    want = 1 if on else 0
    for rel, pair in kernels.sha256.items():
        if state[rel] is not None and _sha256(src / rel) != pair[want]:
            raise BuildError(f"patching {src / rel} did not give the recorded file")


def parse_patch(text: str) -> dict[str, list[tuple[int, list[str], int, list[str]]]]:
    """A unified diff: for each file (its path after ``b/``), its hunks as (old start, old lines,
    new start, new lines)."""
    files: dict[str, list] = {}
    hunks: list | None = None
    for line in text.splitlines():
        if line.startswith("+++ "):
            name = line[4:].split("\t")[0]
            hunks = files.setdefault(name[2:] if name.startswith("b/") else name, [])
        elif line.startswith("--- ") or line.startswith("\\"):
            continue
        elif line.startswith("@@"):
            old, new = line.split()[1:3]
            assert hunks is not None, "a hunk before its file"
            hunks.append((int(old[1:].split(",")[0]), [], int(new[1:].split(",")[0]), []))
        elif hunks:
            _, old_lines, _, new_lines = hunks[-1]
            tag, body = line[:1], line[1:]
            if tag in (" ", "-"):
                old_lines.append(body)
            if tag in (" ", "+"):
                new_lines.append(body)
    return files


def apply_patch(
    root: Path, text: str, *, reverse: bool = False, only: list[str] | None = None
) -> None:
    """Apply (or take back) a unified diff under ``root``, strictly: every hunk must match at
    its stated line, context and all."""
    for rel, hunks in parse_patch(text).items():
        if only is not None and rel not in only:
            continue
        path = root / rel
        lines = path.read_text().split("\n")
        shift = 0
        for old_start, old, new_start, new in hunks:
            start, before, after = (new_start, new, old) if reverse else (old_start, old, new)
            at = start - 1 + shift
            if lines[at : at + len(before)] != before:
                raise BuildError(f"{path}: the patch does not match at line {start}")
            lines[at : at + len(before)] = after
            shift += len(after) - len(before)
        path.write_text("\n".join(lines))


def _run(cmd: list[str], what: str) -> None:
    log.info("%s: %s", what, " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip().splitlines()
        log.error("%s output:\n%s", what, "\n".join(output[-40:]))
        raise BuildError(
            f"{what} failed ({cmd[0]} exited {done.returncode}): {' | '.join(output[-3:])}"
        )
