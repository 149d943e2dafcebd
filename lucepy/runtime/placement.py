"""Placement: which device runs which layers, planned without loading a byte of weights.

Device names (``--target-devices``, comma-separated):
- ``cpu``, ``cuda:0``, ``hip:1``, ``vulkan:0``: a device of that backend. It runs in this process
  when this process's ggml has the backend, else in a worker spawned with that backend's build.
- ``DEVICE@worker``: the device, in a spawned worker process even if this build has it.
- ``rpc://HOST:PORT[/N]``: device N (default 0) of a worker that is already running.

Only ``cpu`` may repeat: each repeat is its own CPU backend (useful to test a split on one machine).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from lucepy.errors import ConfigError, DeviceError
from lucepy.models.state import spec_nbytes, state_specs

_LOCAL = re.compile(r"^(cpu|[a-z][a-z0-9_-]*:\d+)(@worker)?$")
_RPC = re.compile(r"^rpc://([^/:]+|\[[0-9a-fA-F:]+\]):(\d{1,5})(?:/(\d+))?$")


@dataclass(frozen=True)
class DeviceSpec:
    name: str  # as the user wrote it, normalised
    backend: str  # cpu, cuda, hip, vulkan, rpc
    device: str  # the device inside its process: cpu, cuda:0; for rpc the server's device index
    where: str  # "local", "worker" (spawned by us) or "remote" (a running worker)
    endpoint: str | None = None  # HOST:PORT for remote

    @property
    def process(self) -> str:
        return "local" if self.where == "local" else "worker"


def parse_device(text: str, local_backends: set[str]) -> DeviceSpec:
    name = text.strip().lower()
    m = _RPC.match(name)
    if m:
        port = int(m.group(2))
        if not 0 < port < 65536:
            raise DeviceError(f"device {text!r}: port {port} is out of range")
        index = m.group(3) or "0"
        return DeviceSpec(name, "rpc", index, "remote", f"{m.group(1)}:{port}")
    m = _LOCAL.match(name)
    if not m:
        raise DeviceError(
            f"unknown device {text!r}; write cpu, BACKEND:N (cuda:0, hip:1), "
            f"DEVICE@worker, or rpc://HOST:PORT[/N]"
        )
    device = m.group(1)
    backend = device.split(":")[0]
    forced = m.group(2) is not None
    where = "worker" if forced or backend not in local_backends else "local"
    return DeviceSpec(name, backend, device, where)


def parse_devices(text: str | list[str], local_backends: set[str]) -> list[DeviceSpec]:
    items = text.split(",") if isinstance(text, str) else list(text)
    specs = [parse_device(item, local_backends) for item in items if item.strip()]
    if not specs:
        raise DeviceError("--target-devices is empty; name at least one device, e.g. cpu")
    seen = set()
    for spec in specs:
        key = (spec.endpoint, spec.device) if spec.where == "remote" else spec.device
        if key in seen and key != "cpu":  # the CPU may host several shards, each its own backend
            raise DeviceError(
                f"device {spec.name!r} is listed twice; each shard needs its own device"
            )
        seen.add(key)
    return specs


def parse_split(text: str | list[float] | None, n_shards: int) -> list[float]:
    if text is None or text == "":
        return [1.0] * n_shards
    try:
        weights = [float(x) for x in text.split(",")] if isinstance(text, str) else list(text)
    except ValueError:
        raise ConfigError(
            f"--target-layer-split takes comma-separated numbers, got {text!r}"
        ) from None
    if len(weights) != n_shards:
        raise ConfigError(
            f"--target-layer-split has {len(weights)} weights for {n_shards} devices; "
            f"give one weight per device"
        )
    bad = [w for w in weights if not w > 0]
    if bad:
        raise ConfigError(f"--target-layer-split weights must be positive, got {bad[0]}")
    return weights


def layer_ranges(weights: list[float], n_layer: int) -> list[range]:
    """Contiguous ranges following the weights, each with at least one layer."""
    n = len(weights)
    if n > n_layer:
        raise ConfigError(f"{n} shards for a model of {n_layer} layers; use at most {n_layer}")
    total, acc, bounds = sum(weights), 0.0, [0]
    for i, w in enumerate(weights[:-1]):
        acc += w
        b = round(acc / total * n_layer)
        b = max(b, bounds[-1] + 1)  # at least one layer here
        b = min(b, n_layer - (n - 1 - i))  # and one for every shard after
        bounds.append(b)
    bounds.append(n_layer)
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def honour_split_points(
    ranges: list[range], points: list[int], reason: str = "the model's split points"
) -> tuple[list[range], list[str]]:
    """Move each inner boundary to the nearest one the model allows (decision 9), keeping every
    shard non-empty; say which moved."""
    allowed = sorted(set(points))
    bounds, notes = [r.start for r in ranges] + [ranges[-1].stop], []
    for i in range(1, len(bounds) - 1):
        ok = [b for b in allowed if bounds[i - 1] < b < bounds[i + 1]]
        if not ok:
            raise ConfigError(
                f"no layer boundary between {bounds[i - 1]} and {bounds[i + 1]} that this model "
                f"allows a split at ({allowed}); use fewer devices or another split"
            )
        best = min(ok, key=lambda b: (abs(b - bounds[i]), b))
        if best != bounds[i]:
            notes.append(f"split at layer {bounds[i]} moved to {best}: {reason}")
            bounds[i] = best
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)], notes


@dataclass(frozen=True)
class ShardPlan:
    device: str
    backend: str
    layers: tuple[int, int]
    weight_bytes: int
    state_bytes: int
    process: str  # "local" or "worker"

    def to_dict(self) -> dict:
        out = asdict(self)
        out["layers"] = list(self.layers)
        return out


@dataclass(frozen=True)
class LoadPlan:
    model: str
    architecture: str
    n_layer: int
    max_ctx: int
    shards: tuple[ShardPlan, ...]
    devices: tuple[DeviceSpec, ...]
    notes: tuple[str, ...] = ()  # boundaries the model's split points moved
    requested: tuple[tuple[int, int], ...] = ()  # the layer ranges asked for, before aligning
    memory: str = ""  # what the model's state holds, where it is not the whole context
    experts: Any = None  # an ExpertPlacement when routed experts are split (runtime/experts.py)
    kv_pool: dict | None = None  # KV Flash's pool (Engine adds the pager's counts when running)
    parallel: int = 1  # sequences decoded together, each with max_ctx positions of state

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "architecture": self.architecture,
            "n_layer": self.n_layer,
            "max_ctx": self.max_ctx,
            "parallel": self.parallel,
            "shards": [s.to_dict() for s in self.shards],
            "requested": [list(r) for r in self.requested],
            "notes": list(self.notes),
            "memory": self.memory,
            "experts": self.experts.to_dict() if self.experts is not None else None,
            "kv_pool": self.kv_pool,
        }


def plan_load(
    f, model, devices: list[DeviceSpec], split: list[float], max_ctx: int, parallel: int = 1
) -> LoadPlan:
    """Pure: the shards a load would make, with their bytes (``parallel`` sequences of up to
    ``max_ctx`` positions each). Reads only the GGUF index."""
    requested = layer_ranges(split, model.p.n_layer)
    ranges, notes = honour_split_points(requested, model.split_points(), model.split_reason())
    shards = []
    for spec, layers in zip(devices, ranges, strict=True):
        weights = sum(f.tensors[name].nbytes for name in model.weight_shapes(layers, f))
        specs = state_specs(model.make_state(layers, max_ctx * parallel))
        state = sum(spec_nbytes(t, s) for t, s in specs.values())
        shards.append(
            ShardPlan(
                spec.name, spec.backend, (layers.start, layers.stop), weights, state, spec.process
            )
        )
    return LoadPlan(
        str(f.path),
        f.architecture,
        model.p.n_layer,
        max_ctx,
        tuple(shards),
        tuple(devices),
        tuple(notes),
        tuple((r.start, r.stop) for r in requested),
        model.memory_note(max_ctx),
        parallel=parallel,
    )
