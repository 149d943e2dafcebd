"""RuntimeConfig: where and how to run a model, kept apart from the model's own Params.

The CLI builds it from flags; the server and the benchmarks receive it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lucepy.errors import ConfigError

DEFAULT_CTX = 4096
CACHE_TYPES = ("f16", "q8_0")  # KV cache types, as llama.cpp's -ctk/-ctv spell them
DEFAULT_CHUNK = 512


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "cpu"  # one device, or a comma-separated list: one shard each (runtime/placement)
    layer_split: str | None = None  # weights of the layer split, e.g. "1,3"; None: even
    max_ctx: int | None = None  # None: the model's training context, capped at DEFAULT_CTX
    chunk: int = DEFAULT_CHUNK  # prefill batch size
    threads: int | None = None  # CPU threads; None: all cores
    step_deadline_s: float = 30.0  # least time a remote step gets before its worker is replaced
    # most a remote connect, load, reset or close gets before its worker is replaced (an hour:
    # a shard's weights over a slow link may take many minutes)
    setup_deadline_s: float = 3600.0
    flash_attn: bool = True  # llama.cpp's -fa: off computes KQ, softmax and V^T KQ as its own ops
    # local CPU backends run ggml's reference kernels: a row of a step rounds as in a one-row step
    # (no split-KV or tiled attention), so speculation commits exactly the greedy tokens
    batch_invariant: bool = False
    cache_type_k: str = "f16"  # KV cache types (llama.cpp's -ctk/-ctv)
    cache_type_v: str = "f16"
    draft: str | None = None  # a DFlash draft GGUF
    draft_device: str | None = None  # None: the last target shard's device if local, else cpu
    draft_block: int | None = None  # None: the draft's trained block size
    # "fixed": every step verifies the block; "auto": the length with the most tokens per second
    # from measured step costs and the running acceptance (decode/verify_len.py)
    verify_len: str = "fixed"
    prefix_cache_slots: int = 0  # RAM prefix snapshots kept (LRU); 0: no RAM cache
    prefix_cache_mb: int = 4096  # byte budget of the RAM snapshots
    kv_cache_dir: str | None = None  # disk prefix snapshots live here; None: no disk cache
    kv_cache_budget_mb: int = 8192  # the disk cache is evicted (LRU) to stay under this
    disk_prefix_cache: str = "auto:256"  # off | full | auto:N | N (docs/prefix-cache.md)
    # MoE (runtime/experts.py): a byte budget for routed experts on each shard's device, the
    # hottest first, the rest in host RAM; or llama.cpp's --n-cpu-moe; and the hotness profile
    moe_device_mb: float | None = None  # None: every expert with its layer
    n_cpu_moe: int = 0
    expert_profile: str | None = None  # None: <cache>/experts/<model identity>.npz
    save_expert_profile: bool = False  # add this run's routing counts to the profile on close
    count_experts: bool = True  # count prompt and verify tokens' experts (decode steps never)
    # who computes the experts in host RAM: "cpu", a host CPU backend in the same step (as
    # llama.cpp's --n-cpu-moe); "device", the shard's GPU, reading them from pinned host RAM
    cold_experts: str = "cpu"
    kv_pool: int = 0  # KV Flash: cache rows of each full-attention layer (runtime/pager.py); 0: all
    kv_pool_rank: str = "lru"  # which chunks the pool keeps: "lru", or "qk" (query-key scores)
    parallel: int = 1  # sequences decoded in one step (decode/batch.py), max_ctx positions each

    def __post_init__(self) -> None:
        if self.verify_len not in ("fixed", "auto"):
            raise ConfigError(f"verify_len must be 'fixed' or 'auto', got {self.verify_len!r}")
        if self.chunk < 1:
            raise ConfigError(f"--chunk must be at least 1, got {self.chunk}")
        if self.max_ctx is not None and self.max_ctx < 1:
            raise ConfigError(f"--max-ctx must be at least 1, got {self.max_ctx}")
        if self.prefix_cache_slots < 0 or self.prefix_cache_mb < 1 or self.kv_cache_budget_mb < 1:
            raise ConfigError("prefix cache slots and budgets must be positive")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {self.threads}")
        for flag, value in (("k", self.cache_type_k), ("v", self.cache_type_v)):
            if value not in CACHE_TYPES:
                raise ConfigError(f"--cache-type-{flag} {value!r}: use one of {list(CACHE_TYPES)}")
        if self.n_cpu_moe < 0 or (self.moe_device_mb is not None and self.moe_device_mb < 0):
            raise ConfigError("--n-cpu-moe and --moe-gpu-mb must not be negative")
        if self.parallel < 1:
            raise ConfigError(f"--parallel must be at least 1, got {self.parallel}")
        if self.parallel > 1 and self.kv_pool:
            raise ConfigError("--parallel above 1 runs without --kv-pool")
        if self.kv_pool < 0:
            raise ConfigError(f"--kv-pool must not be negative, got {self.kv_pool}")
        if self.kv_pool_rank not in ("lru", "qk"):
            raise ConfigError(f"--kv-pool-rank {self.kv_pool_rank!r}: use lru or qk")
        if self.cold_experts not in ("cpu", "device"):
            raise ConfigError(f"--cold-experts {self.cold_experts!r}: use cpu or device")
        if self.n_cpu_moe and self.moe_device_mb is not None:
            raise ConfigError("use --n-cpu-moe or --moe-gpu-mb, not both")
        if self.cache_type_v != "f16" and not self.flash_attn:
            raise ConfigError(
                "a quantized V cache needs flash attention (as in llama.cpp); drop "
                "--no-flash-attn or use --cache-type-v f16"
            )

    @property
    def beyond_cpus(self) -> bool:
        """Whether a device of the run is not a CPU (a GPU, here or in a worker)."""
        return any(not d.strip().startswith("cpu") for d in self.device.split(","))

    def context_for(self, n_ctx_train: int) -> int:
        return self.max_ctx or min(n_ctx_train, DEFAULT_CTX)

    def thread_count(self) -> int:
        return self.threads or os.cpu_count() or 1
