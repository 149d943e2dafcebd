"""lucepy's own CUDA kernels (decision 12) in the loaded ggml: whether the build has them (a build
of `lucepy backends build cuda`), switching them on and off in this process, and how many matrix
products they computed. They are off unless ``LUCEPY_CUDA_KERNELS=1`` starts a process with
them on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cffi

from lucepy.ggml.lib import Lib, _soname_file

_ffi = cffi.FFI()
_ffi.cdef(
    """
    void lucepy_cuda_kernels_set(int on);
    int lucepy_cuda_kernels_get(void);
    int64_t lucepy_cuda_kernels_calls(void);
    int64_t lucepy_cuda_kernels_quantized(void);
    """
)


@dataclass
class CudaKernels:
    handle: Any

    @property
    def on(self) -> bool:
        return bool(self.handle.lucepy_cuda_kernels_get())

    def set(self, on: bool) -> None:
        self.handle.lucepy_cuda_kernels_set(1 if on else 0)

    @property
    def calls(self) -> int:
        """Matrix products lucepy's kernels computed in this process (on every CUDA device);
        not those a captured CUDA graph replays (no host code runs for them)."""
        return int(self.handle.lucepy_cuda_kernels_calls())

    @property
    def quantized(self) -> int:
        """Activations quantized for them (one per graph and source tensor), counted alike."""
        return int(self.handle.lucepy_cuda_kernels_quantized())


def cuda_kernels(lib: Lib) -> CudaKernels | None:
    """The kernels of the loaded build's libggml-cuda, or None (no CUDA, or ggml's kernels only)."""
    path = _soname_file(lib.directory, "libggml-cuda.so")
    if path is None:
        return None
    handle = _ffi.dlopen(str(path))  # already loaded by libggml: the same copy
    try:
        handle.lucepy_cuda_kernels_get  # noqa: B018  (resolves the symbol or raises)
    except AttributeError:
        return None
    return CudaKernels(handle)
