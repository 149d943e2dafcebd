"""One address range whose first bytes are GPU memory and the rest pinned host RAM (CUDA's virtual
memory management, through the driver API): the GPU's kernels read both parts in place, so a MoE
layer's experts can be one ggml tensor with its hot experts on the GPU and its cold ones in host
RAM (runtime/shard.py, ``--cold-experts device``).

The range is reserved once; the device part and the host part are separate allocations mapped
back to back at a boundary rounded up to the allocation granularity (2 MiB on the H200), and
the device is given read-write access to the whole. ggml sees a CPU buffer wrapped around the
address (``ggml_backend_cpu_buffer_from_ptr``) that it never writes to: the data goes in with
``cuMemcpyHtoD`` and only the device's ops read it (graphs.compile_graph places them).
"""

from __future__ import annotations

import ctypes

import cffi

from lucepy.errors import ConfigError

_ffi = cffi.FFI()
_ffi.cdef("""
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
} CUmemAllocFlags;
typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    CUmemAllocFlags allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice dev);
CUresult cuCtxSetCurrent(void *ctx);
CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       int option);
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags);
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags);
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes);
CUresult cuGetErrorString(CUresult error, const char **str);
""")

_PINNED, _DEVICE, _HOST, _READWRITE = 1, 1, 2, 3  # cuda.h's enum values
_cuda = None


def _driver():
    global _cuda
    if _cuda is None:
        try:
            # the libcuda.so.1 ggml-cuda already loaded: the same driver, the same contexts
            ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
            _cuda = _ffi.dlopen("libcuda.so.1")
        except OSError as e:
            raise ConfigError(f"--cold-experts device needs CUDA's driver library: {e}") from e
    return _cuda


def _check(result: int, what: str) -> None:
    if result != 0:
        text = _ffi.new("const char **")
        _driver().cuGetErrorString(result, text)
        why = _ffi.string(text[0]).decode() if text[0] != _ffi.NULL else f"error {result}"
        raise ConfigError(f"{what} failed: {why} (try --cold-experts cpu)")


def _prop(location: int, device: int) -> object:
    prop = _ffi.new("CUmemAllocationProp *")
    prop.type = _PINNED
    prop.location.type = location
    prop.location.id = device if location == _DEVICE else 0
    return prop


class SplitMemory:
    """``size`` bytes at one device address, the first ``device_bytes`` (rounded up to the
    granularity) on CUDA device ``ordinal`` and the rest in pinned host RAM."""

    def __init__(self, ordinal: int, size: int, device_bytes: int):
        cu = _driver()
        _check(cu.cuInit(0), "cuInit")
        dev = _ffi.new("CUdevice *")
        _check(cu.cuDeviceGet(dev, ordinal), "cuDeviceGet")
        ctx = _ffi.new("void **")
        _check(cu.cuDevicePrimaryCtxRetain(ctx, dev[0]), "cuDevicePrimaryCtxRetain")
        _check(cu.cuCtxSetCurrent(ctx[0]), "cuCtxSetCurrent")
        self.granularity = max(self._granularity(loc, ordinal) for loc in (_DEVICE, _HOST))
        g = self.granularity
        self.size = -(-size // g) * g
        self.device_bytes = min(self.size, -(-device_bytes // g) * g)
        ptr = _ffi.new("CUdeviceptr *")
        _check(cu.cuMemAddressReserve(ptr, self.size, g, 0, 0), "cuMemAddressReserve")
        self.ptr, self._maps = int(ptr[0]), []
        try:
            offset = 0
            for location, n in (
                (_DEVICE, self.device_bytes),
                (_HOST, self.size - self.device_bytes),
            ):
                if n:
                    handle = _ffi.new("CUmemGenericAllocationHandle *")
                    _check(cu.cuMemCreate(handle, n, _prop(location, ordinal), 0), "cuMemCreate")
                    self._maps.append((offset, n, handle[0]))
                    _check(cu.cuMemMap(self.ptr + offset, n, 0, handle[0], 0), "cuMemMap")
                    offset += n
            access = _ffi.new("CUmemAccessDesc *")
            access.location.type, access.location.id, access.flags = _DEVICE, ordinal, _READWRITE
            _check(cu.cuMemSetAccess(self.ptr, self.size, access, 1), "cuMemSetAccess")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _granularity(location: int, ordinal: int) -> int:
        out = _ffi.new("size_t *")
        _check(
            _driver().cuMemGetAllocationGranularity(out, _prop(location, ordinal), 0),
            "cuMemGetAllocationGranularity",
        )
        return int(out[0])

    def write(self, offset: int, data) -> None:
        """Copy ``data`` (a buffer) to ``offset`` bytes into the range."""
        src = _ffi.from_buffer(data)
        _check(_driver().cuMemcpyHtoD_v2(self.ptr + offset, src, len(src)), "cuMemcpyHtoD")

    def close(self) -> None:
        cu = _driver()
        for offset, n, handle in self._maps:
            cu.cuMemUnmap(self.ptr + offset, n)
            cu.cuMemRelease(handle)
        self._maps = []
        if self.ptr:
            cu.cuMemAddressFree(self.ptr, self.size)
            self.ptr = 0
