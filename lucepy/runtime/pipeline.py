"""The pipeline: shards in layer order. Each step runs shard by shard; the boundary activation
passes by ``ggml_backend_tensor_copy`` (a memcpy in-process, an RPC set/get for a worker).

With worker shards, steps run on a guard thread. ggml-rpc aborts on a broken connection; our abort
hook (``lucepy.ggml.lib``) parks the failing thread instead, and the caller, waiting here, turns
that into a WorkerError within a bounded time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from lucepy.errors import StaleVerify, WorkerError
from lucepy.ggml import Lib
from lucepy.ggml.lib import rpc_failures
from lucepy.models.batch import StepBatch
from lucepy.runtime.experts import ExpertCounts
from lucepy.runtime.kvpool import HostPool
from lucepy.runtime.pager import PagedSlots
from lucepy.runtime.shard import Shard
from lucepy.runtime.slots import IdentitySlots, SeqSlots
from lucepy.runtime.workers import Worker

log = logging.getLogger(__name__)

POLL_S = 0.05
DEADLINE_FACTOR = 20  # a remote step may take this many times the slowest step seen so far


@dataclass(frozen=True)
class Step:
    """What one forward step asks of the pipeline."""

    logits: str = "last"  # "last" or "all" rows
    want: str = "out"  # read the logits ("out") or only their argmax ("argmax")
    verify: bool = False  # keep what a rollback of the step reads (models/state.py)
    capture: tuple[int, ...] = ()  # target layers whose entering residual to return


@dataclass
class StepOutput:
    values: np.ndarray  # logits [rows, n_vocab] (float32) or argmax [1, rows] (int32)
    features: dict[int, Any]  # layer -> its shard's feat.L output [n_embd, rows], until next step


@dataclass(frozen=True)
class VerifyHandle:
    """A verify step's output and what commits it (decision 11): ``Engine.commit(handle, keep)``
    rolls back exactly this step, and refuses once another step has run."""

    out: StepOutput
    step: int
    pos0: int
    n_tokens: int

    @property
    def values(self) -> np.ndarray:
        return self.out.values

    @property
    def features(self) -> dict[int, Any]:
        return self.out.features


class _GuardThread:
    """One daemon thread that runs steps; a step that never returns is abandoned with the thread."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name="lucepy-pipeline", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as err:  # handed to the caller
                box.append((False, err))
            done.set()

    def submit(self, fn: Callable) -> tuple[list, threading.Event]:
        box, done = [], threading.Event()
        self._jobs.put((fn, box, done))
        return box, done


