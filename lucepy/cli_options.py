"""The options the ``lucepy`` commands share (typer's annotated types) and the one place their
values become a ``RuntimeConfig`` (``runtime_config``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NamedTuple

import typer

from lucepy.errors import ConfigError
from lucepy.runtime.config import RuntimeConfig

TargetDevices = Annotated[
    str,
    typer.Option(
        "--target-devices",
        "--device",
        help="devices, one shard each: cpu, cuda:0,cuda:1, cuda:0,hip:0, cpu,cpu@worker, "
        "cuda:0,rpc://HOST:PORT",
    ),
]
LayerSplit = Annotated[
    str | None,
    typer.Option("--target-layer-split", help="layer split weights, one per device: 0.3,0.7"),
]
MaxCtx = Annotated[int | None, typer.Option(min=1, help="context size in tokens")]
Chunk = Annotated[int, typer.Option(min=1, help="prefill batch size")]
Threads = Annotated[int | None, typer.Option(min=1, help="CPU threads")]
FlashAttn = Annotated[
    bool,
    typer.Option(
        "--flash-attn/--no-flash-attn", help="flash attention, as llama.cpp's -fa on (default)/off"
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="print one JSON object")]
Parallel = Annotated[
    int,
    typer.Option(
        "--parallel",
        "-np",
        min=1,
        help="sequences decoded together, each with --max-ctx positions (llama-server's -np)",
    ),
]
BatchInvariant = Annotated[
    bool,
    typer.Option(
        "--batch-invariant",
        help="CPU: ggml's reference kernels, so a row of a step rounds as in a one-row step and "
        "speculation commits exactly the greedy tokens (prefill about 20% slower)",
    ),
]
Draft = Annotated[Path | None, typer.Option(help="a DFlash draft GGUF: speculative decoding")]
DraftDevice = Annotated[
    str | None,
    typer.Option(help="device for the draft (default: the last target shard's, if local)"),
]
DraftBlock = Annotated[
    str,
    typer.Option(
        help="tokens a speculative step verifies: auto (the most tokens per second from measured "
        "step costs and the running acceptance) or a fixed 2..trained block"
    ),
]
Temperature = Annotated[float, typer.Option(min=0.0, help="sampling temperature; 0 is greedy")]
TopP = Annotated[float, typer.Option(min=0.0, max=1.0, help="nucleus sampling mass")]
TopK = Annotated[int, typer.Option(min=0, help="sample among the k most likely; 0: all")]
Seed = Annotated[int | None, typer.Option(help="sampling seed")]
# prefix snapshots (lucepy/cache); the defaults are RuntimeConfig's
CacheSlots = Annotated[
    int, typer.Option("--prefix-cache-slots", min=0, help="RAM prefix snapshots kept; 0: off")
]
CacheMB = Annotated[int, typer.Option("--prefix-cache-mb", min=1, help="RAM snapshot budget, MB")]
KVCacheDir = Annotated[
    Path | None, typer.Option("--kv-cache-dir", help="keep prefix snapshots on disk here")
]
KVCacheBudget = Annotated[
    int, typer.Option("--kv-cache-budget", min=1, help="disk snapshot budget, MB (LRU)")
]
DiskPolicy = Annotated[
    str,
    typer.Option(
        "--disk-prefix-cache", help="which prefixes go to disk: off, full, auto:N or N tokens"
    ),
]
CacheTypeK = Annotated[
    str, typer.Option("--cache-type-k", "-ctk", help="KV cache type of K: f16 or q8_0")
]
CacheTypeV = Annotated[
    str, typer.Option("--cache-type-v", "-ctv", help="KV cache type of V: f16 or q8_0")
]
MoeDeviceMB = Annotated[
    int | None,
    typer.Option(
        "--moe-gpu-mb",
        min=0,
        help="MB of routed experts on each shard's device, the hottest first (the expert "
        "profile); the rest stay in host RAM, computed by the CPU",
    ),
]
NCpuMoe = Annotated[
    int,
    typer.Option(
        "--n-cpu-moe", min=0, help="keep all experts of the first N layers in host RAM (llama.cpp)"
    ),
]
ColdExperts = Annotated[
    str,
    typer.Option(
        "--cold-experts",
        help="who computes the experts in host RAM (--moe-gpu-mb, --n-cpu-moe): cpu (the host's "
        "CPU, in the same step, as llama.cpp) or device (the GPU, reading them from pinned host "
        "RAM over the bus)",
    ),
]
KvPool = Annotated[
    int,
    typer.Option(
        "--kv-pool",
        min=0,
        help="KV Flash: tokens each full-attention layer keeps on its device, paged in chunks "
        "of 64 to host RAM; attention sees the first chunk, the last 256 tokens and the chunks "
        "the ranking keeps (0: the whole context)",
    ),
]
KvPoolRank = Annotated[
    str,
    typer.Option(
        "--kv-pool-rank",
        help="which chunks a KV pool keeps: lru (the latest written) or qk (those the latest "
        "query attends to most, brought back from host RAM)",
    ),
]
ExpertProfile = Annotated[
    Path | None,
    typer.Option(help="the expert hotness profile (default: <cache>/experts/<model>.npz)"),
]
DEFAULTS = RuntimeConfig()


class ComputeFlags(NamedTuple):
    """How to compute, as llama.cpp's -fa, -ctk, -ctv and --n-cpu-moe say, and where the
    experts of a MoE model go."""

    flash_attn: bool = DEFAULTS.flash_attn
    cache_type_k: str = DEFAULTS.cache_type_k
    cache_type_v: str = DEFAULTS.cache_type_v
    moe_device_mb: int | None = None
    n_cpu_moe: int = 0
    expert_profile: Path | None = None
    save_expert_profile: bool = False  # serve and generate add their routing counts to it
    kv_pool: int = 0
    kv_pool_rank: str = DEFAULTS.kv_pool_rank
    batch_invariant: bool = DEFAULTS.batch_invariant
    parallel: int = DEFAULTS.parallel
    cold_experts: str = DEFAULTS.cold_experts


class CacheFlags(NamedTuple):
    slots: int = DEFAULTS.prefix_cache_slots
    mb: int = DEFAULTS.prefix_cache_mb
    kv_dir: Path | None = DEFAULTS.kv_cache_dir
    kv_budget_mb: int = DEFAULTS.kv_cache_budget_mb
    disk: str = DEFAULTS.disk_prefix_cache


def _block(value: int | str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"--draft-block must be 'auto' or a number, got {value!r}") from None


def runtime_config(
    target_devices: str = "cpu",
    layer_split: str | None = None,
    max_ctx: int | None = None,
    chunk: int = 512,
    threads: int | None = None,
    draft: Path | None = None,
    draft_device: str | None = None,
    draft_block: int | str | None = None,
    cache: CacheFlags = CacheFlags(),  # noqa: B008 (an immutable tuple)
    compute: ComputeFlags = ComputeFlags(),  # noqa: B008 (an immutable tuple)
) -> RuntimeConfig:
    """The one place CLI flags become a RuntimeConfig (generate, bench, plan, serve)."""
    from lucepy.cache.policy import parse_policy

    parse_policy(cache.disk)  # a bad --disk-prefix-cache fails before any weights load
    return RuntimeConfig(
        device=target_devices,
        layer_split=layer_split,
        max_ctx=max_ctx,
        chunk=chunk,
        threads=threads,
        flash_attn=compute.flash_attn,
        batch_invariant=compute.batch_invariant,
        parallel=compute.parallel,
        cache_type_k=compute.cache_type_k,
        cache_type_v=compute.cache_type_v,
        draft=str(draft) if draft else None,
        draft_device=draft_device,
        draft_block=None if draft_block in (None, "auto") else _block(draft_block),
        verify_len="auto" if draft_block == "auto" else "fixed",
        prefix_cache_slots=cache.slots,
        prefix_cache_mb=cache.mb,
        kv_cache_dir=str(cache.kv_dir) if cache.kv_dir else None,
        kv_cache_budget_mb=cache.kv_budget_mb,
        disk_prefix_cache=cache.disk,
        moe_device_mb=compute.moe_device_mb,
        n_cpu_moe=compute.n_cpu_moe,
        cold_experts=compute.cold_experts,
        expert_profile=str(compute.expert_profile) if compute.expert_profile else None,
        save_expert_profile=compute.save_expert_profile,
        kv_pool=compute.kv_pool,
        kv_pool_rank=compute.kv_pool_rank,
    )
