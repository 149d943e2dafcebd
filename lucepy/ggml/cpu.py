"""lucepy's CPU kernels for Q4_1 and Q5_1 weights (``vendor/ggml/cpu/lucepy-cpu.c``, decision
12): a graph for a local CPU backend has each ``mul_mat(weights, f32 x)`` of those types and 3
or more columns computed by them, bit for bit ggml's result, in about 0.6 of ggml's time from 4
columns up (a tile of 2 rows and 4 columns shares each row's unpacking and each column's load).
SmolLM2-135M, the default model, is Q4_1; its DFlash draft is Q5_1.

``take_products`` rewrites a built graph: ``x`` is quantized to Q8_1 once by ggml's own CPY (the
function ggml's mul_mat quantizes with; once for every product that reads ``x``, where mul_mat
quantizes it again for each), and the MUL_MAT node becomes a GGML_OP_CUSTOM node calling the
kernel, in place, so that the nodes reading it are untouched. Before the first rewrite in a
process, ``check`` computes a product of random blocks of each type both ways on the CPU backend
and uses a kernel only if every value is the same bits as ggml's. ``LUCEPY_CPU_KERNELS=0``
leaves every product to ggml."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import cffi
import numpy as np

from lucepy.ggml.lib import Lib, address, ffi
from lucepy.ggml.owners import Allocator, Backend, Buffer, Context, tensor_set

log = logging.getLogger(__name__)

ENV = "LUCEPY_CPU_KERNELS"
_types = ffi.typeof("enum ggml_type").relements
_ops = ffi.typeof("enum ggml_op").relements
Q4_1, Q5_1 = _types["GGML_TYPE_Q4_1"], _types["GGML_TYPE_Q5_1"]
Q8_1, F32 = _types["GGML_TYPE_Q8_1"], _types["GGML_TYPE_F32"]
MUL_MAT, CUSTOM = _ops["GGML_OP_MUL_MAT"], _ops["GGML_OP_CUSTOM"]
QK = 32  # values a block
KINDS = {Q4_1: ("q4_1", 20), Q5_1: ("q5_1", 24)}  # ggml type -> the module's name, block bytes
# fewer columns stay ggml's: one column its dot product is as fast (it is issue-bound, and the
# tile's savings are shared loads), two a tie (on a 2-core AVX-VNNI CPU, docs/BENCHMARKS.md)
MIN_COLS = 3

# ggml-impl.h's struct ggml_custom_op_params, which a CUSTOM node keeps in its op_params
_params = cffi.FFI()
_params.cdef("struct custom_op_params { void * fun; int n_tasks; void * userdata; };")
N_TASKS_MAX = -1  # GGML_N_TASKS_MAX: every thread of the backend


@dataclass(frozen=True)
class Kernel:
    address: int
    variant: str  # the instruction set it runs with ("avx2+avxvnni", "avx2")

    def params(self) -> bytes:
        p = _params.new("struct custom_op_params *")
        p.fun, p.n_tasks = _params.cast("void *", self.address), N_TASKS_MAX
        return bytes(_params.buffer(p))


_state: dict[str, Any] = {}


def kernels(lib: Lib, backend: Backend) -> dict[int, Kernel]:
    """ggml type -> the kernel this process may use for it: built (``pip install`` compiles
    them), on a CPU it runs on, compiled for this ggml's tensor layout, agreeing with ggml's
    mul_mat bit for bit, and not switched off by ``LUCEPY_CPU_KERNELS=0``. Decided once a
    process; an empty dict where none is usable (``why_not`` says why)."""
    if os.environ.get(ENV, "1") == "0":
        return {}
    if "kernels" not in _state:
        usable, why = {}, _layout_mismatch()
        for gtype in KINDS if why is None else ():
            found = variants(gtype)
            failed = "this CPU lacks AVX2, FMA or F16C" if not found else None
            failed = failed or check(lib, backend, found[0], gtype)
            if failed is None:
                usable[gtype] = found[0]
            else:
                why = f"{KINDS[gtype][0]}: {failed}"
                log.info("lucepy's %s CPU kernel is not used: %s", KINDS[gtype][0], failed)
        _state["kernels"], _state["why"] = usable, why
    return _state["kernels"]


def why_not() -> str | None:
    """Why ``kernels`` left a type to ggml (None: it took every type, or was not asked yet)."""
    return _state.get("why")


def _module() -> Any:
    """The compiled kernels (``lucepy.ggml._cpu``), or None where pip did not build them."""
    try:
        from lucepy.ggml import _cpu
    except ImportError:
        return None
    return _cpu


def _layout_mismatch() -> str | None:
    module = _module()
    if module is None:
        return "lucepy.ggml._cpu is not built (install lucepy with pip)"
    layout = module.layout()
    ours = {f: ffi.offsetof("struct ggml_tensor", f) for f in ("type", "ne", "nb", "src", "data")}
    ours["size"] = ffi.sizeof("struct ggml_tensor")
    if layout != ours:
        return f"compiled for another ggml_tensor layout ({layout} here {ours})"
    return None


def variants(gtype: int) -> list[Kernel]:
    """Every variant of the type's kernel this CPU runs, the preferred first (none unbuilt)."""
    module = _module()
    return [] if module is None else [Kernel(*v) for v in module.kernels()[KINDS[gtype][0]]]


