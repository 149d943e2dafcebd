"""The ``lucepy`` command. Each command parses flags, calls the Engine API, and renders via tui.

This module holds the app, the shared options and generate/bench/plan/devices; serve/models/top
live in ``cli_serve`` and worker/backends in ``cli_backends``, registered on the same app.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, NamedTuple

import typer

from lucepy import tui
from lucepy.errors import ConfigError, LucepyError, PromptError
from lucepy.runtime.config import RuntimeConfig

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Serve and benchmark GGUF models split across devices.",
)


def run_body(fn):
    """Run a command body; a LucepyError becomes one line on stderr and exit status 1."""
    try:
        return fn()
    except LucepyError as err:
        tui.error(str(err))
        raise typer.Exit(1) from None


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False):
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )


@app.command()
def devices(as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False):
    """List the ggml backends and devices of this install, with their memory."""

    def body():
        from lucepy.ggml import load
        from lucepy.runtime.devices import list_devices

        found = list_devices(load())
        if as_json:
            tui.print_json(json.dumps({"devices": [d.to_dict() for d in found]}))
        else:
            tui.show(tui.devices_table(found))

    run_body(body)


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


def chat_prompt(tokenizer, prompt: str, system: str | None) -> str:
    """``prompt`` as a user turn (after ``system``) through the model's own chat template."""
    from lucepy.server.chat import chat_text

    messages = [{"role": "user", "content": prompt}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return chat_text(tokenizer, messages)


def _parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise PromptError(f"--prompt-tokens takes comma-separated integers, got {text!r}") from None
    if not tokens:
        raise PromptError("--prompt-tokens is empty")
    return tokens


@app.command()
def generate(
    model: Annotated[
        str | None,
        typer.Argument(help="a GGUF file or a models.yaml name; default: smollm2-135m-instruct"),
    ] = None,
    prompt: Annotated[str | None, typer.Option(help="prompt text, raw unless --chat")] = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="send --prompt as a user turn of the chat template")
    ] = False,
    system: Annotated[str | None, typer.Option(help="a system message (implies --chat)")] = None,
    prompt_tokens: Annotated[str | None, typer.Option(help="prompt as token ids: 1,2,3")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="tokens to generate")] = 64,
    chunk: Chunk = 512,
    target_devices: TargetDevices = None,
    target_layer_split: LayerSplit = None,
    max_ctx: MaxCtx = None,
    threads: Threads = None,
    flash_attn: FlashAttn = True,
    cache_type_k: CacheTypeK = DEFAULTS.cache_type_k,
    cache_type_v: CacheTypeV = DEFAULTS.cache_type_v,
    draft: Draft = None,
    draft_device: DraftDevice = None,
    draft_block: DraftBlock = "auto",
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    seed: Seed = None,
    prefix_cache_slots: CacheSlots = DEFAULTS.prefix_cache_slots,
    prefix_cache_mb: CacheMB = DEFAULTS.prefix_cache_mb,
    kv_cache_dir: KVCacheDir = None,
    kv_cache_budget: KVCacheBudget = DEFAULTS.kv_cache_budget_mb,
    disk_prefix_cache: DiskPolicy = DEFAULTS.disk_prefix_cache,
    moe_gpu_mb: MoeDeviceMB = None,
    n_cpu_moe: NCpuMoe = 0,
    cold_experts: ColdExperts = DEFAULTS.cold_experts,
    expert_profile: ExpertProfile = None,
    kv_pool: KvPool = 0,
    kv_pool_rank: KvPoolRank = DEFAULTS.kv_pool_rank,
    batch_invariant: BatchInvariant = False,
    as_json: AsJson = False,
):
    """Generate from a prompt: greedy by default, speculative with a draft (--draft or the
    models.yaml entry's)."""
    cache = CacheFlags(
        prefix_cache_slots, prefix_cache_mb, kv_cache_dir, kv_cache_budget, disk_prefix_cache
    )

    def body():
        from lucepy.cli_serve import open_model
        from lucepy.decode.sampling import SamplingParams

        if (prompt is None) == (prompt_tokens is None):
            raise PromptError("give exactly one of --prompt TEXT or --prompt-tokens 1,2,3")
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        compute = ComputeFlags(
            flash_attn, cache_type_k, cache_type_v, moe_gpu_mb, n_cpu_moe, expert_profile, True,
            kv_pool, kv_pool_rank, batch_invariant, cold_experts=cold_experts,
        )  # fmt: skip
        placement = (target_devices, target_layer_split, max_ctx, chunk, threads, compute)
        _, engine = open_model(model, placement, (draft, draft_device, draft_block), cache)
        with engine:
            if prompt is not None and (chat or system is not None):
                tokens = engine.tokenizer.encode(chat_prompt(engine.tokenizer, prompt, system))
            elif prompt is not None:
                tokens = engine.tokenizer.encode(prompt)
            else:
                tokens = _parse_tokens(prompt_tokens)
            gen = engine.generate(tokens, max_tokens, sampling=sampling, chunk=chunk)
        if as_json:
            tui.print_json(json.dumps(gen.to_dict()))
        else:
            tui.generation(gen)

    run_body(body)


