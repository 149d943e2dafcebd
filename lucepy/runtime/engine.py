"""The Engine: a loaded model, ready to prefill and decode. CLI, server and bench use only this."""

from __future__ import annotations

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
    PromptError,
    StaleVerify,
    WorkerError,
)
from lucepy.gguf import GGUFFile
from lucepy.models import architecture_for
from lucepy.runtime import backends, experts, workers
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.devices import local_backends, open_backend
from lucepy.runtime.engine_state import BatchedSequences, StateIO
from lucepy.runtime.pipeline import Pipeline, Step, VerifyHandle
from lucepy.runtime.placement import DeviceSpec, parse_devices
from lucepy.runtime.plan import make_plan, model_options
from lucepy.runtime.shard import Shard
from lucepy.runtime.slots import SeqSlots
from lucepy.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from lucepy.runtime.draft import Draft

log = logging.getLogger(__name__)


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
            self.lib,
            [],
            remote,
            self.n_ctx,
            deadline_s=self.config.step_deadline_s,
            setup_deadline_s=self.config.setup_deadline_s,
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