def check(
    lib: Lib,
    backend: Backend,
    k: Kernel,
    gtype: int = Q4_1,
    rows: int = 37,
    cols: int = 11,
    K: int = 256,
) -> str | None:
    """Compute ``mul_mat`` of random blocks of ``gtype`` ([K, rows]) and f32 columns ([K,
    cols]) with ggml's kernel and with ``k`` on ``backend``; None when every value has the same
    bits, else what differs. Odd rows and a column count that is no multiple of 4 take every
    tile."""
    rng = np.random.default_rng(rows * 1000 + cols)
    ctx = Context(lib, 8, graph_nodes=16)
    try:
        w = lib.ggml_new_tensor_2d(ctx.ptr, gtype, K, rows)
        x = lib.ggml_new_tensor_2d(ctx.ptr, F32, K, cols)
        with Buffer(lib, ctx, backend, "the CPU kernel's check"):
            tensor_set(lib, w, random_blocks(gtype, rows * K // QK, rng))
            tensor_set(lib, x, rng.standard_normal((cols, K), dtype=np.float32))
            theirs = lib.ggml_mul_mat(ctx.ptr, w, x)
            ours = lib.ggml_mul_mat(ctx.ptr, w, x)
            gf = lib.ggml_new_graph_custom(ctx.ptr, 16, False)
            lib.ggml_build_forward_expand(gf, theirs)
            lib.ggml_build_forward_expand(gf, ours)
            if not take_products(lib, ctx.ptr, gf, {gtype: k}, only={address(ours)}):
                return "its check graph could not be rewritten"
            with Allocator(lib, backend) as alloc:
                alloc.alloc(gf)
                lib.ggml_backend_graph_compute(backend.ptr, gf)
                a, b = (np.empty((cols, rows), np.float32) for _ in range(2))
                lib.ggml_backend_tensor_get(theirs, ffi.from_buffer(a), 0, a.nbytes)
                lib.ggml_backend_tensor_get(ours, ffi.from_buffer(b), 0, b.nbytes)
    finally:
        ctx.close()
    differ = int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))
    if differ:
        worst = float(np.max(np.abs(a - b)))
        return f"{differ} of {a.size} results differ from ggml's (by up to {worst:.3g})"
    return None


def random_blocks(gtype: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` blocks of ``gtype`` as bytes: random values, a scale in [1e-3, 2e-2) and a min in
    [-0.2, 0) (finite halves)."""
    size = KINDS[gtype][1]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    halves = blocks[:, :4].view(np.uint16)
    halves[:, 0] = rng.uniform(1e-3, 2e-2, n).astype(np.float16).view(np.uint16)
    halves[:, 1] = rng.uniform(-0.2, 0.0, n).astype(np.float16).view(np.uint16)
    return blocks


def _takes(lib: Lib, node: Any, kinds: dict[int, Kernel]) -> bool:
    """A MUL_MAT a kernel computes: weights of a type in ``kinds`` in host memory of the CPU's
    plain buffer type (not a repacked layout), one matrix times ``MIN_COLS`` or more f32
    columns, no hint."""
    if node.op != MUL_MAT or any(node.op_params[i] for i in range(4)):
        return False
    w, x = node.src[0], node.src[1]
    if w.type not in kinds or x.type != F32 or x.ne[1] < MIN_COLS or w.buffer == ffi.NULL:
        return False
    if not lib.ggml_backend_buffer_is_host(w.buffer):
        return False
    buft = lib.ggml_backend_buffer_get_type(w.buffer)
    if ffi.string(lib.ggml_backend_buft_name(buft)) != b"CPU":
        return False
    size = KINDS[w.type][1]
    if w.nb[0] != size or w.nb[1] % size or x.nb[0] != 4:
        return False
    return all(t.ne[2] == 1 and t.ne[3] == 1 for t in (w, x))


def take_products(
    lib: Lib, ctx: Any, gf: Any, kinds: dict[int, Kernel], only: set[int] | None = None
) -> int:
    """Rewrite built graph ``gf`` (its tensors in ``ctx``) so that the kernels (ggml type ->
    kernel) compute every product they take (``only``: those nodes alone); how many they took.
    The graph is laid out again in its old order with each Q8_1 copy of an ``x`` right before
    the first product reading it. Leaves the graph as it was where ``ctx`` or the graph has no
    room for the copies."""
    nodes = [lib.ggml_graph_node(gf, i) for i in range(lib.ggml_graph_n_nodes(gf))]
    taken = [n for n in nodes if _takes(lib, n, kinds) and (only is None or address(n) in only)]
    sources = {address(n.src[1]) for n in taken}
    room = lib.ggml_get_mem_size(ctx) - lib.ggml_used_mem(ctx)
    if not taken or room < len(sources) * (lib.ggml_tensor_overhead() + 64):
        return 0
    if len(nodes) + len(sources) > lib.ggml_graph_size(gf):
        return 0
    params = {gtype: k.params() for gtype, k in kinds.items()}
    quantized: dict[int, Any] = {}
    for n in taken:
        x = n.src[1]
        key = address(x)
        if key not in quantized:
            quantized[key] = lib.ggml_cast(ctx, x, Q8_1)
        p = params[n.src[0].type]
        n.op, n.src[1] = CUSTOM, quantized[key]
        ffi.memmove(n.op_params, p, len(p))
    lib.ggml_graph_clear(gf)
    for n in nodes:
        lib.ggml_build_forward_expand(gf, n)
    counts = _state.setdefault("taken", dict.fromkeys(KINDS, 0))
    for n in taken:
        counts[int(n.src[0].type)] += 1
    return len(taken)


def taken_count(gtype: int | None = None) -> int:
    """Products ``take_products`` gave the kernels in this process (graphs built, not steps),
    of weights of ``gtype`` or of any type."""
    counts = _state.get("taken", dict.fromkeys(KINDS, 0))
    return sum(counts.values()) if gtype is None else counts[gtype]