@app.command()
def bench(
    model: Annotated[Path, typer.Argument(help="a GGUF model file")],
    prompt_len: Annotated[int, typer.Option(min=1, help="prompt tokens for prefill")] = 512,
    gen: Annotated[int, typer.Option(min=1, help="tokens to decode")] = 64,
    chunk: Chunk = 512,
    target_devices: TargetDevices = "cpu",
    target_layer_split: LayerSplit = None,
    threads: Threads = None,
    flash_attn: FlashAttn = True,
    cache_type_k: CacheTypeK = DEFAULTS.cache_type_k,
    cache_type_v: CacheTypeV = DEFAULTS.cache_type_v,
    repeats: Annotated[int, typer.Option(min=1, help="timed runs; the median is reported")] = 3,
    vs_llama_cpp: Annotated[
        bool, typer.Option("--vs-llama-cpp/--no-llama-cpp", help="measure llama.cpp too")
    ] = True,
    prefix_cache_slots: CacheSlots = DEFAULTS.prefix_cache_slots,
    prefix_cache_mb: CacheMB = DEFAULTS.prefix_cache_mb,
    kv_cache_dir: KVCacheDir = None,
    kv_cache_budget: KVCacheBudget = DEFAULTS.kv_cache_budget_mb,
    disk_prefix_cache: DiskPolicy = DEFAULTS.disk_prefix_cache,
    as_json: AsJson = False,
):
    """Prefill and decode tokens/s, side by side with llama.cpp on the same GGUF."""
    cache = CacheFlags(
        prefix_cache_slots, prefix_cache_mb, kv_cache_dir, kv_cache_budget, disk_prefix_cache
    )

    def body():
        from lucepy import bench as bench_mod

        config = runtime_config(
            target_devices,
            target_layer_split,
            prompt_len + gen + 1,
            chunk,
            threads,
            cache=cache,
            compute=ComputeFlags(flash_attn, cache_type_k, cache_type_v),
        )
        result = bench_mod.run(
            model,
            config,
            prompt_len=prompt_len,
            gen=gen,
            vs_llama_cpp=vs_llama_cpp,
            repeats=repeats,
        )
        if as_json:
            tui.print_json(json.dumps(result.to_dict()))
        else:
            tui.show(tui.bench_table(result))

    run_body(body)


@app.command()
def plan(
    model: Annotated[Path, typer.Argument(help="a GGUF model file")],
    target_devices: TargetDevices = "cpu",
    target_layer_split: LayerSplit = None,
    max_ctx: MaxCtx = None,
    moe_gpu_mb: MoeDeviceMB = None,
    n_cpu_moe: NCpuMoe = 0,
    cold_experts: ColdExperts = DEFAULTS.cold_experts,
    expert_profile: ExpertProfile = None,
    kv_pool: KvPool = 0,
    kv_pool_rank: KvPoolRank = DEFAULTS.kv_pool_rank,
    parallel: Parallel = 1,
    as_json: AsJson = False,
):
    """Print the load plan (devices, layer ranges, bytes, where the experts go) without loading
    any weights."""

    def body():
        from lucepy.ggml import load
        from lucepy.gguf import GGUFFile
        from lucepy.models import architecture_for
        from lucepy.runtime.plan import make_plan, model_options

        moe = ComputeFlags(
            moe_device_mb=moe_gpu_mb,
            n_cpu_moe=n_cpu_moe,
            cold_experts=cold_experts,
            kv_pool=kv_pool,
            kv_pool_rank=kv_pool_rank,
            parallel=parallel,
        )
        config = runtime_config(
            target_devices, target_layer_split, max_ctx,
            compute=moe._replace(expert_profile=expert_profile),
        )  # fmt: skip
        with GGUFFile(model) as f:
            arch = architecture_for(f).from_gguf(f, model_options(config))
            result = make_plan(f, arch, config, load())
        if as_json:
            tui.print_json(json.dumps(result.to_dict()))
        else:
            tui.show(tui.plan_table(result))

    run_body(body)


@app.command()
def experts(
    model: Annotated[Path, typer.Argument(help="a GGUF model file with routed experts")],
    expert_profile: ExpertProfile = None,
    top: Annotated[int, typer.Option(min=1, help="experts shown per layer")] = 8,
    as_json: AsJson = False,
):
    """Show the expert hotness profile: per layer, the experts most tokens chose (counted by
    `lucepy serve` and `lucepy generate`; the placement of --moe-gpu-mb follows it)."""

    def body():
        from lucepy.gguf import GGUFFile
        from lucepy.models import architecture_for
        from lucepy.runtime import experts as ex

        with GGUFFile(model) as f:
            p = architecture_for(f).from_gguf(f).p
            if not getattr(p, "n_expert", 0):
                raise ConfigError(f"{model}: this model has no routed experts")
            path = Path(expert_profile) if expert_profile else ex.profile_path(f)
        counts = ex.ExpertCounts.load(path, p.n_layer, p.n_expert).counts
        if not counts.any():
            raise ConfigError(
                f"no expert profile at {path} yet: serve or generate with this model to count"
            )
        report = ex.report(counts, p.n_expert_used, top)
        if as_json:
            tui.print_json(json.dumps({"profile": str(path), **report}))
        else:
            tui.show(tui.experts_table(report, str(path)))

    run_body(body)


# Importing these registers their commands on `app` (they import `app` from here).
from lucepy import cli_backends, cli_serve  # noqa: E402, F401

if __name__ == "__main__":  # `python -m lucepy.cli`: the app the other modules registered on
    from lucepy.cli import app as registered

    registered()
