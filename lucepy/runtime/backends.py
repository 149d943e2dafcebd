"""ggml builds, one per backend ("built twice", decision 1): where they live, and building them.

A build directory holds ``libggml*.so`` of the pinned source; ``LUCEPY_GGML_LIB`` pointed at it
makes a process (a worker, or the whole server) run on that build. The recipe is data, in
``vendor/ggml/recipes.toml``; ``plan_build`` turns it into commands and runs nothing.
"""

from __future__ import annotations

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


def recipes() -> dict:
    path = VENDOR / "recipes.toml"
    if not path.exists():
        raise BuildError(
            f"no build recipe at {path}; `lucepy backends build` needs a source "
            f"checkout of lucepy (pip install -e .)"
        )
    return tomllib.loads(path.read_text())


@dataclass(frozen=True)
class BuildPlan:
    backend: str
    prefix: Path
    cmake_args: tuple[str, ...]
    targets: tuple[str, ...]
    jobs: int


def plan_build(
    backend: str,
    prefix: Path | None = None,
    arch: str | None = None,
    with_bench: bool = False,
    jobs: int | None = None,
) -> BuildPlan:
    r = recipes()
    known = sorted(k for k in r if k != "common")
    if backend not in known:
        raise ConfigError(f"unknown backend {backend!r}; lucepy can build: {', '.join(known)}")
    spec = r[backend]
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
        Path(prefix or default_prefix(backend)),
        tuple(args),
        tuple(targets),
        jobs or os.cpu_count() or 2,
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
        out = work / "build"
        _run(["cmake", "-S", str(src), "-B", str(out), *plan.cmake_args], "configure")
        _run(
            ["cmake", "--build", str(out), "-j", str(plan.jobs), "--target", *plan.targets],
            "compile",
        )
        plan.prefix.mkdir(parents=True, exist_ok=True)
        for path in (out / "bin").iterdir():
            if path.name.startswith(("libggml", "libllama")) or path.name in plan.targets:
                shutil.copy2(path, plan.prefix / path.name, follow_symlinks=False)
    log.info("built ggml for %s into %s", plan.backend, plan.prefix)
    return plan.prefix


def _run(cmd: list[str], what: str) -> None:
    log.info("%s: %s", what, " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip().splitlines()
        log.error("%s output:\n%s", what, "\n".join(output[-40:]))
        raise BuildError(
            f"{what} failed ({cmd[0]} exited {done.returncode}): {' | '.join(output[-3:])}"
        )
