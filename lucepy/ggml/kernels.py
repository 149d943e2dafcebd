"""lucepy's own CUDA kernels (decision 12) in the loaded ggml: whether the build has them (a build
of `lucepy backends build cuda`), switching them on and off in this process, and how many matrix
products they computed. By default they run on NVIDIA GPUs of compute capability 9.0 and newer
(where they were measured) and ggml's kernels everywhere else; ``LUCEPY_CUDA_KERNELS=0`` or ``=1``
in a process's environment forces them off or on from its start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cffi

from lucepy.ggml.lib import Lib, _soname_file, address

_ffi = cffi.FFI()
_ffi.cdef(
    """
    void lucepy_cuda_kernels_set(int mode);
    int lucepy_cuda_kernels_get(int device);
    int64_t lucepy_cuda_kernels_calls(void);
    int64_t lucepy_cuda_kernels_quantized(void);
    int64_t lucepy_cuda_kernels_fused(void);
    int64_t lucepy_cuda_kernels_ops(void);
    int64_t lucepy_cuda_kernels_copies(void);
    int64_t lucepy_cuda_kernels_joined(void);
    int64_t lucepy_cuda_kernels_bulk(void);
    int64_t lucepy_cuda_kernels_f8(void);
    int64_t lucepy_cuda_kernels_paired(void);
    int64_t lucepy_cuda_kernels_tailed(void);
    int lucepy_cuda_repack(void * tensor);
    """
)


@dataclass
class CudaKernels:
    handle: Any

    def on(self, device: int = 0) -> bool:
        """Whether lucepy's kernels take the products of CUDA device ``device``."""
        return bool(self.handle.lucepy_cuda_kernels_get(device))

    def set(self, on: bool | None) -> None:
        """Force them on or off on every device, or (None) back to the default."""
        self.handle.lucepy_cuda_kernels_set(-1 if on is None else 1 if on else 0)

    @property
    def calls(self) -> int:
        """Matrix products lucepy's kernels computed in this process (on every CUDA device);
        not those a captured CUDA graph replays (no host code runs for them)."""
        return int(self.handle.lucepy_cuda_kernels_calls())

    @property
    def quantized(self) -> int:
        """Activations quantized for them (one per graph and source tensor), counted alike."""
        return int(self.handle.lucepy_cuda_kernels_quantized())

    @property
    def fused(self) -> int:
        """Of those, the ones that the kernel before the product prepared as it wrote its result
        (an RMS norm times its weight, or a SiLU or sigmoid gate: one kernel, not two), counted
        alike."""
        return int(self.handle.lucepy_cuda_kernels_fused())

    @property
    def ops(self) -> int:
        """Other ops they computed: conv steps (qwen35's concat, tail copy, conv, SiLU and the
        l2 norm of q and k after it: one kernel where ggml-cuda runs four), DeltaNet gates (the
        decay and beta's sigmoid: one kernel, not three), DeltaNet recurrences (with the copy
        of the new state), argmaxes of long rows, a verify's residual ADDs (written by their
        product's kernels) and an FFN's SWIGLU over its gate and up products (one product over
        both), counted alike."""
        return int(self.handle.lucepy_cuda_kernels_ops())

    @property
    def copies(self) -> int:
        """Copies that those ops made as they ran, where ggml-cuda would run a copy of its own: a
        verify's DeltaNet state before the step (kept for its rollback) and beta out of the
        stacked DeltaNet product, and a rollback's conv tail, counted alike."""
        return int(self.handle.lucepy_cuda_kernels_copies())

    @property
    def joined(self) -> int:
        """Of those ops, the ones computed in another op's kernel, one launch less each (the
        DeltaNet gates in the conv step's, a rollback's recurrences in the first one's, a head's
        rope and cache write in its norm's, a verify's RMS norm in the kernel that adds up the
        split product and residual before it), counted alike."""
        return int(self.handle.lucepy_cuda_kernels_joined())

    @property
    def bulk(self) -> int:
        """Of the products, those of ``gemm_rb`` (each warp's weights by Hopper's TMA unit: the
        big ones at 2-16 columns, lucepy-repacked.cu's ``bulk_product``), counted alike."""
        return int(self.handle.lucepy_cuda_kernels_bulk())

    @property
    def f8(self) -> int:
        """Of the products, those of ``gemm_f8`` (Hopper's FP8 warpgroup mma, the build's sm_90a
        code) on repacked Q4_0 or Q4_K at 9-16 columns: an FFN's gate and up (as one), and a
        product alone where each CTA slot gets 6 chunks and more (lucepy-repacked.cu's
        ``f8_single``: the 27B-shaped model's ffn down and DeltaNet inputs), counted alike."""
        return int(self.handle.lucepy_cuda_kernels_f8())

    @property
    def paired(self) -> int:
        """Of ``gemm_f8``'s products in parts, those whose parts the CTAs of each row tile, one
        cluster, added themselves (lucepy-mm.cu's ``f8_paired``: 2 parts, no norm after the
        product), where ``gemm_sum`` would have: one launch fewer each, counted alike."""
        return int(self.handle.lucepy_cuda_kernels_paired())

    @property
    def tailed(self) -> int:
        """Of ``gemm_f8``'s products of one part, those launched with a tail (lucepy-repacked.cu's
        ``f8_tail``: the row tiles past the last whole wave of one CTA an SM each cut into parts,
        which the last of them to finish adds), counted alike."""
        return int(self.handle.lucepy_cuda_kernels_tailed())

    def repack(self, tensor: Any) -> bool:
        """Rewrite a Q4_0 or Q4_K weight in a CUDA device's memory in place into lucepy's layout
        (vendor/ggml/cuda/lucepy-layouts.cuh), after which lucepy's kernels take every product of
        it and nothing else may read it; False, having done nothing, for a tensor they do not
        take (another type, rows not a multiple of 16 or of 256 values, not on a device where
        they are on)."""
        return bool(self.handle.lucepy_cuda_repack(_ffi.cast("void *", address(tensor))))


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
