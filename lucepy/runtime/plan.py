"""The load plan of a ``RuntimeConfig`` on this process's ggml, before any weights load (``lucepy
plan`` prints it): devices, layer split, KV Flash's pool, experts in host RAM, and the model
options the config implies."""

from __future__ import annotations

import dataclasses
import os

from lucepy import ggml
from lucepy.errors import ConfigError, DeviceError
from lucepy.gguf import GGUFFile
from lucepy.models import ModelOptions
from lucepy.models.state import spec_nbytes, state_specs
from lucepy.runtime import backends, experts
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.devices import list_devices, local_backends
from lucepy.runtime.placement import LoadPlan, parse_devices, parse_split, plan_load


def make_plan(f: GGUFFile, model, config: RuntimeConfig, lib) -> LoadPlan:
    """The load plan for ``config`` on this process's ggml; loads no weights."""
    specs = parse_devices(config.device, local_backends(lib))
    split = parse_split(config.layer_split, len(specs))
    for spec in specs:
        if spec.where == "worker" and spec.backend not in local_backends(lib):
            if backends.find_build(spec.backend) is None:
                raise DeviceError(
                    f"device {spec.name!r}: this ggml has no {spec.backend} backend and there is "
                    f"no {spec.backend} build in {backends.default_prefix(spec.backend)}; run "
                    f"`lucepy backends build {spec.backend}`"
                )
    n_ctx = config.context_for(model.p.n_ctx_train)
    if config.parallel > 1:
        single = [s for s in model.make_state(range(model.p.n_layer), 1) if not s.sequences]
        if single:
            raise ConfigError(
                f"--parallel: {f.architecture}'s sliding-window caches hold one sequence; decode "
                f"its requests one at a time (--parallel 1)"
            )
    plan = plan_load(f, model, specs, split, n_ctx, config.parallel)
    if config.parallel > 1:
        check_fits(plan, list_devices(lib))
    if 0 < config.kv_pool < plan.max_ctx:
        plan = dataclasses.replace(plan, kv_pool=pool_plan(model, config, plan.max_ctx))
    placement = experts.placement_for(f, model.p, config)
    if placement is None:
        return plan
    shards = []
    for spec, sp in zip(specs, plan.shards, strict=True):
        _, host = placement.bytes(range(*sp.layers))
        if host and spec.where != "local":
            raise ConfigError(
                f"device {spec.name!r}: experts in host RAM are placed on local devices only"
            )
        shards.append(dataclasses.replace(sp, weight_bytes=sp.weight_bytes - host))
    return dataclasses.replace(plan, shards=tuple(shards), experts=placement)


def check_fits(plan: LoadPlan, devices: list) -> None:
    """Refuse a plan whose weights and state do not fit a local device's free memory (the
    caches of ``--parallel`` sequences grow with N), before any weights load."""
    free = {d.name: d.memory_free for d in devices}
    need: dict[str, int] = {}
    for shard in plan.shards:
        if shard.process == "local" and shard.device in free:
            need[shard.device] = need.get(shard.device, 0) + shard.weight_bytes + shard.state_bytes
    for name, total in need.items():
        if total > free[name]:
            per_seq = sum(s.state_bytes for s in plan.shards if s.device == name) // plan.parallel
            raise ConfigError(
                f"--parallel {plan.parallel} needs {total / 2**20:,.0f} MiB on {name} (weights "
                f"and {plan.parallel} x {per_seq / 2**20:,.0f} MiB of cache for {plan.max_ctx} "
                f"positions each); {free[name] / 2**20:,.0f} MiB are free: lower --parallel or "
                f"--max-ctx"
            )


def pool_plan(model, config: RuntimeConfig, n_ctx: int) -> dict:
    """KV Flash's pool in the plan: its tokens and rows, and the bytes of the full-attention
    caches with it and with the whole context."""
    states = [s for s in model.make_state(range(model.p.n_layer), n_ctx) if s.appends]
    specs = state_specs(states)
    pooled = sum(spec_nbytes(t, shape) for t, shape in specs.values())
    rows = max((shape[-1] for _, shape in specs.values()), default=0)
    return {
        "pool_tokens": config.kv_pool,
        "cache_rows": rows,
        "policy": config.kv_pool_rank,
        "layers": len(states),
        "pool_bytes": pooled,
        "full_cache_bytes": pooled // max(rows, 1) * n_ctx,
    }


def _stacking(config: RuntimeConfig) -> bool:
    """Products of one input as one matrix (decision 2) where a device is not a CPU: there they
    save launches (H200: laguna decode 1.10x, qwen35 1.03x); on a CPU they gain nothing and move
    f32 sums in the last bits. LUCEPY_STACK_MATMULS=1 or 0 decides instead, to measure it."""
    forced = os.environ.get("LUCEPY_STACK_MATMULS")
    if forced in ("0", "1"):
        return forced == "1"
    return config.beyond_cpus


def model_options(config: RuntimeConfig) -> ModelOptions:
    types = {"f16": ggml.GGML_TYPE_F16, "q8_0": ggml.GGML_TYPE_Q8_0}
    return ModelOptions(
        max_step=config.chunk,
        flash_attn=config.flash_attn,
        cache_type_k=types[config.cache_type_k],
        cache_type_v=types[config.cache_type_v],
        kv_pool=config.kv_pool,
        n_seq=config.parallel,
        stack_matmuls=_stacking(config),
    )
