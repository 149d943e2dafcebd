"""A shard: one contiguous layer range of a model on one backend, with its weights and state.

Graphs are cached per ``GraphSpec`` (tokens, KV bucket, logits rows, verify, capture). Each step's
inputs come from the model (``step_inputs`` of the step batch). A verify graph keeps the
recurrent state before it and the recurrence's inputs, and a small rollback graph per kept
length, built by the layer states, runs the recurrence again over the kept tokens (decision 4);
on a GPU it is launched and not waited for (``async_rollback``, ``settle``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from lucepy.errors import ConfigError
from lucepy.ggml import GGML_TYPE_F32, Backend, Context, Lib, ffi, tensor_set
from lucepy.ggml.bufts import matmul_placement
from lucepy.gguf import GGUFFile
from lucepy.models.base import GraphSpec
from lucepy.models.batch import StepBatch
from lucepy.runtime.devices import open_backend
from lucepy.runtime.experts import EXPERT_TENSORS, ExpertPlacement
from lucepy.runtime.graphs import (
    CompiledGraph,
    GraphCache,
    compile_graph,
    compute,
    get,
)
from lucepy.runtime.state import StateSet
from lucepy.runtime.tensors import Tensors

log = logging.getLogger(__name__)


class Shard:
    def __init__(
        self,
        lib: Lib,
        model: Any,
        f: GGUFFile,
        layers: range,
        backend: Backend,
        n_ctx: int,
        process: str = "local",
        experts: ExpertPlacement | None = None,
        host: Backend | None = None,
        routing: bool = True,
    ):
        self.lib, self.model, self.layers, self.backend = lib, model, layers, backend
        self.n_ctx, self.process, self.routing = n_ctx, process, routing
        self.graphs = GraphCache(on_evict=self._drop_rollbacks)  # by GraphSpec
        self._rollbacks: dict[tuple[GraphSpec, int], CompiledGraph] = {}
        # False rebuilds every step: only to test that reuse changes nothing
        self.reuse_graphs = True
        # A rollback on a GPU here returns once launched: its recurrences run while the host
        # prepares the next step, which runs after them on the backend's stream. Whatever else
        # reads or writes the state, or frees a graph, settles it first (``settle``).
        self.async_rollback = backend.is_local_gpu
        self.unsettled = False
        split = [il for il in layers if experts is not None and experts.is_split(il)]
        # the experts in host RAM: computed by a host CPU backend, or read by the device
        self.reads = bool(split) and experts.reads
        self.host = host if split and not self.reads else None
        if split and not self.reads and host is None:
            raise ValueError("a shard with experts in host RAM needs a host backend")
        # a MoE graph on a GPU runs through the scheduler (graphs.compile_graph), which needs a
        # CPU backend beside the device even when no expert is in host RAM
        routed = any(f"blk.{il}.ffn_down_exps.weight" in f.tensors for il in layers)
        self._sched_host = None
        if self.host is None and routed and backend.is_local_gpu:
            self._sched_host = open_backend(lib, "cpu", 1)
        moved = {f"blk.{il}.{n}.weight" for il in split for n in EXPERT_TENSORS}
        self.weights = Tensors.from_gguf(
            lib,
            backend,
            f,
            [n for n in model.weight_shapes(layers, f) if n not in moved],
            f"weights of layers {layers}",
            matmul={k: v for k, v in model.matmul_weights(layers, f).items() if k not in moved},
        )
        self.split: list[Tensors | ReadExperts] = []
        if split and self.reads:
            self.split = [ReadExperts(lib, backend, f, experts, split)]
        elif split:
            k = model.p.n_expert_used
            self.split = split_experts(lib, backend, host, f, experts, split, k)
        self.w = {**self.weights.t, **{k: v for t in self.split for k, v in t.t.items()}}
        self.state = StateSet(
            lib, backend, model.make_state(layers, n_ctx), f"state of layers {layers}"
        )
        self.reset()

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights on the shard's device (experts in host RAM not counted)."""
        return self.weights.nbytes + (self.split[0].nbytes if self.split else 0)

    @property
    def state_bytes(self) -> int:
        return self.state.nbytes

    def reset(self) -> None:
        """Forget the sequence: zero the recurrent state (KV rows are masked until rewritten)."""
        self.settle()
        self.state.clear()

    def settle(self) -> None:
        """Wait for a rollback that may still run on the device (``async_rollback``)."""
        if self.unsettled:
            self.lib.ggml_backend_synchronize(self.backend.ptr)
            self.unsettled = False

    def spec(
        self,
        batch: StepBatch,
        logits: str,
        verify: bool,
        capture: tuple[int, ...],
        queries: bool = False,
    ) -> GraphSpec:
        mine = tuple(
            L
            for L in capture
            if self.layers.start <= L < self.layers.stop
            or L == self.layers.stop == self.model.p.n_layer
        )
        last = self.layers.stop == self.model.p.n_layer
        return GraphSpec(
            batch.n_tokens,
            batch.n_kv,
            logits if last else "last",
            verify,
            mine,
            self.model.ring_span(batch),
            queries,
            (batch.streams, batch.stream_rows, batch.stream_first),
        )

    def graph(self, spec: GraphSpec) -> CompiledGraph:
        if spec not in self.graphs:
            self.settle()  # the build may free the graph whose snapshots a rollback reads
        return self.graphs.get(spec, lambda: self._build(spec))

    def _build(self, spec: GraphSpec) -> CompiledGraph:
        def build(b):
            b.queries, b.streams = spec.queries, spec.streams
            return self.model.build(b, self.w, self.state.t, self.layers, spec)

        g = compile_graph(
            self.lib,
            self.backend,
            160 * len(self.layers) + 256,
            build,
            self.host or self._sched_host,
            # decode steps count nothing: their routing read cost a hybrid decode a third of
            # its speed on the H200 (docs/BENCHMARKS.md); prompts and verify blocks count
            self.routing and spec.n_tokens > 1,
        )
        log.debug(
            "built %s on %s: %d nodes, %d bytes",
            spec,
            self.backend.name,
            self.lib.ggml_graph_n_nodes(g.gf),
            g.nbytes,
        )
        return g

    def prepare(self, spec: GraphSpec, batch: StepBatch) -> CompiledGraph:
        """The graph for this step, with the inputs the model derives from the batch written."""
        g = self.graph(spec)
        g.write_inputs(self.model.step_inputs(batch, g.inputs))
        return g

    def compute(self, g: CompiledGraph) -> None:
        compute(self.lib, self.backend, g)
        self.unsettled = False  # (it waited for all the backend's work)

    def read(self, g: CompiledGraph, what: str = "out") -> np.ndarray:
        """An output as a host array [rows, width], in a buffer the graph owns."""
        t = g.output if what == "out" else g.outputs[what]
        return get(self.lib, g, what, t)

    def features(self, g: CompiledGraph, spec: GraphSpec) -> dict[int, Any]:
        """The graph outputs holding the residual entering each captured layer this shard owns
        (``feat.L`` [n_embd, T]), on this shard's backend, valid until its next step."""
        return {L: g.outputs[f"feat.{L}"] for L in spec.capture}

    def rollback(self, g: CompiledGraph, spec: GraphSpec, keep: int) -> None:
        """After a verify pass of ``spec.n_tokens``, keep only the first ``keep`` tokens' effect."""
        if keep == spec.n_tokens or not self.state.rolls_back:
            return
        rb = self._rollbacks.get((spec, keep))
        if rb is None:
            rb = self._rollbacks[(spec, keep)] = compile_graph(
                self.lib,
                self.backend,
                20 * len(self.layers) + 16,
                lambda b: self._rollback(b, g, spec.n_tokens, keep),
            )
        compute(self.lib, self.backend, rb, wait=not self.async_rollback)
        self.unsettled = self.async_rollback

    def _rollback(self, b, g: CompiledGraph, n_tokens: int, keep: int) -> None:
        for state in self.state.states:
            state.rollback(b, self.state.t, g.outputs, n_tokens, keep)

    def release(self, spec: GraphSpec) -> None:
        if not self.reuse_graphs:
            self._drop_rollbacks(spec)  # (which settles first)
            self.graphs.pop(spec).close()

    def _drop_rollbacks(self, spec: GraphSpec) -> None:
        self.settle()
        for key in [k for k in self._rollbacks if k[0] == spec]:
            self._rollbacks.pop(key).close()

    def _all_graphs(self) -> list[CompiledGraph]:
        return [*self._rollbacks.values(), *self.graphs.values()]

    def abandon(self) -> None:
        """Drop every handle without freeing it: for a shard whose worker died, where freeing
        would talk to a dead connection."""
        for g in self._all_graphs():
            g.abandon()
        self.graphs.clear()
        self._rollbacks.clear()
        self.state.abandon()
        self.weights.abandon()
        for t in self.split:
            t.abandon()
        if self._sched_host is not None:  # a CPU here, not the dead worker's
            self._sched_host.close()
        self.backend.abandon()

    def close(self) -> None:
        self.settle()
        for g in self._all_graphs():
            g.close()
        self.graphs.clear()
        self._rollbacks.clear()
        self.state.close()
        self.weights.close()
        for t in self.split:
            t.close()
        for host in (self.host, self._sched_host):
            if host is not None:
                host.close()
        self.backend.close()