class Pipeline:
    """Shards in layer order. With worker shards, every call that may touch a worker (load, step,
    reset) runs supervised on the guard thread."""

    def __init__(
        self,
        lib: Lib,
        workers: list[Worker],
        remote: bool,
        n_ctx: int,
        deadline_s: float = 30.0,
        setup_deadline_s: float = 3600.0,
    ):
        self.lib, self.workers, self.remote = lib, workers, remote
        self.expert_counts: ExpertCounts | None = None  # set by the engine for a MoE model
        self.deadline_floor_s = deadline_s  # the least a step may take before it is given up
        # any other call (connect, load, reset, close) loads weights at worst: generous, but a
        # worker that never answers must not hang the caller either
        self.setup_deadline_s = setup_deadline_s
        self._slowest_s = 0.0
        self.slots: IdentitySlots | PagedSlots | SeqSlots = IdentitySlots(n_ctx)
        self.host_pool: HostPool | None = None  # KV Flash's paged-out rows (use_pool)
        self.shards: list[Shard] = []
        self.last: list[tuple] = []  # (shard, spec, graph) of the last step, for rollback
        self.steps = 0  # steps run; a verify's handle names its own
        # called as a step's first graph is launched (the server hands over the last step's
        # tokens then, while the device works, not between steps)
        self.on_launch: Callable[[], None] | None = None
        self._guard = _GuardThread() if remote else None
        self._failures_seen = len(rpc_failures())
        self.broken: str | None = None

    def call(self, fn: Callable, step: bool = False):
        """Run ``fn``; if a worker breaks meanwhile, raise WorkerError instead of hanging. Every
        call has a deadline: a ``step``'s from the slowest step so far with a floor, any other's
        ``setup_deadline_s``. A worker that misses it is killed (a frozen one would block
        forever) and the pipeline is broken."""
        if self.broken:
            raise WorkerError(self.broken)
        if self._guard is None:
            return fn()
        t0 = time.monotonic()
        deadline = self.setup_deadline_s
        if step:
            deadline = max(self.deadline_floor_s, DEADLINE_FACTOR * self._slowest_s)
        box, done = self._guard.submit(fn)
        while not done.wait(POLL_S):
            problem = self._problem()
            if problem is None and time.monotonic() - t0 > deadline:
                problem = self._missed(deadline)
            if problem:
                self.broken = (
                    f"{problem}; the request failed. The next request restarts the workers"
                )
                log.error("%s", self.broken)
                raise WorkerError(self.broken)
        if step:
            self._slowest_s = max(self._slowest_s, time.monotonic() - t0)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _missed(self, deadline: float) -> str:
        """Kill the workers of a call that outlived its deadline; say so. The call's connection
        then breaks and ggml-rpc aborts (parked, ggml/lib.py): that is waited for here, briefly,
        lest it land in the next pipeline's first call and fail it for nothing."""
        for worker in self.workers:
            worker.kill()
        until = time.monotonic() + 2.0
        while self.workers and len(rpc_failures()) == self._failures_seen:
            if time.monotonic() > until:
                break
            time.sleep(0.01)
        names = ", ".join(w.describe() for w in self.workers) or "a remote device"
        return f"{names} did not answer within {deadline:.1f} s (frozen or unreachable)"

    def add(self, make_shard: Callable[[], Shard]) -> Shard:
        shard = self.call(make_shard)
        self.shards.append(shard)
        return shard

    def forward(self, tokens: np.ndarray, pos0: int, step: Step) -> StepOutput:
        return self.call(lambda: self._forward(tokens, pos0, step), step=True)

    def rollback(self, step: int, keep: int, end: int) -> None:
        """Undo all but the first ``keep`` tokens of verify step ``step`` on every shard (the
        sequence then ends at ``end``); only while it is the last step, whose graphs hold its
        snapshots."""
        if step != self.steps:
            raise StaleVerify(
                f"verify step {step} is committed after step {self.steps} ran; commit a verify "
                f"before the next decode, prefill or verify"
            )
        self.call(
            lambda: [shard.rollback(g, spec, keep) for shard, spec, g in self.last], step=True
        )
        if isinstance(self.slots, PagedSlots):
            self.slots.rollback(end)

    def settle(self) -> None:
        """Wait for the rollbacks that may still run on the devices (``Shard.async_rollback``)."""
        for shard in self.shards:
            shard.settle()

    def check_workers(self) -> str | None:
        """Mark the pipeline broken if a worker we started has exited; says which."""
        dead = [w for w in self.workers if not w.alive]
        if dead and not self.broken:
            self.broken = f"{dead[0].describe()} exited"
        return self.broken

    def _problem(self) -> str | None:
        failures = rpc_failures()
        if len(failures) > self._failures_seen:
            dead = [w for w in self.workers if not w.alive]
            who = dead[0].describe() if dead else "a worker"
            return f"{who} stopped answering ({failures[-1]})"
        return None

    def forward_batch(self, batch: StepBatch, step: Step) -> StepOutput:
        """A step of several sequences' tokens (``SeqSlots.batch_of``)."""
        return self.call(lambda: self._run(batch, step), step=True)

    def _forward(self, tokens: np.ndarray, pos0: int, step: Step) -> StepOutput:
        # first: a KV Flash ranking reads the last step's graphs
        return self._run(self.slots.batch(tokens, pos0), step)

    def _run(self, batch: StepBatch, step: Step) -> StepOutput:
        for shard, spec, _ in self.last:
            shard.release(spec)
        self.steps += 1
        self.last, prev, features = [], None, {}
        for shard in self.shards:
            spec = shard.spec(batch, step.logits, step.verify, step.capture, self.ranks_by_query)
            g = shard.prepare(spec, batch)
            if prev is not None:
                self.lib.ggml_backend_tensor_copy(prev.output, g.inputs["x"])
            elif self.on_launch is not None:
                self.on_launch()
            shard.compute(g)
            if self.expert_counts is not None and "routing" in g.outputs:
                self.expert_counts.add(g.routed, shard.read(g, "routing"))
            features.update(shard.features(g, spec))
            self.last.append((shard, spec, g))
            prev = g
        last = self.shards[-1]
        return StepOutput(last.read(prev, step.want), features)

    @property
    def ranks_by_query(self) -> bool:
        """KV Flash ranks chunks by the queries of full attention (graphs output them)."""
        return self.host_pool is not None and self.slots.policy == "qk"

    def use_pool(self, n_ctx: int, pool: int, step: int, policy: str = "lru") -> None:
        """KV Flash: each full-attention cache holds a pool of ``pool`` tokens, paged by
        ``PagedSlots`` (``step``: the longest step)."""
        self.host_pool = HostPool(self, summarise=policy == "qk")
        self.slots = PagedSlots(n_ctx, pool, step, self.host_pool, policy)

    def reset(self, n_tokens: int = 0) -> None:
        """A new sequence, or (``n_tokens``) one whose state a restore has just written."""
        self.slots.reset(n_tokens)
        if self.host_pool is not None:
            self.host_pool.clear()
        if n_tokens:
            return

        def reset_all():
            for shard in self.shards:
                shard.reset()

        self.call(reset_all)

    # KV Flash's part of a snapshot (Engine): the mapping and the host rows, as named arrays
    def pager_state(self) -> dict[str, np.ndarray]:
        out = {f"map/{k}": v for k, v in self.slots.state().items()}
        return out | {f"host/{k}": v for k, v in self.host_pool.state().items()}

    def load_pager(self, arrays: dict[str, np.ndarray]) -> None:
        if self.host_pool is None:
            raise ValueError("a snapshot taken after KV Flash paged needs the same --kv-pool")
        part: dict[str, dict] = {"map": {}, "host": {}}
        for name, a in arrays.items():
            kind, rest = name.split("/", 1)
            part[kind][rest] = a
        self.slots.load(part["map"])
        self.host_pool.load(part["host"])

    def close(self) -> None:
        """Free everything; shards on a dead worker are abandoned, never touched."""
        shards, self.shards = self.shards, []
        for shard in shards:
            if shard.process == "local":
                shard.close()
            elif self.broken:
                shard.abandon()
            else:
                try:
                    self.call(shard.close)
                except WorkerError:
                    shard.abandon()
        for worker in self.workers:
            worker.close()
        self.workers = []
