"""Owner classes for ggml handles: each frees its handle exactly once.

``close()`` frees now and is safe to call twice; an owner dropped without ``close()`` is freed by
the garbage collector. A NULL from a constructor raises GGMLError naming the call and its input.
"""

from __future__ import annotations

import weakref
from typing import Any

from lucepy.errors import GGMLError
from lucepy.ggml.lib import Lib, ffi


class Owner:
    ptr: Any

    def _own(self, ptr: Any, free: Any, what: str) -> None:
        if ptr == ffi.NULL:
            raise GGMLError(f"{what} returned NULL")
        self.ptr = ptr
        self._finalizer = weakref.finalize(self, free, ptr)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()
        self.ptr = ffi.NULL

    def abandon(self) -> None:
        """Forget the handle without freeing it (its server is gone; freeing would block)."""
        self._finalizer.detach()
        self.ptr = ffi.NULL

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Context(Owner):
    """A ggml_context. With no_alloc it only holds tensor headers; data lives in backend buffers."""

    def __init__(self, lib: Lib, n_tensors: int, *, graph_nodes: int = 0, no_alloc: bool = True):
        self.lib = lib
        size = lib.ggml_tensor_overhead() * n_tensors
        if graph_nodes:
            size += lib.ggml_graph_overhead_custom(graph_nodes, False)
        params = ffi.new("struct ggml_init_params *", {"mem_size": size, "no_alloc": no_alloc})
        self._own(lib.ggml_init(params[0]), lib.ggml_free, f"ggml_init(mem_size={size})")


class Backend(Owner):
    def __init__(self, lib: Lib, device: Any, name: str):
        self.lib, self.device, self.name = lib, device, name
        self._own(
            lib.ggml_backend_dev_init(device, ffi.NULL),
            lib.ggml_backend_free,
            f"ggml_backend_dev_init({name})",
        )

    @property
    def buffer_type(self) -> Any:
        return self.lib.ggml_backend_get_default_buffer_type(self.ptr)

    @property
    def is_local_gpu(self) -> bool:
        """A GPU in this process (not a CPU, not an RPC proxy of a device elsewhere)."""
        lib, dev = self.lib, self.device
        kind = lib.ggml_backend_dev_type(dev)
        reg = ffi.string(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev)))
        return kind in (lib.GGML_BACKEND_DEVICE_TYPE_GPU, lib.GGML_BACKEND_DEVICE_TYPE_IGPU) and (
            reg != b"RPC"
        )

    @property
    def is_cpu(self) -> bool:
        return bool(self.lib.ggml_backend_is_cpu(self.ptr))

    def set_threads(self, n: int) -> None:
        if self.is_cpu:
            self.lib.ggml_backend_cpu_set_n_threads(self.ptr, n)

    def use_reference_kernels(self) -> None:
        """ggml-cpu's reference kernels from now on: attention computes every query row alone
        over the whole cache (no split of the cache across threads for one row, no tiles of
        rows), and no ops are fused."""
        if self.is_cpu:
            self.lib.ggml_backend_cpu_set_use_ref(self.ptr, True)

    def synchronize(self) -> None:
        self.lib.ggml_backend_synchronize(self.ptr)


class Buffer(Owner):
    """A backend buffer holding every tensor of a context (weights, KV, state), of the backend's
    own buffer type or of ``buft`` (a CPU extra type: repacked weights)."""

    def __init__(self, lib: Lib, ctx: Context, backend: Backend, what: str, buft: Any = None):
        self.lib = lib
        if buft is None:
            ptr = lib.ggml_backend_alloc_ctx_tensors(ctx.ptr, backend.ptr)
        else:
            ptr = lib.ggml_backend_alloc_ctx_tensors_from_buft(ctx.ptr, buft)
        self._own(ptr, lib.ggml_backend_buffer_free, f"ggml_backend_alloc_ctx_tensors({what})")
        self.nbytes = lib.ggml_backend_buffer_get_size(ptr)

    def clear(self, value: int = 0) -> None:
        self.lib.ggml_backend_buffer_clear(self.ptr, value)


class RawBuffer(Owner):
    """``size`` bytes of buffer type ``buft`` with no tensors of its own (a staging area)."""

    def __init__(self, lib: Lib, buft: Any, size: int, what: str):
        self.lib, self.nbytes = lib, size
        self._own(
            lib.ggml_backend_buft_alloc_buffer(buft, size),
            lib.ggml_backend_buffer_free,
            f"ggml_backend_buft_alloc_buffer({what}, {size})",
        )
        self.base = lib.ggml_backend_buffer_get_base(self.ptr)


