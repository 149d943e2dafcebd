"""Devices: what this process's ggml can run on, and turning a device name into a backend.

Names are ``cpu`` or ``<backend>:<index>`` (``cuda:0``, ``vulkan:1``), the index counting devices of
that backend in ggml's registry order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lucepy.errors import DeviceError
from lucepy.ggml import Backend, Lib, ffi

_DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # lucepy's name: cpu, cuda:0
    backend: str  # cpu, cuda, vulkan, rpc, blas
    ggml_name: str  # ggml's own: CPU, CUDA0
    description: str
    kind: str  # cpu, gpu, igpu, accel
    memory_free: int
    memory_total: int

    def to_dict(self) -> dict:
        return asdict(self)


def _scan(lib: Lib) -> list[tuple[DeviceInfo, object]]:
    found, per_backend = [], {}
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        reg = lib.ggml_backend_dev_backend_reg(dev)
        backend = ffi.string(lib.ggml_backend_reg_name(reg)).decode().lower()
        index = per_backend.get(backend, 0)
        per_backend[backend] = index + 1
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        lib.ggml_backend_dev_memory(dev, free, total)
        info = DeviceInfo(
            name="cpu" if backend == "cpu" else f"{backend}:{index}",
            backend=backend,
            ggml_name=ffi.string(lib.ggml_backend_dev_name(dev)).decode(),
            description=ffi.string(lib.ggml_backend_dev_description(dev)).decode(),
            kind=_DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "unknown"),
            memory_free=free[0],
            memory_total=total[0],
        )
        found.append((info, dev))
    return found


def list_devices(lib: Lib) -> list[DeviceInfo]:
    return [info for info, _ in _scan(lib)]


def find_device(lib: Lib, name: str):
    """ggml's handle for lucepy's device ``name``; the error lists the devices there are."""
    wanted = name.strip().lower()
    devices = _scan(lib)
    for info, dev in devices:
        if info.name == wanted or (wanted == "cpu:0" and info.name == "cpu"):
            return dev
    names = ", ".join(info.name for info, _ in devices) or "none"
    raise DeviceError(
        f"unknown device {name!r}; this ggml build has: {names} (run `lucepy devices` to list them)"
    )


def local_backends(lib: Lib) -> set[str]:
    return {info.backend for info in list_devices(lib)}


def open_backend(
    lib: Lib, name: str, threads: int | None = None, batch_invariant: bool = False
) -> Backend:
    """A backend for the local device ``name``; ``batch_invariant``: RuntimeConfig's."""
    backend = Backend(lib, find_device(lib, name), name.strip().lower())
    if threads:
        backend.set_threads(threads)
    if batch_invariant:
        backend.use_reference_kernels()
    return backend