def split_experts(
    lib: Lib,
    device: Backend,
    host: Backend,
    f: GGUFFile,
    placement: ExpertPlacement,
    layers,
    n_used: int,
) -> list[Tensors]:
    """The routed experts of ``layers`` in two parts: on ``device`` the hot ones and the tables
    from expert to index (and 0/1 mask) in each part, in ``host`` (a CPU backend) the cold ones
    as ``NAME.cold``. Each part keeps its experts in expert order."""
    X, k = placement.n_expert, n_used
    device_specs, host_specs, data = {}, {}, {}
    for il in layers:
        hot, cold = placement.hot[il], placement.cold(il)
        for part, chosen in (("hot", hot), ("cold", cold)):
            index = np.zeros((X, 1), dtype=np.float32)  # 0 where absent (any valid index)
            index[list(chosen), 0] = np.arange(len(chosen), dtype=np.float32)
            mask = np.zeros((X, 1), dtype=np.float32)
            mask[list(chosen), 0] = 1.0
            for name, arr in (("", index), ("_mask", mask)):
                key = f"blk.{il}.experts.{part}{name}"
                device_specs[key], data[key] = (GGML_TYPE_F32, (1, X)), arr
        key = f"blk.{il}.experts.hot_pad"  # distinct padding experts for a token's other slots
        device_specs[key] = (GGML_TYPE_F32, (k, 1))
        data[key] = (len(hot) + np.arange(k, dtype=np.float32))[None, :]
        for n in EXPERT_TENSORS:
            name = f"blk.{il}.{n}.weight"
            info = f.tensors[name]
            raw = np.frombuffer(f.data(name), dtype=np.uint8).reshape(X, -1)
            if hot:
                device_specs[name] = (int(info.type), (*info.shape[:2], len(hot) + k))
                data[name] = np.concatenate([raw[list(hot)], np.zeros((k, raw.shape[1]), np.uint8)])
            host_specs[name + ".cold"] = (int(info.type), (*info.shape[:2], len(cold)))
            data[name + ".cold"] = raw[list(cold)]
    # experts in the buffer types a one-backend load would give them (repacked on a CPU)
    where = []
    for backend, specs in ((device, device_specs), (host, host_specs)):
        weights = {k: v for k, v in specs.items() if ".experts." not in k}
        where.append(matmul_placement(lib, backend, weights))
    what = f"experts of layers {layers}"
    parts = [Tensors(lib, device, device_specs, f"device {what}", where[0])]
    parts.append(Tensors(lib, host, host_specs, f"host {what}", where[1]))
    for part in parts:
        for key, t in part.t.items():
            tensor_set(lib, t, np.ascontiguousarray(data[key]))
    return parts