class Allocator(Owner):
    """A graph allocator: the compute buffer of one reusable graph."""

    def __init__(self, lib: Lib, backend: Backend):
        self.lib = lib
        self._own(
            lib.ggml_gallocr_new(backend.buffer_type),
            lib.ggml_gallocr_free,
            f"ggml_gallocr_new({backend.name})",
        )

    def alloc(self, graph: Any) -> None:
        if not self.lib.ggml_gallocr_alloc_graph(self.ptr, graph):
            raise GGMLError("ggml_gallocr_alloc_graph failed: out of device memory for the graph")

    @property
    def nbytes(self) -> int:
        return self.lib.ggml_gallocr_get_buffer_size(self.ptr, 0)


_BUFT_BYTES = 8 * ffi.sizeof("void *")  # struct ggml_backend_buffer_type at the pinned ggml


class Sched(Owner):
    """A ggml_backend_sched over ``backends`` (the last one a CPU): the compute buffers of one
    reusable graph whose nodes run on several backends, with the copies between them."""

    def __init__(self, lib: Lib, backends: list[Backend], graph_size: int):
        self.lib, self.backends = lib, backends
        self._ptrs = ffi.new("ggml_backend_t[]", [b.ptr for b in backends])
        self._bufts = ffi.new("ggml_backend_buffer_type_t[]", [b.buffer_type for b in backends])
        # the CPU's compute buffer in the first device's pinned host memory, where it has one
        # (CUDA): copies between the two are then direct DMA, as llama.cpp sets it up
        dev = lib.ggml_backend_get_device(backends[0].ptr)
        pinned = lib.ggml_backend_dev_host_buffer_type(dev) if dev != ffi.NULL else ffi.NULL
        if pinned != ffi.NULL and lib.ggml_backend_is_cpu(backends[-1].ptr):
            self._bufts[len(backends) - 1] = pinned
        self._copies = []
        for i in range(1, len(backends)):
            if self._bufts[i] in list(self._bufts)[:i]:
                # The scheduler moves a node to an earlier backend of the same buffer type (its
                # pass 3), which would fold a second CPU backend into the first. A byte copy of
                # the type (ggml-backend-impl.h: 6 function pointers, device, context) behaves
                # the same at another address, so each backend keeps what it was given.
                copy = ffi.new("char[]", _BUFT_BYTES)
                ffi.memmove(copy, self._bufts[i], _BUFT_BYTES)
                self._copies.append(copy)
                self._bufts[i] = ffi.cast("ggml_backend_buffer_type_t", copy)
        n = len(backends)
        self._own(
            lib.ggml_backend_sched_new(self._ptrs, self._bufts, n, graph_size, False, False),
            lib.ggml_backend_sched_free,
            f"ggml_backend_sched_new({', '.join(b.name for b in backends)})",
        )

    def assign(self, node: Any, backend: Backend) -> None:
        self.lib.ggml_backend_sched_set_tensor_backend(self.ptr, node, backend.ptr)

    def alloc(self, graph: Any) -> None:
        if not self.lib.ggml_backend_sched_alloc_graph(self.ptr, graph):
            raise GGMLError("ggml_backend_sched_alloc_graph failed: out of memory for the graph")

    def compute(self, graph: Any) -> int:
        return self.lib.ggml_backend_sched_graph_compute(self.ptr, graph)

    @property
    def nbytes(self) -> int:
        get = self.lib.ggml_backend_sched_get_buffer_size
        return sum(get(self.ptr, b.ptr) for b in self.backends)


def alias_tensor(
    lib: Lib, ctx: Any, src: Any, shape: tuple[int, ...], strides: tuple[int, ...], offset: int
) -> Any:
    """A new tensor header in ``ctx`` over ``src``'s memory: ``shape`` with byte ``strides`` for
    dims 1.. (dim 0 is contiguous), starting ``offset`` bytes in. Not a view: it has no op and no
    source, so graphs and copies treat it as plain data."""
    ne = ffi.new("int64_t[4]", list(shape) + [1] * (4 - len(shape)))
    t = lib.ggml_new_tensor(ctx, src.type, len(shape), ne)
    for i, nb in enumerate(strides):
        t.nb[i + 1] = nb
    for i in range(len(strides) + 1, 4):
        t.nb[i] = t.nb[i - 1] * t.ne[i - 1]
    t.buffer = src.buffer
    t.data = ffi.cast("char *", src.data) + offset
    return t


def tensor_set(lib: Lib, t: Any, data: Any) -> None:
    """Fill tensor ``t`` from ``data`` (a contiguous array or bytes-like view of exactly its size);
    a size that differs is an error, not a short or overrunning copy."""
    buf = ffi.from_buffer(data)
    if len(buf) != lib.ggml_nbytes(t):
        raise ValueError(f"{len(buf)} bytes for a tensor of {lib.ggml_nbytes(t)}")
    lib.ggml_backend_tensor_set(t, buf, 0, len(buf))
