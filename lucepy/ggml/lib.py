"""Find, load and check libggml (cffi, ABI mode).

The libraries come from llama-cpp-python's install (``site-packages/llama_cpp/lib``) or from the
directory named by ``LUCEPY_GGML_LIB`` (another build of the same pinned source, e.g. CUDA).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import threading
from pathlib import Path

import cffi

from lucepy.errors import GGMLCommitMismatch, GGMLError
from lucepy.ggml import _decls

log = logging.getLogger(__name__)

ENV_LIB = "LUCEPY_GGML_LIB"
# load order matters: each library needs the ones before it
LIB_NAMES = ["libggml-base.so", "libggml.so", "libggml-cpu.so", "libggml-rpc.so"]

ffi = cffi.FFI()
ffi.cdef(_decls.CDEF)


def address(handle) -> int:
    """A ggml pointer's address: a key for sets and dicts of tensors and nodes."""
    return int(ffi.cast("intptr_t", handle))


class Lib:
    """All loaded ggml libraries behind one namespace: ``lib.ggml_add(...)``.

    A symbol is looked up once and then cached on the instance, so calls cost one attribute read.
    """

    def __init__(self, directory: Path, handles: list):
        self.directory = directory
        self._handles = handles

    def __getattr__(self, name: str):
        for handle in self._handles:
            try:
                fn = getattr(handle, name)
            except (AttributeError, NotImplementedError):
                continue
            setattr(self, name, fn)
            return fn
        raise AttributeError(f"{name} is in none of the ggml libraries in {self.directory}")


# the switches of lucepy's kernels that a process reads (forced on or off, layouts, the FP8 product)
KERNEL_SWITCHES = (
    "LUCEPY_CUDA_KERNELS",
    "LUCEPY_CUDA_REPACK",
    "LUCEPY_CUDA_F8",
    "LUCEPY_CPU_KERNELS",
)


def build_identity(lib: Lib) -> list:
    """What tells one ggml build from another for a cached measurement: each ggml library file's
    name, size and modification time (a rebuild in place, e.g. with other kernels, changes
    them), lucepy's CPU kernel module's alike (ggml/cpu.py), and the KERNEL_SWITCHES' values
    (lucepy's kernels forced on or off, ggml's blocks kept, the FP8 product left out)."""
    paths = sorted(lib.directory.glob("libggml*.so*"))
    spec = importlib.util.find_spec("lucepy.ggml._cpu")
    if spec is not None and spec.origin is not None:
        paths.append(Path(spec.origin))
    files = [[p.name, st.st_size, st.st_mtime_ns] for p in paths for st in [p.stat()]]
    return [*files, *(os.environ.get(name) for name in KERNEL_SWITCHES)]


def default_directory() -> Path:
    override = os.environ.get(ENV_LIB)
    if override:
        return Path(override).expanduser()
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise GGMLError(
            "llama-cpp-python is not installed, and LUCEPY_GGML_LIB is unset; "
            "run `pip install llama-cpp-python==0.3.36` or point LUCEPY_GGML_LIB at a ggml build"
        )
    return Path(spec.origin).parent / "lib"


def _soname_file(directory: Path, name: str) -> Path | None:
    """``libggml-base.so.0`` rather than ``libggml-base.so``: wheels hold copies, not symlinks, and
    libllama loads the soname file. Opening another copy would make a second, separate ggml."""
    versioned = sorted(directory.glob(f"{name}.[0-9]*"), key=lambda p: len(p.name))
    if versioned:
        return versioned[0]
    path = directory / name
    return path if path.exists() else None


def open_libraries(directory: Path) -> Lib:
    if not (directory / "libggml-base.so").exists():
        raise GGMLError(f"no libggml-base.so in {directory}; is this a ggml build directory?")
    handles = []
    for name in LIB_NAMES:
        path = _soname_file(directory, name)
        if path is not None:
            # RTLD_GLOBAL so that backends loaded later resolve against this libggml-base
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            handles.append(ffi.dlopen(str(path)))
    lib = Lib(directory, handles)
    if lib.ggml_backend_reg_count() == 0:
        # a GGML_BACKEND_DL build registers its backends only when asked
        lib.ggml_backend_load_all_from_path(str(directory).encode())
    return lib


def check_pin(lib: Lib) -> None:
    """Refuse a libggml that was not built from the pinned source (decision 1)."""
    commit = ffi.string(lib.ggml_commit()).decode()
    version = ffi.string(lib.ggml_version()).decode()
    want_commit, want_version = _decls.GGML_COMMIT, _decls.GGML_VERSION
    where = lib.directory
    if version != want_version:
        raise GGMLCommitMismatch(
            f"libggml in {where} is version {version}, lucepy needs {want_version} "
            f"(llama-cpp-python {_decls.LLAMA_CPP_PYTHON_VERSION}); reinstall it, "
            f"or rebuild that directory from the pinned sdist"
        )
    if commit.startswith("unknown"):
        # an sdist has no git metadata, so its builds report "unknown"; the version is our check
        log.debug("libggml in %s reports no commit; version %s matches the pin", where, version)
        return
    if not (commit.startswith(want_commit) or want_commit.startswith(commit.split("-")[0])):
        raise GGMLCommitMismatch(
            f"libggml in {where} was built from commit {commit}, lucepy is pinned to "
            f"{want_commit}; "
            f"rebuild it from llama-cpp-python=={_decls.LLAMA_CPP_PYTHON_VERSION}"
        )


_lock = threading.Lock()
_lib: Lib | None = None


def load() -> Lib:
    """The process-wide ggml, loaded and checked on first use."""
    global _lib
    with _lock:
        if _lib is None:
            lib = open_libraries(default_directory())
            check_pin(lib)
            install_abort_hook(lib)
            lib.ggml_log_set(_on_log, ffi.NULL)
            _lib = lib
        return _lib


# ggml's own log (e.g. one line per repacked weight) goes to Python logging, not to stderr
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_last_level = [logging.DEBUG]  # GGML_LOG_LEVEL_CONT continues the previous message's level


@ffi.callback("void(enum ggml_log_level, const char *, void *)")
def _on_log(level, text, user_data) -> None:
    if level != 5:
        _last_level[0] = _LEVELS.get(level, logging.DEBUG)
    if text != ffi.NULL:
        log.log(_last_level[0], "%s", ffi.string(text).decode(errors="replace").rstrip())


# ggml-rpc aborts the whole process when a worker's connection breaks. We catch that abort on the
# thread that raised it (ggml-rpc's own I/O thread), record it, and park that thread for good, so
# the process lives on and the pipeline can fail the request with a clear error (runtime/pipeline).
_rpc_failures: list[str] = []
_rpc_failed = threading.Event()
_park = threading.Event()  # never set


@ffi.callback("void(const char *)")
def _on_abort(message) -> None:
    text = ffi.string(message).decode(errors="replace") if message != ffi.NULL else ""
    if "RPC" not in text:
        log.critical("ggml aborted: %s", text)
        return  # not ours to handle: ggml goes on to abort()
    text = text.strip().rsplit(": ", 1)[-1]  # drop ggml's "file.cpp:line: " prefix
    log.error("ggml-rpc: %s", text)
    _rpc_failures.append(text)
    _rpc_failed.set()
    _park.wait()


def rpc_failures() -> list[str]:
    """Messages of the RPC connections that broke in this process, oldest first."""
    return list(_rpc_failures)


def rpc_failed() -> threading.Event:
    return _rpc_failed


def install_abort_hook(lib: Lib) -> None:
    lib.ggml_set_abort_callback(_on_abort)