class ReadExperts:
    """The routed experts of ``layers`` that the device reads from host RAM (``placement.reads``):
    per layer and matrix one tensor, its hot experts first (on the device) and its cold ones
    after (in host RAM), and ``blk.N.experts.order``, an f32 table from expert to its place.
    On a CUDA device the tensor is one address range over both memories (``ggml.vmm``), which
    the device's expert kernels read in place; on a CPU it is one plain buffer in that order."""

    def __init__(self, lib: Lib, device: Backend, f: GGUFFile, placement: ExpertPlacement, layers):
        self.lib, self.t = lib, {}
        self._memory: list = []  # (SplitMemory, its ggml context, the buffer around it)
        reg = lib.ggml_backend_dev_backend_reg(device.device)
        cuda = ffi.string(lib.ggml_backend_reg_name(reg)) == b"CUDA"
        if not cuda and not lib.ggml_backend_is_cpu(device.ptr):
            raise ConfigError(f"--cold-experts device is built for CUDA devices, not {device.name}")
        X = placement.n_expert
        orders = {il: [*placement.hot[il], *placement.cold(il)] for il in layers}
        tables = {f"blk.{il}.experts.order": (GGML_TYPE_F32, (1, X)) for il in layers}
        specs = {}
        for il in layers:
            for n in EXPERT_TENSORS:
                info = f.tensors[f"blk.{il}.{n}.weight"]
                specs[f"blk.{il}.{n}.weight"] = (int(info.type), tuple(info.shape[:3]), il)

        def reordered(name: str, il: int) -> np.ndarray:  # one matrix at a time: no second copy
            raw = np.frombuffer(f.data(name), dtype=np.uint8).reshape(X, -1)
            return np.ascontiguousarray(raw[orders[il]])

        what = f"experts of layers {layers}"
        plain = tables if cuda else {**tables, **{k: v[:2] for k, v in specs.items()}}
        self._tables = Tensors(lib, device, plain, what)
        try:
            for il in layers:
                where = np.zeros((X, 1), dtype=np.float32)
                where[orders[il], 0] = np.arange(X, dtype=np.float32)
                tensor_set(self.lib, self._tables.t[f"blk.{il}.experts.order"], where)
            ordinal = int("".join(ch for ch in device.name if ch.isdigit()) or 0)
            for name, (gtype, shape, il) in specs.items():
                data = reordered(name, il)
                if cuda:
                    hot = len(placement.hot[il]) * (data.nbytes // X)
                    self.t[name] = self._split(ordinal, name, gtype, shape, data, hot)
                else:
                    tensor_set(self.lib, self._tables.t[name], data)
        except BaseException:
            self.close()
            raise
        self.t.update(self._tables.t)
        on_device = sum(m.device_bytes for m, _, _ in self._memory)
        self.nbytes = on_device + (self._tables.nbytes if cuda else 0)
        self.host_nbytes = sum(m.size - m.device_bytes for m, _, _ in self._memory)

    def _split(self, ordinal: int, name: str, gtype: int, shape: tuple, data, device_bytes: int):
        """``data`` in a range whose first ``device_bytes`` are GPU memory, as a ggml tensor."""
        from lucepy.ggml.vmm import SplitMemory

        memory = SplitMemory(ordinal, data.nbytes, device_bytes)
        ctx = Context(self.lib, 2)
        self._memory.append((memory, ctx, None))
        t = self.lib.ggml_new_tensor(ctx.ptr, gtype, 3, ffi.new("int64_t[4]", [*shape, 1]))
        self.lib.ggml_set_name(t, name.encode())
        base = ffi.cast("void *", memory.ptr)
        buf = self.lib.ggml_backend_cpu_buffer_from_ptr(base, memory.size)
        self._memory[-1] = (memory, ctx, buf)
        self.lib.ggml_backend_tensor_alloc(buf, t, base)
        memory.write(0, data)  # never through ggml: to it this is host memory
        return t

    def close(self) -> None:
        self._tables.close()
        for memory, ctx, buf in self._memory:
            if buf is not None:
                self.lib.ggml_backend_buffer_free(buf)
            ctx.close()
            memory.close()
        self._memory = []

    def abandon(self) -> None:
        self.close()  # all of it lives in this process
