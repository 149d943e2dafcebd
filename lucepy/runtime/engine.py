"""The Engine: a loaded model, ready to prefill and decode. CLI, server and bench use only this."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lucepy import ggml
from lucepy.errors import (
    ConfigError,
    ContextOverflow,
    DeviceError,
    PromptError,
    StaleVerify,
    WorkerError,
)
from lucepy.gguf import GGUFFile
from lucepy.models import ModelOptions, architecture_for
from lucepy.models.state import spec_nbytes, state_specs
from lucepy.runtime import backends, experts, workers
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.devices import list_devices, local_backends, open_backend
from lucepy.runtime.engine_state import BatchedSequences, StateIO
from lucepy.runtime.pipeline import Pipeline, Step, VerifyHandle
from lucepy.runtime.placement import DeviceSpec, LoadPlan, parse_devices, parse_split, plan_load
from lucepy.runtime.shard import Shard
from lucepy.runtime.slots import SeqSlots
from lucepy.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from lucepy.runtime.draft import Draft

log = logging.getLogger(__name__)


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


class Engine(StateIO, BatchedSequences):
    """A model on its device(s) and one sequence's state. Not thread-safe: one request at a time."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        config: RuntimeConfig | None = None,
        *,
        tokenizer: bool = True,
    ):
        self.config = config or RuntimeConfig()
        self.path = Path(model_path)
        self.pipeline = self.tokenizer = self.draft = self.prefix_cache = None
        self.on_launch: Callable[[], None] | None = None  # Pipeline.on_launch, kept over reloads
        self.file = GGUFFile(self.path)
        try:
            options = model_options(self.config)
            self.model = architecture_for(self.file).from_gguf(self.file, options)
            self.params = self.model.p
            self.lib = ggml.load()
            self.plan = make_plan(self.file, self.model, self.config, self.lib)
            for note in self.plan.notes:
                log.warning("%s", note)
            self.n_ctx = self.plan.max_ctx
            self._load()
            n_expert = getattr(self.params, "n_expert", 0)
            if n_expert and self.config.count_experts:  # the next placement's hotness profile
                path = experts.profile_for(self.file, self.config)
                self.pipeline.expert_counts = experts.ExpertCounts(
                    self.params.n_layer, n_expert, path if self.config.save_expert_profile else None
                )
            self.draft = self._load_draft() if self.config.draft else None
            tokens = self.file.get("tokenizer.ggml.tokens")
            self.tokenizer = Tokenizer(self.path, tokens) if tokenizer else None
        except BaseException:
            self.close()
            raise
        self.n_past = 0
        self.capture: tuple[int, ...] = ()  # target layers a draft reads (set by the draft)
        self._verified: VerifyHandle | None = None

    @property
    def shards(self) -> list[Shard]:
        return self.pipeline.shards

    @property
    def shard(self) -> Shard:
        """The single shard of an unsplit model (the first one otherwise)."""
        return self.pipeline.shards[0]

    def _launching(self) -> None:
        if self.on_launch is not None:
            self.on_launch()

    def _load(self) -> None:
        draft = self._draft_spec()
        remote = any(spec.where != "local" for spec in self.plan.devices) or (
            draft is not None and draft.where != "local"
        )
        self.pipeline = Pipeline(
            self.lib, [], remote, self.n_ctx, deadline_s=self.config.step_deadline_s
        )
        self.pipeline.on_launch = self._launching
        rows = self.n_ctx * self.config.parallel  # cache rows of every sequence
        if self.config.parallel > 1:
            self.pipeline.slots = SeqSlots(self.config.parallel, self.n_ctx)
        if self.config.kv_pool and self.config.kv_pool < self.n_ctx:
            self.pipeline.use_pool(
                self.n_ctx,
                self.config.kv_pool,
                self.model.options.max_step,
                self.config.kv_pool_rank,
            )
        placement = self.plan.experts
        for spec, sp in zip(self.plan.devices, self.plan.shards, strict=True):
            backend = self._open(spec)
            layers = range(*sp.layers)
            host = None
            cold = placement is not None and placement.bytes(layers)[1] > 0
            if cold and not placement.reads:  # the CPU that computes them
                host = open_backend(
                    self.lib, "cpu", self.config.thread_count(), self.config.batch_invariant
                )
            self.pipeline.add(
                lambda b=backend, h=host, layers=layers, spec=spec: Shard(
                    self.lib,
                    self.model,
                    self.file,
                    layers,
                    b,
                    rows,
                    spec.process,
                    experts=placement,
                    host=h,
                    routing=self.config.count_experts,
                )  # fmt: skip
            )

    def _open(self, spec: DeviceSpec) -> ggml.Backend:
        """A backend for ``spec``, spawning its worker if it needs one. RPC connections are made
        under the pipeline's supervision: a failed handshake must not take the process down."""
        threads = self.config.thread_count()
        invariant = self.config.batch_invariant
        if invariant and (spec.where != "local" or spec.backend != "cpu"):
            log.warning("batch_invariant holds on local CPU devices only, not on %s", spec.name)
        if spec.where == "local":
            return open_backend(self.lib, spec.device, threads, invariant)
        endpoint, index = spec.endpoint, int(spec.device) if spec.where == "remote" else 0
        if spec.where == "worker":
            local = spec.backend in local_backends(self.lib)
            build = self.lib.directory if local else backends.find_build(spec.backend)
            worker = workers.spawn(spec.device, build, threads)
            self.pipeline.workers.append(worker)
            endpoint = worker.endpoint
        return self.pipeline.call(lambda: workers.connect(self.lib, endpoint, index, spec.name))

    def _draft_spec(self) -> DeviceSpec | None:
        """Where the draft runs: --draft-device, else the last shard's device if local, else cpu."""
        if not self.config.draft:
            return None
        device = self.config.draft_device
        if device is None:
            last = self.plan.devices[-1]
            device = last.device if last.where == "local" else "cpu"
        return parse_devices(device, local_backends(self.lib))[0]

    def _load_draft(self) -> Draft:
        from lucepy.runtime.draft import Draft

        cfg, spec = self.config, self._draft_spec()
        backend = self._open(spec)
        remote = spec.where != "local"
        pipeline = self.pipeline
        run = (lambda fn: pipeline.call(fn, step=True)) if remote else (lambda fn: fn())
        draft = run(lambda: Draft(self.lib, cfg.draft, self.file, self.model, backend, self.n_ctx))
        draft.remote, draft.run = remote, run
        if cfg.draft_block:
            try:
                draft.set_block(cfg.draft_block)
            except BaseException:
                self._close_draft(draft)
                raise
        return draft

    def _close_draft(self, draft: Draft) -> None:
        if not draft.remote:
            draft.close()
        elif self.pipeline is None or self.pipeline.broken:
            draft.abandon()
        else:
            try:
                self.pipeline.call(draft.close)
            except WorkerError:
                draft.abandon()

    def _recover(self) -> None:
        """After a worker died: drop the broken pipeline and load again from the plan."""
        log.warning("reloading after: %s", self.pipeline.broken)
        if self.prefix_cache is not None:
            self.prefix_cache.forget()  # RAM slots of the dead workers went with them
        remote_draft = self.draft is not None and self.draft.remote
        if remote_draft:
            self._close_draft(self.draft)
            self.draft = None
        self.pipeline.close()
        self.pipeline = None
        self._load()
        if remote_draft:
            self.draft = self._load_draft()

    @property
    def broken(self) -> str | None:
        """Why the model is not whole (a worker died or froze), until ``recover``."""
        if self.pipeline is None:
            return "not loaded"
        return self.pipeline.broken or self.pipeline.check_workers()

    def recover(self) -> bool:
        """Bring back workers that died or froze, now; whether there was anything to do."""
        if not self.broken:
            return False
        self._recover()
        return True

    def pool_report(self) -> dict | None:
        """KV Flash's pool: the plan's sizes, where its chunks are and the pager's counts."""
        if self.pipeline.host_pool is None:
            return None
        host = {"host_bytes": self.pipeline.host_pool.nbytes}
        return self.plan.kv_pool | self.pipeline.slots.report() | host

    def reset(self) -> None:
        """Start a new sequence; first bring back workers that died since the last one."""
        self.recover()
        self.pipeline.reset()
        self.n_past = 0

    def prefill(
        self,
        tokens: list[int] | np.ndarray,
        *,
        chunk: int | None = None,
        all_logits: bool = False,
        on_chunk=None,
    ) -> np.ndarray:
        """Feed ``tokens`` after what the sequence holds, in chunks. Returns the logits of the last
        token [n_vocab], or of every token [len(tokens), n_vocab] with ``all_logits``.
        ``on_chunk(out, pos0)`` sees each chunk's StepOutput (a draft injects its features)."""
        tokens = self._checked(tokens)
        chunk = chunk or self.config.chunk
        chunk = min(chunk, self.model.max_step() or chunk)
        if self.pipeline.host_pool is not None:  # a KV pool has room for steps this long
            chunk = min(chunk, self.model.options.max_step)
        step = Step(logits="all" if all_logits else "last", capture=self.capture)
        parts = [tokens[start : start + chunk] for start in range(0, tokens.size, chunk)]
        slots = self.pipeline.slots
        rank_last = self.pipeline.ranks_by_query and self.n_past + tokens.size > slots.pool
        if rank_last and tokens.size > 1:
            # KV Flash's qk ranking: the last token alone, after a ranking by the queries of the
            # one before it, so the logits that answer a prompt see the chunks it recalls
            parts[-1:] = [p for p in (parts[-1][:-1], parts[-1][-1:]) if p.size]
        outs = []
        for part in parts:
            if rank_last and part is parts[-1]:
                slots.rank_next = True
            out = self.pipeline.forward(part, self.n_past, step)
            if on_chunk is not None:
                on_chunk(out, self.n_past)
            self.n_past += part.size
            outs.append(out.values.copy() if all_logits else out.values)
        return np.concatenate(outs) if all_logits else outs[-1][-1]

    def decode(self, token: int) -> np.ndarray:
        """One token in, the next-token logits [n_vocab] out (a view reused by the next call)."""
        return self._decode(token, Step())[0]

    def decode_greedy(self, token: int) -> int:
        """One token in, the most likely next token out: the logits' argmax, which every step's
        graph computes where the logits are (the first of equal values, as np.argmax takes), so
        only it is read back (4 bytes where ``decode`` reads n_vocab floats)."""
        return int(self._decode(token, Step(want="argmax")).reshape(-1)[-1])

    def _decode(self, token: int, step: Step) -> np.ndarray:
        if not 0 <= token < self.params.n_vocab:
            self.check_tokens(np.array([token]))
        out = self.pipeline.forward(np.array([token], dtype=np.int32), self.n_past, step)
        self.n_past += 1
        return out.values

    def verify(self, tokens: list[int] | np.ndarray, *, greedy: bool) -> VerifyHandle:
        """Run a draft block after the sequence, keeping what ``commit`` needs. The handle holds
        the argmax per position (``greedy``) or the logits of every position, and the features."""
        tokens = self._checked(tokens)
        step = Step(
            logits="all", want="argmax" if greedy else "out", verify=True, capture=self.capture
        )
        out = self.pipeline.forward(tokens, self.n_past, step)
        self._verified = VerifyHandle(out, self.pipeline.steps, self.n_past, tokens.size)
        self.n_past += tokens.size
        return self._verified

    def commit(self, handle: VerifyHandle, keep: int) -> None:
        """Keep the first ``keep`` tokens of the verify ``handle`` came from and forget the rest,
        on every shard. Raises StaleVerify if any step ran after that verify."""
        if not 0 < keep <= handle.n_tokens:
            raise ConfigError(f"commit keeps {keep} of {handle.n_tokens} verified tokens")
        if handle is not self._verified:
            raise StaleVerify("this verify was committed already; each handle commits once")
        self.pipeline.rollback(handle.step, keep, handle.pos0 + keep)
        self._verified = None
        self.n_past = handle.pos0 + keep

    def rollback(self, keep: int) -> None:
        """``commit`` the latest verify."""
        if self._verified is None:
            raise StaleVerify("rollback without a verify to commit")
        self.commit(self._verified, keep)

    def _checked(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.size == 0:
            raise ConfigError("nothing to prefill: the token list is empty")
        self.check_tokens(tokens)
        if self.n_past + tokens.size > self.n_ctx:
            raise ContextOverflow(
                f"{tokens.size} tokens after {self.n_past} exceed the context of {self.n_ctx}; "
                f"shorten the prompt or raise --max-ctx"
            )
        return tokens

    def check_tokens(self, tokens: np.ndarray) -> None:
        """Refuse a token id outside the vocabulary (a PromptError naming it)."""
        bad = tokens[(tokens < 0) | (tokens >= self.params.n_vocab)]
        if bad.size:
            raise PromptError(
                f"token id {int(bad[0])} is outside the vocabulary (0..{self.params.n_vocab - 1})"
            )

    def close(self) -> None:
        counts = getattr(self.pipeline, "expert_counts", None)
        if counts is not None and counts.steps:
            try:
                counts.save()
            except OSError as err:
                log.warning("could not save the expert profile %s: %s", counts.path, err)
        if getattr(self, "draft", None) is not None:
            self._close_draft(self.draft)  # before the pipeline stops the workers
            self.draft = None
        for name in ("prefix_cache", "pipeline", "tokenizer", "file"):
            owner = getattr(self, name, None)
            if owner is not None:
                owner.close()
                setattr(self, name, None)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
