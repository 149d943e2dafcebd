"""GPU tier of issue 19: lucepy's own CUDA kernels (a build of `lucepy backends build cuda`) for
Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, Q4_1 and Q5_1 times 1 to 16 columns (`gemv` one, `gemm`
3 to 16, ggml's two), against the exact math on the same rounded weights, within the bound of
the GPU parity tests (no further from it than twice ggml's own kernels on the same GPU), and
against themselves where one graph shares its activations.
Skipped where the loaded ggml has no GPU (tests/conftest.py); tools/gpu_run.sh runs them."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from test_reference import rel_err

from lucepy.ggml import (
    GGML_TYPE_F16,
    GGML_TYPE_F32,
    GGML_TYPE_I32,
    GGML_TYPE_I64,
    Allocator,
    Buffer,
    Context,
    ffi,
    load,
)
from lucepy.ggml.kernels import cuda_kernels
from lucepy.runtime.devices import list_devices, open_backend
from lucepy.testing.quants import KINDS, dequantize, quantize

pytestmark = pytest.mark.gpu
GPU = "cuda:0"
# not a multiple of a CTA's rows (4 of gemv's, 64 of gemm's): idle warps at the end; and enough
# for gemm to take 3-8 columns (19 row tiles, 8 parts: a CTA for each of 132 multiprocessors)
ROWS = 1201
OURS = set(range(1, 17))  # column counts lucepy's kernels take (lucepy-mm.cu: MIN_GEMM_COLS)
N = 4096
EPS = 1e-6  # of the RMS norms
BULK_ONLY = ("q5_k", "q6_k")  # repacked, gemm_rb's at 2-16 columns always (lucepy-repacked.cu)


@pytest.fixture(scope="module")
def cuda():
    lib = load()
    kernels = cuda_kernels(lib)
    assert kernels is not None, (
        "this CUDA build has ggml's kernels only: build it with `lucepy backends build cuda`"
    )
    kernels.set(True)  # whatever this GPU's default
    yield lib, GPU, kernels
    kernels.set(None)


def computed(lib, device, consts, inputs, build, feeds, after_set=None, tensors=32, allocated=None):
    """One graph on a backend of its own (ggml-cuda keeps CUDA graphs per backend, and one
    captured by an earlier call with the other kernels switched on could be replayed): tensors
    ``consts`` ([(ggml type, ne0, ne1, raw)], set once) and f32 ``inputs`` ([(ne0, ne1)]),
    ``build(ctx, consts, inputs)`` giving its outputs, computed once per entry of ``feeds`` (one
    array a input, set anew each time); ``after_set(tensors)`` once the consts are set; room for
    ``tensors`` tensors; ``allocated()`` once the graph has its memory. Returns, per feed, each
    output as [ne1, ne0]."""
    backend = open_backend(lib, device)
    ctx = Context(lib, tensors, graph_nodes=64)
    cs = [
        (lib.ggml_new_tensor_2d(ctx.ptr, gtype, ne0, ne1), raw) for gtype, ne0, ne1, raw in consts
    ]
    ins = [lib.ggml_new_tensor_2d(ctx.ptr, GGML_TYPE_F32, ne0, ne1) for ne0, ne1 in inputs]
    buf = Buffer(lib, ctx, backend, "kernel test")
    for t, raw in cs:
        lib.ggml_backend_tensor_set(t, ffi.from_buffer(raw), 0, raw.nbytes)
    if after_set is not None:
        after_set([t for t, _ in cs])
    gf = lib.ggml_new_graph_custom(ctx.ptr, 64, False)
    outs = build(ctx.ptr, [t for t, _ in cs], ins)
    for out in outs:
        lib.ggml_build_forward_expand(gf, out)
    alloc = Allocator(lib, backend)
    alloc.alloc(gf)
    if allocated is not None:
        allocated()
    results = []
    for feed in feeds:
        for t, values in zip(ins, feed, strict=True):
            values = np.ascontiguousarray(values, dtype=np.float32)
            lib.ggml_backend_tensor_set(t, ffi.from_buffer(values), 0, values.nbytes)
        assert lib.ggml_backend_graph_compute(backend.ptr, gf) == 0
        got = []
        for out in outs:
            host = np.zeros((int(out.ne[1]), int(out.ne[0])), dtype=np.float32)
            lib.ggml_backend_tensor_get(out, ffi.from_buffer(host), 0, host.nbytes)
            got.append(host)
        results.append(got)
    alloc.close()
    buf.close()
    ctx.close()
    backend.close()
    return results


def products(lib, device, weights, xs, gate=None, norm=None, repack=None):
    """Each quantized matrix of ``weights`` ([(ggml type, raw rows)]) times the columns of each of
    ``xs`` ([k, n] f32), all in one graph, computed once per entry of ``xs``; with ``gate`` (type,
    raw rows), swiglu(gate x, W x) for the one matrix; with ``norm`` (a weight vector [n] f32),
    the products of rms_norm(x) * norm instead, that f32 input last among the results; with
    ``repack`` (the kernels), every matrix repacked once set. Returns, per entry of ``xs``, the
    list of results [k, rows] (``computed``)."""
    k, n = xs[0].shape
    consts = [(gtype, n, raw.shape[0], raw) for gtype, raw in weights + ([gate] if gate else [])]
    if norm is not None:
        consts.append((GGML_TYPE_F32, n, 1, np.ascontiguousarray(norm, dtype=np.float32)))

    def build(c, ts, ins):
        x = ins[0]
        if norm is not None:
            x = lib.ggml_mul(c, lib.ggml_rms_norm(c, x, EPS), ts[-1])
        if gate:
            up = lib.ggml_mul_mat(c, ts[0], x)
            outs = [lib.ggml_swiglu_split(c, lib.ggml_mul_mat(c, ts[1], x), up)]
        else:
            outs = [lib.ggml_mul_mat(c, t, x) for t in ts[: len(weights)]]
        return outs + ([x] if norm is not None else [])

    def repacked(ts):
        for t in ts[: len(weights) + bool(gate)]:
            assert repack.repack(t), "lucepy_cuda_repack refused the matrix"

    after_set = repacked if repack is not None else None
    return computed(lib, device, consts, [(n, k)], build, [(x,) for x in xs], after_set)


def weights_of(lib, kind: str, seed: int, rows: int = ROWS, n: int = N):
    gtype, _ = KINDS[kind]
    rng = np.random.default_rng(seed)
    raw = quantize(lib, rng.normal(size=(rows, n)) / np.sqrt(n), gtype)
    return gtype, raw, dequantize(lib, raw, gtype, n).astype(np.float64)


def counted(kernels, run) -> tuple[int, int, int]:
    """What ``run()`` had lucepy's kernels do: (products, activations prepared, of those the
    ones a kernel before the product prepared)."""
    before = (kernels.calls, kernels.quantized, kernels.fused)
    run()
    after = (kernels.calls, kernels.quantized, kernels.fused)
    return tuple(a - b for a, b in zip(after, before, strict=True))


def ours_and_theirs(kernels, run):
    """``run()`` on lucepy's kernels, then on ggml's."""
    ours = run()
    kernels.set(False)
    try:
        theirs = run()
    finally:
        kernels.set(True)
    return ours, theirs


def assert_products_near(mats, ours, theirs, x, label: str) -> None:
    """Each of ``ours`` (``x`` [k, n] f64 times the exact weights of each of ``mats``) no further
    from the exact math than twice ggml's (``theirs``) is."""
    for i, (_, _, exact_w) in enumerate(mats):
        exact = x @ exact_w.T
        bound = 2 * float(rel_err(theirs[i], exact).max())
        assert rel_err(ours[i], exact).max() <= bound, f"{label} matrix {i}"


def on_h200(lib, device) -> bool:
    """Whether ``device`` is an H200: the kernels' routes that tests assert are its (132 SMs, its
    CTA slots); another GPU may take others."""
    return any(d.name == device and "H200" in d.description for d in list_devices(lib))


def compute_capability(index: int) -> float:
    """The GPU's compute capability as nvidia-smi reports it (9.0 for an H100 or H200)."""
    out = subprocess.run(
        ["nvidia-smi", "-i", str(index), "--query-gpu=compute_cap", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip())


def test_gpu_kernels_are_on_by_default_from_compute_capability_9(cuda):
    """A process that does not force them (LUCEPY_CUDA_KERNELS unset) runs lucepy's kernels on
    the GPUs they were measured on, compute capability 9.0 and newer, and ggml's on older ones;
    forcing them either way holds on every device."""
    lib, device, kernels = cuda
    index = int(device.partition(":")[2])
    kernels.set(None)
    default = kernels.on(index)
    kernels.set(False)
    forced_off = kernels.on(index)
    kernels.set(True)
    forced_on = kernels.on(index)
    assert (default, forced_off, forced_on) == (compute_capability(index) >= 9.0, False, True)
    kernels.set(None)
    gtype, raw, _ = weights_of(lib, "q4_0", 11)
    x = np.random.default_rng(12).normal(size=(1, N)).astype(np.float32)
    calls = kernels.calls
    products(lib, device, [(gtype, raw)], [x])
    assert kernels.calls - calls == int(default)
    kernels.set(True)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_gpu_kernels_match_the_exact_math_for_1_to_16_columns(kind, cuda):
    """Every count of columns a DFlash verify takes.
    Column 1 of gemm's is scaled far past a half's range (gemm multiplies halves: each segment
    of 512 activations is scaled by a power of two first; ggml's q8_1 sums overflow there, so
    its bound comes from the unscaled columns), and column 0 has a segment of zeros."""
    lib, device, kernels = cuda
    gtype, raw, exact_w = weights_of(lib, kind, 1)
    rng = np.random.default_rng(2)
    for k in range(1, 17):
        x = rng.normal(size=(k, N)).astype(np.float32)
        x[0, 512:1024] = 0.0
        big = x.copy()
        if k > 1 and k in OURS:
            big[1] *= 3e5
        kernels.set(True)
        calls = kernels.calls
        [[ours]] = products(lib, device, [(gtype, raw)], [big])
        ran = kernels.calls - calls
        assert ran == (k in OURS), f"{kind} x {k}: lucepy's kernel ran {ran} times"
        kernels.set(False)
        [[theirs]] = products(lib, device, [(gtype, raw)], [x])
        assert kernels.calls == calls + ran
        kernels.set(True)
        exact = x.astype(np.float64) @ exact_w.T
        bound = 2 * float(rel_err(theirs, exact).max())
        err = rel_err(ours, big.astype(np.float64) @ exact_w.T)
        worst = f"column {err.argmax()}: {err.max():.2e} > {bound:.2e}"
        assert np.isfinite(ours).all() and err.max() <= bound, f"{kind} x {k}: {worst}"


@pytest.mark.parametrize("kind", ["q4_0", "q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("rows", [320, 336])
def test_gpu_repacked_matrix_matches_the_exact_math_at_every_column_count(kind, rows, cuda):
    """A Q4_0, Q4_K, Q5_K or Q6_K matrix repacked in place (lucepy_cuda_repack, lucepy-layouts.cuh's
    layout) is read by lucepy's kernels alone at every count of columns: one (gemv_r), 2-16
    (gemm_r), more (gemm_rq, here also past whole tiles of 64), and ggml's fused gate; each no
    further from the exact math than twice ggml's kernels on the blocks. 320 rows (tiles of 64, not
    of 128) or 336 (a last CTA of 16 rows, as qwen35's stacked DeltaNet inputs have), 2,048 values
    (8 of Q4_K's super-blocks)."""
    lib, device, kernels = cuda
    n = 2048
    gtype, raw, exact_w = weights_of(lib, kind, 21, rows=rows, n=n)
    _, gate_raw, gate_w = weights_of(lib, kind, 23, rows=rows, n=n)
    rng = np.random.default_rng(22)
    for k in (1, 2, 3, 8, 9, 16, 17, 64, 100):
        x = rng.normal(size=(k, n)).astype(np.float32)
        calls = kernels.calls
        [[ours]] = products(lib, device, [(gtype, raw)], [x], repack=kernels)
        assert kernels.calls - calls == 1, f"{k} columns"
        kernels.set(False)
        try:
            [[theirs]] = products(lib, device, [(gtype, raw)], [x])
        finally:
            kernels.set(True)
        exact = x.astype(np.float64) @ exact_w.T
        bound = 2 * float(rel_err(theirs, exact).max())
        err = rel_err(ours, exact)
        worst = f"column {err.argmax()}: {err.max():.2e} > {bound:.2e}"
        assert np.isfinite(ours).all() and err.max() <= bound, f"{k} columns: {worst}"
    x = rng.normal(size=(1, n)).astype(np.float32)
    g = x.astype(np.float64) @ gate_w.T
    exact = g / (1 + np.exp(-g)) * (x.astype(np.float64) @ exact_w.T)
    calls = kernels.calls
    gate = (gtype, gate_raw)
    [[ours]] = products(lib, device, [(gtype, raw)], [x], gate=gate, repack=kernels)
    assert kernels.calls == calls + 1
    kernels.set(False)
    try:
        [[theirs]] = products(lib, device, [(gtype, raw)], [x], gate=gate)
    finally:
        kernels.set(True)
    bound = 2 * float(rel_err(theirs, exact).max())
    assert rel_err(ours, exact).max() <= bound


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_gpu_fused_gate_and_swiglu_match_the_exact_math(kind, cuda):
    """One column: ggml fuses the up product, the gate product and the GLU into one call, which
    lucepy's kernel takes whole (one call, not two)."""
    lib, device, kernels = cuda
    gtype, up_raw, up_w = weights_of(lib, kind, 3)
    _, gate_raw, gate_w = weights_of(lib, kind, 4)
    x = np.random.default_rng(5).normal(size=(1, N)).astype(np.float32)
    g = x.astype(np.float64) @ gate_w.T
    exact = g / (1 + np.exp(-g)) * (x.astype(np.float64) @ up_w.T)
    calls = kernels.calls
    [[ours]] = products(lib, device, [(gtype, up_raw)], [x], gate=(gtype, gate_raw))
    assert kernels.calls == calls + 1
    kernels.set(False)
    [[theirs]] = products(lib, device, [(gtype, up_raw)], [x], gate=(gtype, gate_raw))
    kernels.set(True)
    bound = 2 * float(rel_err(theirs, exact).max())
    assert rel_err(ours, exact).max() <= bound


@pytest.mark.parametrize(("kind", "k"), [("q4_0", 1), ("q8_0", 1), ("q4_k", 5), ("q4_0", 16)])
def test_gpu_rms_norm_prepares_the_activations_of_its_products(kind, k, cuda):
    """An RMS norm times its weight whose result two products read (Q and K, or up and gate) is
    one kernel of ours that also prepares that result for them: int8 planes for one column (Q8_0
    two), halves for 2-16. The products take it (one preparation, counted as a norm's), the
    norm's result is ggml's, and the products are within twice ggml's error of the exact math;
    with new inputs (the CUDA graph captured and replayed) the new products."""
    lib, device, kernels = cuda
    mats = [weights_of(lib, kind, 20 + i) for i in range(2)]
    weights = [(t, raw) for t, raw, _ in mats]
    rng = np.random.default_rng(21)
    wn = rng.uniform(0.5, 1.5, size=N).astype(np.float32)
    xs = [3.0 * rng.normal(size=(k, N)).astype(np.float32) for _ in range(3)]
    assert counted(kernels, lambda: products(lib, device, weights, xs[:1], norm=wn)) == (2, 1, 1)
    ours, theirs = ours_and_theirs(kernels, lambda: products(lib, device, weights, xs, norm=wn))
    for j, x in enumerate(xs):
        x64 = x.astype(np.float64)
        normed = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + EPS) * wn
        np.testing.assert_allclose(ours[j][-1], theirs[j][-1], rtol=1e-5, atol=1e-6)
        assert rel_err(ours[j][-1], normed).max() < 1e-5
        assert_products_near(mats, ours[j], theirs[j], normed, f"{kind} input {j}")


def gated_products(lib, device, weights, zs, xs, op, cols=1, wide=False):
    """Each matrix of ``weights`` times act(z) * x (act ``op``: "silu" or "sigmoid") for each pair
    of ``zs`` and ``xs``, ``cols`` columns of n values (one column reshaped from [n / 128, 128],
    as qwen35's gated norm feeds its output product); with ``wide`` each z is qwen35's attention
    gate, its rows of 128 beside 128 others ([cols, 2 n]: a head's query, then its gate), copied
    out by a CONT. The gate's result last among the results (``computed``)."""
    n = xs[0].size // cols
    consts = [(gtype, n, raw.shape[0], raw) for gtype, raw in weights]

    def build(c, ts, ins):
        z, x = ins
        if wide:
            heads = lib.ggml_view_3d(c, z, 128, n // 128, cols, 4 * 256, z.nb[1], 4 * 128)
            z = lib.ggml_cont_2d(c, heads, n, cols)
        act = lib.ggml_silu(c, z) if op == "silu" else lib.ggml_sigmoid(c, z)
        gated = lib.ggml_reshape_2d(c, lib.ggml_mul(c, x, act), n, cols)
        return [lib.ggml_mul_mat(c, t, gated) for t in ts] + [gated]

    shape = (n, cols) if cols > 1 or wide else (128, n // 128)
    z_shape = (2 * n, cols) if wide else shape
    return computed(lib, device, consts, [z_shape, shape], build, list(zip(zs, xs, strict=True)))


@pytest.mark.parametrize(
    ("kind", "op", "cols"), [("q4_0", "silu", 1), ("q8_0", "sigmoid", 1), ("q4_0", "sigmoid", 16)]
)
def test_gpu_gate_quantizes_for_its_products(kind, op, cols, cuda):
    """A SiLU or sigmoid gate times a tensor, that two products read, is one kernel of ours that
    also prepares its result for them (int8 planes for one column, reshaped from rows of 128;
    halves for 2-16): one preparation (counted as fused), the gate's result ggml's, the products
    within twice ggml's error of the exact math, new products for new inputs (the CUDA graph
    replayed)."""
    lib, device, kernels = cuda
    mats = [weights_of(lib, kind, 30 + i) for i in range(2)]
    weights = [(t, raw) for t, raw, _ in mats]
    rng = np.random.default_rng(31 + cols)
    shape = (N // 128, 128) if cols == 1 else (cols, N)
    zs = [2.0 * rng.normal(size=shape).astype(np.float32) for _ in range(3)]
    xs = [rng.normal(size=shape).astype(np.float32) for _ in range(3)]

    def run(feeds):
        return gated_products(lib, device, weights, zs[:feeds], xs[:feeds], op, cols)

    assert counted(kernels, lambda: run(1)) == (2, 1, 1)
    ours, theirs = ours_and_theirs(kernels, lambda: run(3))
    for j, (z, x) in enumerate(zip(zs, xs, strict=True)):
        z64 = z.astype(np.float64).reshape(cols, N)
        act = z64 / (1 + np.exp(-z64)) if op == "silu" else 1 / (1 + np.exp(-z64))
        gated = act * x.astype(np.float64).reshape(cols, N)
        np.testing.assert_allclose(ours[j][-1], theirs[j][-1], rtol=1e-6, atol=1e-7)
        assert_products_near(mats, ours[j], theirs[j], gated, f"{kind} input {j}")


@pytest.mark.parametrize(("op", "cols"), [("sigmoid", 1), ("sigmoid", 16), ("silu", 3)])
def test_gpu_gate_reads_its_z_in_place(op, cols, cuda):
    """qwen35's attention gate: z copied out of a wider product by a CONT that only the gate
    reads (each head's 128 values beside its query's) is read in place by the gate's kernel: the
    copy not made (counted as a copy), one kernel preparing the products' activations as
    without it, the results the same as from z given whole, bit for bit."""
    lib, device, kernels = cuda
    mats = [weights_of(lib, "q4_0", 70 + i) for i in range(2)]
    weights = [(t, raw) for t, raw, _ in mats]
    rng = np.random.default_rng(71 + cols)
    wides = [2.0 * rng.normal(size=(cols, 2 * N)).astype(np.float32) for _ in range(3)]
    zs = [wz.reshape(cols, N // 128, 2, 128)[:, :, 1].reshape(cols, N) for wz in wides]
    xs = [rng.normal(size=(cols, N)).astype(np.float32) for _ in range(3)]

    def run(zs, wide, feeds=3):
        return gated_products(lib, device, weights, zs[:feeds], xs[:feeds], op, cols, wide)

    copies = kernels.copies
    assert counted(kernels, lambda: run(wides, True, 1)) == (2, 1, 1)
    assert kernels.copies - copies == 1
    in_place, whole = run(wides, True), run(zs, False)
    for j in range(3):
        for got, want in zip(in_place[j], whole[j], strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("k", [1, 16])
def test_gpu_shared_activations_follow_each_compute(k, cuda):
    """Three products of one input in one graph (as Q, K and V are) prepare it once (quantized
    for one column, halves for 16) and equal each product alone; computing the graph again with
    new inputs (CUDA graphs capture the second compute and replay the third, with no host code:
    the counters do not see it) gives the new products, not stale ones."""
    lib, device, kernels = cuda
    mats = [weights_of(lib, "q4_0", 10 + i) for i in range(3)]
    rng = np.random.default_rng(6)
    xs = [rng.normal(size=(k, N)).astype(np.float32) for _ in range(3)]
    assert k in OURS
    weights = [(t, raw) for t, raw, _ in mats]
    calls, quantized = kernels.calls, kernels.quantized
    products(lib, device, weights, xs[:1])
    assert (kernels.calls - calls, kernels.quantized - quantized) == (3, 1)
    together = products(lib, device, weights, xs)
    for i, (gtype, raw, _) in enumerate(mats):
        for j, x in enumerate(xs):
            [[alone]] = products(lib, device, [(gtype, raw)], [x])
            np.testing.assert_array_equal(together[j][i], alone)


def gated_norm_products(lib, device, weights, norm, xs, zs, op, cols=1, wide=0):
    """Each matrix of ``weights`` times gate(z) * (rms_norm(x) * norm) (qwen35's gated norm: x
    and z [rows, n], each row normed alone, the result read as ``cols`` columns of whole rows), for
    each pair of ``xs`` and ``zs``; then the gated result and the norm times its weight
    (``computed``). With ``wide``, each z is given as [cols, wide] (a stacked product's output:
    z its first rows * n / cols values a column) and copied out of it (a CONT, built first, as
    qwen35's verify does); the copy is then the first result."""
    rows, n = xs[0].shape
    per_col = rows * n // cols
    consts = [(gtype, per_col, raw.shape[0], raw) for gtype, raw in weights]
    consts.append((GGML_TYPE_F32, n, 1, np.ascontiguousarray(norm, dtype=np.float32)))

    def build(c, ts, ins):
        x, z = ins
        first = []
        if wide:
            z = lib.ggml_cont(c, lib.ggml_view_2d(c, z, per_col, cols, z.nb[1], 0))
            first = [z]
            z = lib.ggml_reshape_2d(c, z, n, rows)
        normed = lib.ggml_mul(c, lib.ggml_rms_norm(c, x, EPS), ts[-1])
        act = lib.ggml_silu(c, z) if op == "silu" else lib.ggml_sigmoid(c, z)
        gated = lib.ggml_reshape_2d(c, lib.ggml_mul(c, normed, act), per_col, cols)
        lib.ggml_set_output(normed)  # (read back: its memory not reused)
        return first + [lib.ggml_mul_mat(c, t, gated) for t in ts[:-1]] + [gated, normed]

    feeds = list(zip(xs, zs, strict=True))
    z_shape = (wide, cols) if wide else (n, rows)
    return computed(lib, device, consts, [(n, rows), z_shape], build, feeds)


@pytest.mark.parametrize(
    ("kind", "op", "n", "cols"),
    [
        ("q4_0", "silu", 128, 1),
        ("q8_0", "sigmoid", 64, 1),
        ("q4_0", "silu", 128, 16),
        ("q4_k", "sigmoid", 256, 3),
        ("q8_0", "silu", 64, 9),
    ],
)
def test_gpu_gated_norm_quantizes_for_its_products(kind, op, n, cols, cuda):
    """A gated norm of short rows (qwen35's DeltaNet output: 48 heads of 128 a token) whose result
    two products read as one column (a decode) or as 2-16 columns of whole rows (a verify) is one
    kernel of ours that also prepares it for them (int8 planes, or halves): one preparation
    (counted as fused), the norm and the gated result ggml's within float rounding, the products
    within twice ggml's error of the exact math, new products for new inputs (the CUDA graph
    replayed)."""
    lib, device, kernels = cuda
    mats = [weights_of(lib, kind, 50 + i) for i in range(2)]
    weights = [(t, raw) for t, raw, _ in mats]
    rng = np.random.default_rng(51)
    rows = N // n * cols
    wn = rng.uniform(0.5, 1.5, size=n).astype(np.float32)
    xs = [3.0 * rng.normal(size=(rows, n)).astype(np.float32) for _ in range(3)]
    zs = [2.0 * rng.normal(size=(rows, n)).astype(np.float32) for _ in range(3)]
    first = counted(
        kernels, lambda: gated_norm_products(lib, device, weights, wn, xs[:1], zs[:1], op, cols)
    )
    assert first == (2, 1, 1)
    ours, theirs = ours_and_theirs(
        kernels, lambda: gated_norm_products(lib, device, weights, wn, xs, zs, op, cols)
    )
    for j, (x, z) in enumerate(zip(xs, zs, strict=True)):
        x64, z64 = x.astype(np.float64), z.astype(np.float64)
        normed = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + EPS) * wn
        act = z64 / (1 + np.exp(-z64)) if op == "silu" else 1 / (1 + np.exp(-z64))
        gated = (normed * act).reshape(cols, N)
        np.testing.assert_allclose(ours[j][-1], theirs[j][-1], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ours[j][-2], theirs[j][-2], rtol=1e-5, atol=1e-6)
        assert rel_err(ours[j][-2], gated).max() < 1e-5
        assert_products_near(mats, ours[j], theirs[j], gated, f"{kind} input {j}")


@pytest.mark.parametrize(("op", "cols"), [("silu", 16), ("sigmoid", 3)])
def test_gpu_gated_norm_reads_its_gate_in_place(op, cols, cuda):
    """A verify's gated norm whose z is copied out of a wider product just before it (qwen35's
    DeltaNet z, a CONT only the gate reads) reads z from the product in place: the copy not made
    (counted as a copy), one kernel as without it, the results the same as from a z given
    whole, bit for bit."""
    lib, device, kernels = cuda
    n, more = 128, 40
    mats = [weights_of(lib, "q4_0", 60 + i) for i in range(2)]
    weights = [(t, raw) for t, raw, _ in mats]
    rng = np.random.default_rng(61 + cols)
    rows = N // n * cols
    wn = rng.uniform(0.5, 1.5, size=n).astype(np.float32)
    xs = [3.0 * rng.normal(size=(rows, n)).astype(np.float32) for _ in range(3)]
    wides = [2.0 * rng.normal(size=(cols, N + more)).astype(np.float32) for _ in range(3)]
    zs = [wz[:, :N].reshape(rows, n) for wz in wides]

    def run(zs, wide=0, feeds=3):
        return gated_norm_products(lib, device, weights, wn, xs[:feeds], zs[:feeds], op, cols, wide)

    copies = kernels.copies
    assert counted(kernels, lambda: run(wides, N + more, 1)) == (2, 1, 1)
    assert kernels.copies - copies == 1
    in_place = run(wides, N + more)
    whole = run(zs)
    for j in range(3):
        for got, want in zip(in_place[j][1:], whole[j], strict=True):
            np.testing.assert_array_equal(got, want)


def glu_products(lib, device, weights, gates, ups):
    """Each matrix of ``weights`` times silu(gate) * up (an FFN's SWIGLU, ggml's GLU op of two
    tensors: ``gates`` and ``ups`` [k, n]), for each pair; then the GLU's result
    (``computed``)."""
    k, n = gates[0].shape
    consts = [(gtype, n, raw.shape[0], raw) for gtype, raw in weights]

    def build(c, ts, ins):
        h = lib.ggml_swiglu_split(c, ins[0], ins[1])
        lib.ggml_set_output(h)  # (read back: its memory not reused)
        return [lib.ggml_mul_mat(c, t, h) for t in ts] + [h]

    feeds = list(zip(gates, ups, strict=True))
    return computed(lib, device, consts, [(n, k), (n, k)], build, feeds)


@pytest.mark.parametrize(("kind", "k"), [("q4_0", 16), ("q6_k", 3)])
def test_gpu_glu_prepares_halves_for_its_products(kind, k, cuda):
    """A SWIGLU whose result two products read as 2-16 columns (a verify's FFN down) is one
    kernel of ours that also writes the products' halves: one preparation (counted as fused),
    the result ggml's within float rounding, the products within twice ggml's error of the
    exact math, new products for new inputs (the CUDA graph replayed)."""
    lib, device, kernels = cuda
    mats = [weights_of(lib, kind, 70 + i) for i in range(2)]
    weights = [(t, raw) for t, raw, _ in mats]
    rng = np.random.default_rng(71)
    gates = [2.0 * rng.normal(size=(k, N)).astype(np.float32) for _ in range(3)]
    ups = [rng.normal(size=(k, N)).astype(np.float32) for _ in range(3)]
    first = counted(kernels, lambda: glu_products(lib, device, weights, gates[:1], ups[:1]))
    assert first == (2, 1, 1)
    ours, theirs = ours_and_theirs(kernels, lambda: glu_products(lib, device, weights, gates, ups))
    for j, (g, u) in enumerate(zip(gates, ups, strict=True)):
        g64 = g.astype(np.float64)
        h = g64 / (1 + np.exp(-g64)) * u
        np.testing.assert_allclose(ours[j][-1], theirs[j][-1], rtol=1e-6, atol=1e-7)
        assert rel_err(ours[j][-1], h).max() < 1e-6
        assert_products_near(mats, ours[j], theirs[j], h, f"{kind} input {j}")


def ffn_products(lib, device, weights, xs, keep_gate=False, repack=None):
    """An FFN as qwen35's graph writes it (models/base.py ``swiglu_ffn``): ``weights`` [(ggml
    type, row length, raw rows)] of the gate, the up and the down matrix; down (silu(gate x) *
    up x) for each of ``xs`` [k, n], and the GLU's result; with ``keep_gate`` the gate product
    is an output too (its result must be written); with ``repack`` (the kernels), every matrix
    repacked once set. Returns, per input, [the down product, the GLU's result]
    (``computed``)."""
    consts = [(gtype, ne0, raw.shape[0], raw) for gtype, ne0, raw in weights]

    def build(c, ts, ins):
        gate = lib.ggml_mul_mat(c, ts[0], ins[0])
        h = lib.ggml_swiglu_split(c, gate, lib.ggml_mul_mat(c, ts[1], ins[0]))
        lib.ggml_set_output(h)  # (read back: its memory not reused)
        if keep_gate:
            lib.ggml_set_output(gate)
        return [lib.ggml_mul_mat(c, ts[2], h), h]

    def repacked(ts):
        for t in ts:
            assert repack.repack(t), "lucepy_cuda_repack refused the matrix"

    after_set = repacked if repack is not None else None
    k, n = xs[0].shape
    return computed(lib, device, consts, [(n, k)], build, [(x,) for x in xs], after_set)


@pytest.mark.parametrize(
    ("kind", "k", "n", "n_ff"),
    [
        ("q4_0", 3, 2048, 512),
        ("q4_0", 16, 2048, 512),
        ("q4_0", 16, 5120, 17408),
        ("q4_k", 3, 2048, 512),
        ("q4_k", 16, 5120, 17408),
        ("q5_k", 3, 2048, 512),
        ("q6_k", 3, 2048, 512),
        ("q6_k", 16, 5120, 17408),
    ],
)
def test_gpu_ffn_gate_and_up_are_one_product(kind, k, n, n_ff, cuda):
    """A verify's FFN on repacked Q4_0, Q4_K, Q5_K or Q6_K (3-16 columns): the gate and up
    products of one input and their SWIGLU are one product of ours over both matrices and one
    kernel that adds its parts and applies the gate (counted as two products and an op); the
    GLU's result and the down product no further from the exact math than twice ggml's kernels on
    the blocks; new inputs, new results (the CUDA graph replayed). With the gate product kept as
    an output, each product on its own (no op), the GLU's result the same within float rounding
    (within 4e-3 where the stack is gemm_f8's: its two e4m3 terms an activation).
    On an H200 the 27B-shaped FFN's two products at 16 columns are gemm_rb's (bulk_product: the
    stack's 544 row blocks of 20 chunks, the down's 80 of 68), the small FFN's gemm_r's; Q5_K's
    and Q6_K's always gemm_rb's; but a Q4_0 or Q4_K stack at 9-16 columns is gemm_f8's (Hopper's
    FP8 warpgroup mma, its activations converted by to_e4m3), and so is the 27B-shaped down
    (f8_single: 6 chunks a CTA slot and more), its e4m3 records written by the GLU's kernel (no
    conversion of its own: as many activations quantized as with halves); where that stack is
    one part (the 27B-shaped one), gemm_f8 computes the SWIGLU itself (each CTA the same rows of
    both matrices: lucepy-repacked.cu's f8_glu) and the down's input is converted on its own, no
    kernel before it preparing it; its 16 row tiles past 4 waves of one CTA an SM are cut into
    parts along k that the last of them to finish adds (f8_tail), right again on each replay
    (each tile's count back to 0)."""
    lib, device, kernels = cuda
    h200 = on_h200(lib, device)
    shapes = [(n_ff, n), (n_ff, n), (n, n_ff)]  # (rows, row length): gate, up, down
    mats = [weights_of(lib, kind, 90 + i, rows=r, n=c) for i, (r, c) in enumerate(shapes)]
    weights = [(t, c, raw) for (t, raw, _), (_, c) in zip(mats, shapes, strict=True)]
    rng = np.random.default_rng(93)
    xs = [rng.normal(size=(k, n)).astype(np.float32) for _ in range(3)]

    def run(feeds, keep_gate=False):
        calls, ops = kernels.calls, kernels.ops
        out = ffn_products(lib, device, weights, feeds, keep_gate, repack=kernels)
        return out, (kernels.calls - calls, kernels.ops - ops)

    bulk, f8, quantized, fused = kernels.bulk, kernels.f8, kernels.quantized, kernels.fused
    tailed = kernels.tailed
    assert run(xs[:1])[1] == (3, 1)
    assert kernels.quantized - quantized == 2  # the stack's input, the GLU's halves or records
    f8_stack = kind in ("q4_0", "q4_k") and k > 8
    f8_down = f8_stack and n_ff == 17408
    if h200:
        big = n_ff == 17408 or kind in BULK_ONLY
        assert kernels.bulk - bulk == big * (2 - f8_stack - f8_down), "gemm_rb's products"
        assert kernels.f8 - f8 == f8_stack + f8_down, "gemm_f8's products"
        # the down's input prepared by glu_halves, or (the SWIGLU in gemm_f8) converted
        assert kernels.fused - fused == int(not f8_down), "who prepares the down's input"
        # the stack's 544 row tiles on 132 SMs: the 16 past 4 waves each in 7 parts (f8_tail)
        assert kernels.tailed - tailed == int(f8_down), "a tail"
    kept, counts = run(xs[:1], keep_gate=True)
    assert counts == (3, 0)
    ours, _ = run(xs)
    kernels.set(False)
    try:
        theirs = ffn_products(lib, device, weights, xs)
    finally:
        kernels.set(True)
    if h200 and f8_stack:
        assert rel_err(kept[0][1], ours[0][1]).max() < 4e-3
    else:
        np.testing.assert_allclose(kept[0][1], ours[0][1], rtol=1e-5, atol=1e-6)
    for j, x in enumerate(xs):
        g = x.astype(np.float64) @ mats[0][2].T
        h = g / (1 + np.exp(-g)) * (x.astype(np.float64) @ mats[1][2].T)
        for i, exact in enumerate((h @ mats[2][2].T, h)):
            bound = 2 * float(rel_err(theirs[j][i], exact).max())
            assert rel_err(ours[j][i], exact).max() <= bound, f"input {j}, result {i}"
        assert not np.array_equal(ours[j][0], ours[(j + 1) % 3][0])  # new inputs, new results


def residual_products(lib, device, weights, xs, rs, keep, repack=None):
    """A matrix of ``weights`` ([(ggml type, raw rows)], one) times each of ``xs`` ([k, n]) plus
    the residual of ``rs`` ([k, rows]) (a layer's output product and its ADD); with ``keep``
    the product is an output too (so nothing may skip writing it). Returns, per pair, [the sum]
    (and the product) (``computed``)."""
    (gtype, raw), (k, n) = weights[0], xs[0].shape
    rows = raw.shape[0]

    def build(c, ts, ins):
        product = lib.ggml_mul_mat(c, ts[0], ins[0])
        total = lib.ggml_add(c, product, ins[1])
        if keep:
            lib.ggml_set_output(product)
            return [total, product]
        return [total]

    def repacked(ts):
        assert repack.repack(ts[0]), "lucepy_cuda_repack refused the matrix"

    feeds = list(zip(xs, rs, strict=True))
    after_set = repacked if repack is not None else None
    consts = [(gtype, n, rows, raw)]
    return computed(lib, device, consts, [(n, k), (rows, k)], build, feeds, after_set)


@pytest.mark.parametrize(
    ("kind", "k", "repacked"),
    [("q4_0", 16, False), ("q4_k", 3, False), ("q4_0", 9, True), ("q4_0", 16, True)],
)
def test_gpu_residual_add_is_its_products_sum(kind, k, repacked, cuda):
    """A product of 2-16 columns and the ADD of a residual after it (a verify layer's output
    and its skip connection) is one product of ours that writes the sum (counted as an op),
    bit for bit what the product and ggml's ADD give apart (the product kept as an output
    too), on blocks and on repacked weights, for new inputs too (the CUDA graph replayed)."""
    lib, device, kernels = cuda
    rows, n = (320, 2048) if repacked else (ROWS, N)
    mats = [weights_of(lib, kind, 80, rows, n)]
    weights = [(t, raw) for t, raw, _ in mats]
    rng = np.random.default_rng(81)
    xs = [rng.normal(size=(k, n)).astype(np.float32) for _ in range(3)]
    rs = [rng.normal(size=(k, rows)).astype(np.float32) for _ in range(3)]
    repack = kernels if repacked else None

    def run(keep, feeds=3):
        ops = kernels.ops
        out = residual_products(lib, device, weights, xs[:feeds], rs[:feeds], keep, repack)
        return out, kernels.ops - ops

    assert run(False, 1)[1] == 1
    assert run(True, 1)[1] == 0
    joined, _ = run(False)
    apart, _ = run(True)
    for j in range(3):
        np.testing.assert_array_equal(joined[j][0], apart[j][0])
        assert not np.array_equal(joined[j][0], joined[(j + 1) % 3][0])  # new inputs, new sums
    exact = xs[0].astype(np.float64) @ mats[0][2].T + rs[0]
    assert rel_err(joined[0][0], exact).max() < 2e-2


@pytest.mark.parametrize(
    ("kind", "rows", "n", "cols"),
    [
        ("q4_0", 10240, 5120, (8, 9, 16)),
        ("q4_0", 16384, 5120, (16,)),
        ("q4_k", 16384, 5120, (9, 16)),
        ("q4_0", 5120, 17408, (2, 5, 8, 16)),
        ("q4_k", 5120, 17408, (2, 16)),
        ("q5_k", 5120, 17408, (2, 16)),
        ("q6_k", 5120, 17408, (2, 16)),
    ],
)
def test_gpu_repacked_products_by_bulk_copies_match_the_exact_math(kind, rows, n, cols, cuda):
    """Repacked Q4_0 (and Q4_K, Q5_K, Q6_K) products big enough for gemm_rb on an H200 (its
    weights by the TMA unit: lucepy-repacked.cu's bulk_product): the 27B-shaped model's attention
    qkv, 10,240 x 5,120 (4.8 chunks a CTA slot at two column tiles: gemm_rb at 9-16 columns; 4.0 at
    one: gemm_r at 8), and its ffn down, 5,120 x 17,408 (6.9 a slot at one tile: gemm_rb at 2-8
    columns too; Q5_K's and Q6_K's gemm_rb always; Q4_0's and Q4_K's gemm_f8's at 9-16 columns,
    8.2 chunks a slot of its: lucepy-repacked.cu's f8_single), and 16,384 x 5,120 (the DeltaNet
    inputs' size: gemm_f8's in 2 parts, which the CTAs of each row tile, a cluster, add
    themselves: f8_paired). Each no further from the exact math than
    twice ggml's kernels on the blocks, in parts and with its residual ADD (the sum one product
    of ours, bit for bit the product and ggml's ADD apart), for new inputs too (the CUDA graph
    replayed)."""
    lib, device, kernels = cuda
    h200 = on_h200(lib, device)
    mats = [weights_of(lib, kind, 61, rows=rows, n=n)]
    weights = [(t, raw) for t, raw, _ in mats]
    rng = np.random.default_rng(62)
    for k in cols:
        xs = [rng.normal(size=(k, n)).astype(np.float32) for _ in range(2)]
        calls, bulk, f8s, paired = kernels.calls, kernels.bulk, kernels.f8, kernels.paired
        [[ours]] = products(lib, device, weights, xs[:1], repack=kernels)
        assert kernels.calls - calls == 1, f"{k} columns"
        if h200:
            f8 = int(kind in ("q4_0", "q4_k") and k > 8 and rows in (5120, 16384))
            route = int(rows == 5120 or k > 8 or kind in BULK_ONLY) - f8
            assert kernels.bulk - bulk == route, f"{k} columns: route"
            assert kernels.f8 - f8s == f8, f"{k} columns: route"
            assert kernels.paired - paired == int(f8 and rows == 16384), f"{k} columns: parts"
        kernels.set(False)
        try:
            [[theirs]] = products(lib, device, weights, xs[:1])
        finally:
            kernels.set(True)
        exact = xs[0].astype(np.float64) @ mats[0][2].T
        bound = 2 * float(rel_err(theirs, exact).max())
        err = rel_err(ours, exact)
        worst = f"column {err.argmax()}: {err.max():.2e} > {bound:.2e}"
        assert np.isfinite(ours).all() and err.max() <= bound, f"{k} columns: {worst}"
        rs = [rng.normal(size=(k, rows)).astype(np.float32) for _ in range(2)]
        joined = residual_products(lib, device, weights, xs, rs, False, kernels)
        apart = residual_products(lib, device, weights, xs, rs, True, kernels)
        for j in range(2):
            np.testing.assert_array_equal(joined[j][0], apart[j][0])
        assert not np.array_equal(joined[0][0], joined[1][0])  # new inputs, new sums
        np.testing.assert_array_equal(apart[0][1], ours)  # the product kept: the same bytes


def residual_norm_products(lib, device, weights, norm, xs, rs, apart, repack=None):
    """A verify layer's output product plus its residual, then the next block's RMS norm times
    ``norm`` and two products of that: ``weights`` [(ggml type, raw rows)] are the output matrix
    and the two after the norm (of as many values a row as the first has rows); computed once
    per pair of ``xs`` ([k, n]) and ``rs`` ([k, rows]). With ``apart`` the norm reads a copy of
    the sum (a CONT between them), so that the sum and the norm cannot be one kernel. Returns,
    per pair, [the two products, the sum, the norm's result] (``computed``). With a fourth
    matrix the two are an FFN's gate and up, and the product of the fourth (the down) and
    their SWIGLU is returned in their place."""
    (k, n), rows = xs[0].shape, weights[0][1].shape[0]
    consts = [(weights[0][0], n, rows, weights[0][1])]
    consts += [(gtype, rows, raw.shape[0], raw) for gtype, raw in weights[1:3]]
    consts += [(gtype, weights[1][1].shape[0], raw.shape[0], raw) for gtype, raw in weights[3:]]
    consts.append((GGML_TYPE_F32, rows, 1, np.ascontiguousarray(norm, dtype=np.float32)))

    def build(c, ts, ins):
        total = lib.ggml_add(c, lib.ggml_mul_mat(c, ts[0], ins[0]), ins[1])
        normed = lib.ggml_mul(
            c, lib.ggml_rms_norm(c, lib.ggml_cont(c, total) if apart else total, EPS), ts[-1]
        )
        for t in (total, normed):  # kept: the allocator would lay later results over them
            lib.ggml_set_output(t)
        prods = [lib.ggml_mul_mat(c, t, normed) for t in ts[1:3]]
        if len(weights) == 4:
            prods = [lib.ggml_mul_mat(c, ts[3], lib.ggml_swiglu_split(c, *prods))]
        return prods + [total, normed]

    def repacked(ts):
        for t in ts[: len(weights)]:
            assert repack.repack(t), "lucepy_cuda_repack refused the matrix"

    feeds = list(zip(xs, rs, strict=True))
    after_set = repacked if repack is not None else None
    return computed(lib, device, consts, [(n, k), (rows, k)], build, feeds, after_set)


@pytest.mark.parametrize(
    ("kind", "k", "rows", "n", "repacked"),
    [
        ("q4_0", 16, 5120, 2048, True),  # in parts: the parts, the residual, the norm
        ("q4_0", 9, 2048, 512, True),  # one part: the product adds the residual, norm_halves
        ("q4_k", 12, 5120, 2048, False),  # (at 3-8 columns ggml's take the 320-row products)
    ],
)
def test_gpu_residual_sum_and_next_norm_are_one_kernel(kind, k, rows, n, repacked, cuda):
    """A verify layer's output product, its residual ADD and the next block's RMS norm times its
    weight (a product's input) are the product and one kernel of ours (in parts, a cluster a
    column: the parts' sum, the residual, the norm and the halves of the products after it; of
    one part, the norm's own kernel), bit for bit what the product, the sum and the norm give
    apart (the norm reading a copy of the sum): the sum, the norm's result and both products
    after it, for new inputs too (the CUDA graph replayed); in parts, one launch fewer (counted
    as joined); near the exact math."""
    lib, device, kernels = cuda
    mats = [weights_of(lib, kind, 90, rows, n)] + [
        weights_of(lib, kind, 91 + i, 320, rows) for i in range(2)
    ]
    weights = [(t, raw) for t, raw, _ in mats]
    rng = np.random.default_rng(92)
    wn = rng.uniform(0.5, 1.5, size=rows).astype(np.float32)
    xs = [rng.normal(size=(k, n)).astype(np.float32) for _ in range(3)]
    rs = [rng.normal(size=(k, rows)).astype(np.float32) for _ in range(3)]
    repack = kernels if repacked else None

    def run(apart, feeds=3):
        joined = kernels.joined
        out = residual_norm_products(
            lib, device, weights, wn, xs[:feeds], rs[:feeds], apart, repack
        )
        return out, kernels.joined - joined

    in_parts = n == 2048
    assert run(False, 1)[1] == int(in_parts)
    assert run(True, 1)[1] == 0
    (one, _), (apart, _) = run(False), run(True)
    for j in range(3):
        for i in range(4):
            np.testing.assert_array_equal(one[j][i], apart[j][i], err_msg=f"input {j}, result {i}")
        assert not np.array_equal(one[j][2], one[(j + 1) % 3][2])  # new inputs, new sums
    total = xs[0].astype(np.float64) @ mats[0][2].T + rs[0]
    normed = total / np.sqrt((total**2).mean(axis=1, keepdims=True) + EPS) * wn
    assert rel_err(one[0][2], total).max() < 2e-2
    assert rel_err(one[0][3], normed).max() < 2e-2
    for i in range(2):
        assert rel_err(one[0][i], normed @ mats[1 + i][2].T).max() < 2e-2


@pytest.mark.parametrize("k", [9, 16])
def test_gpu_residual_sum_and_norm_write_the_ffns_e4m3_records(k, cuda):
    """A verify layer's output product in parts, its residual ADD and the next block's RMS norm
    times its weight before an FFN of repacked Q4_0 at 9-16 columns: on an H200 the kernel that
    adds the parts and norms the sum writes the gate and up's e4m3 records itself (no conversion
    of its own: as many activations quantized as with halves) and they are one product of
    gemm_f8's; the sum bit for bit what the graph gives apart, the norm's result as well, and the
    down product of their SWIGLU no further from the exact math than twice ggml's kernels on the
    blocks, for new inputs too (the CUDA graph replayed)."""
    lib, device, kernels = cuda
    rows, n, n_ff = 5120, 2048, 512
    mats = [weights_of(lib, "q4_0", 95, rows, n)] + [
        weights_of(lib, "q4_0", 96 + i, n_ff, rows) for i in range(2)
    ]
    mats.append(weights_of(lib, "q4_0", 98, rows, n_ff))  # the down
    weights = [(t, raw) for t, raw, _ in mats]
    rng = np.random.default_rng(97)
    wn = rng.uniform(0.5, 1.5, size=rows).astype(np.float32)
    xs = [rng.normal(size=(k, n)).astype(np.float32) for _ in range(3)]
    rs = [rng.normal(size=(k, rows)).astype(np.float32) for _ in range(3)]

    def run(apart, feeds=3, repack=kernels):
        f8, quantized = kernels.f8, kernels.quantized
        out = residual_norm_products(
            lib, device, weights, wn, xs[:feeds], rs[:feeds], apart, repack
        )
        return out, (kernels.f8 - f8, kernels.quantized - quantized)

    _, (f8, quantized) = run(False, 1)
    assert quantized == 3  # the output product's input, the norm's records, the GLU's halves
    if on_h200(lib, device):
        assert f8 == 1, "the stack on gemm_f8"
    (one, _), (apart, _) = run(False), run(True)
    kernels.set(False)
    try:
        theirs, _ = run(False, repack=None)
    finally:
        kernels.set(True)
    total = xs[0].astype(np.float64) @ mats[0][2].T + rs[0]
    normed = total / np.sqrt((total**2).mean(axis=1, keepdims=True) + EPS) * wn
    g, u = (normed @ mats[1 + i][2].T for i in range(2))
    exact = (g / (1 + np.exp(-g)) * u) @ mats[3][2].T
    for j in range(3):
        for i in (1, 2):
            np.testing.assert_array_equal(one[j][i], apart[j][i], err_msg=f"input {j}, {i}")
        assert not np.array_equal(one[j][0], one[(j + 1) % 3][0])  # new inputs, new results
    bound = 2 * float(rel_err(theirs[0][0], exact).max())
    assert rel_err(one[0][0], exact).max() <= bound


HEADS = 4  # heads of 128 channels that the conv tests l2-norm, as qwen35 norms q and k
L2_EPS = 1e-6 / 128


def conv_steps(lib, device, w, states, news, keep_x=True, fresh=None):
    """qwen35's conv step as its graph writes it (models/qwen35.py ``_conv`` and ``_l2_norm``):
    the saved K - 1 columns of each of N sequences (``states`` [N * C, K - 1]) joined with t new
    ones (``news`` [N * t, C], a token's channels a row), the new tail copied over the saved
    columns, the conv with the taps ``w`` [C, K], its SiLU, and the l2 norm of the SiLU's first
    HEADS heads of 128 channels; computed once per pair of ``states`` and ``news``. Returns,
    per pair, [the state after, the SiLU [N * t, C], the normed heads [N * t, HEADS * 128], and
    with ``keep_x`` the joined columns [N * C, K - 1 + t]] (``computed``; without, nothing reads
    them after the conv, as in a decode). With ``fresh`` (a list), the new columns are a copy
    made in the graph (a CONT, as a product's result would be), whose memory the allocator may
    give the conv once the concat has read it; ``fresh`` then gets whether it did."""
    C, K = w.shape
    K1, N, t = K - 1, states[0].shape[0] // C, news[0].shape[0] // (states[0].shape[0] // C)
    made = []

    def build(c, ts, ins):
        state, new = ins
        if fresh is not None:
            new = lib.ggml_cont(c, new)
            made.append(new)
        outs = conv_nodes(lib, c, ts[0], state, new, (C, K, N, t), keep_x)
        made.append(outs[1].view_src)  # the SiLU's reshape: the SiLU
        return outs

    def allocated():
        if fresh is not None:
            node = made[1]
            ops = [node.src[0]] if node.src[0] != ffi.NULL else []  # the SiLU's conv
            at = int(ffi.cast("uintptr_t", made[0].data))
            fresh.append(any(int(ffi.cast("uintptr_t", u.data)) == at for u in [node, *ops]))

    consts = [(GGML_TYPE_F32, K, C, np.ascontiguousarray(w, dtype=np.float32))]
    inputs = [(K1, C * N), (C, t * N)]
    feeds = list(zip(states, news, strict=True))
    return computed(lib, device, consts, inputs, build, feeds, allocated=allocated)


def conv_nodes(lib, c, w, state, new, shape, keep_x):
    """``conv_steps``' graph nodes (``shape`` (C, K, N, t)): its outputs."""
    C, K, N, t = shape
    K1 = K - 1
    saved = lib.ggml_view_3d(c, state, K1, C, N, state.nb[1], state.nb[1] * C, 0)
    steps = lib.ggml_permute(c, lib.ggml_reshape_3d(c, new, C, t, N), 1, 0, 2, 3)
    x = lib.ggml_concat(c, saved, steps, 0)
    tail = lib.ggml_view_3d(c, x, K1, C, N, x.nb[1], x.nb[2], t * 4)
    after = lib.ggml_cpy(c, tail, lib.ggml_view_1d(c, state, K1 * C * N, 0))
    act = lib.ggml_silu(c, lib.ggml_ssm_conv(c, x, w))
    act2 = lib.ggml_reshape_2d(c, act, C, t * N)
    flat_x = lib.ggml_reshape_2d(c, x, K1 + t, C * N)
    row = act2.nb[1]
    heads = lib.ggml_view_4d(c, act2, 128, HEADS, t, N, 4 * 128, row, row * t, 0)
    l2 = lib.ggml_scale(c, lib.ggml_rms_norm(c, heads, L2_EPS), 1 / np.sqrt(128))
    for out in (act, l2, x) if keep_x else (act, l2):  # (read back: memory not reused)
        lib.ggml_set_output(out)
    outs = [after, act2, lib.ggml_reshape_2d(c, l2, HEADS * 128, t * N)]
    return outs + [flat_x] if keep_x else outs


def conv_exact(w, state, new, t):
    """The exact math of ``conv_steps`` for one feed: the state after, the SiLU [N * t, C] and
    the normed heads, in f64."""
    C, K = w.shape
    N = state.shape[0] // C
    joined = np.concatenate(
        [state.reshape(N, C, K - 1), new.reshape(N, t, C).transpose(0, 2, 1)], axis=2
    ).astype(np.float64)  # [N, C, K - 1 + t]
    windows = np.stack([joined[:, :, i : i + K] for i in range(t)], axis=1)  # [N, t, C, K]
    conv = (windows * w.astype(np.float64)).sum(axis=3)
    exact = (conv / (1 + np.exp(-conv))).reshape(N * t, C)
    heads = exact[:, : HEADS * 128].reshape(N * t, HEADS, 128)
    rms = np.sqrt((heads**2).mean(axis=2, keepdims=True) + L2_EPS)
    normed = (heads / rms / np.sqrt(128)).reshape(N * t, HEADS * 128)
    return joined, exact, normed


@pytest.mark.parametrize(
    ("t", "C", "keep_x"),
    [(1, 1152, False), (1, 1152, True), (16, 1152, True), (17, 1152, True), (3, 1000, True)],
)
def test_gpu_conv_step_is_one_kernel(t, C, keep_x, cuda):
    """qwen35's conv step of 1 token (a decode), 3 or 16 (a verify) for 2 sequences, with the l2
    norm of its first heads, is one kernel of ours (counted once per compute; the CUDA graph
    then replays it): the new state and the joined columns exact, the SiLU of the conv and the
    normed heads within float rounding of the exact math and of ggml's; 17 tokens are ggml's.
    1,000 channels leave a CTA of 128 partly idle (ggml's conv takes multiples of 128 only: no
    comparison with it there). Joined columns that nothing reads after the conv (a decode's)
    are not written: the rest is the same."""
    lib, device, kernels = cuda
    K, N = 4, 2
    rng = np.random.default_rng(40 + t)
    w = rng.normal(size=(C, K)).astype(np.float32)
    states = [rng.normal(size=(N * C, K - 1)).astype(np.float32) for _ in range(3)]
    news = [rng.normal(size=(N * t, C)).astype(np.float32) for _ in range(3)]
    ops = kernels.ops
    conv_steps(lib, device, w, states[:1], news[:1], keep_x)
    assert kernels.ops - ops == (1 if t <= 16 else 0)

    def run():
        return conv_steps(lib, device, w, states, news, keep_x)

    ours, theirs = ours_and_theirs(kernels, run) if C % 128 == 0 else (run(), None)
    for j, (state, new) in enumerate(zip(states, news, strict=True)):
        joined = assert_conv_step(w, state, new, t, ours[j], theirs and theirs[j])
        if keep_x:
            joined_2d = joined.reshape(N * C, K - 1 + t).astype(np.float32)
            np.testing.assert_array_equal(ours[j][3], joined_2d)
            if theirs is not None:
                np.testing.assert_array_equal(ours[j][3], theirs[j][3])


@pytest.mark.parametrize("t", [1, 16])
def test_gpu_conv_step_keeps_the_new_tail_where_the_conv_lies_over_the_new_columns(t, cuda):
    """qwen35's conv step whose new columns are a result of the graph (as a lone qkv product's
    are, where a layer's products cannot be stacked: types), so that the allocator gives the
    conv or its SiLU those bytes once the concat has read them: the state after is still the
    new columns themselves, not the conv written over them (one group of tokens: the tail from
    the kernel's shared copy); every result as the plain test's bounds say."""
    lib, device, kernels = cuda
    C, K, N = 1152, 4, 2
    rng = np.random.default_rng(70 + t)
    w = rng.normal(size=(C, K)).astype(np.float32)
    states = [rng.normal(size=(N * C, K - 1)).astype(np.float32) for _ in range(2)]
    news = [rng.normal(size=(N * t, C)).astype(np.float32) for _ in range(2)]
    fresh = []
    ours = conv_steps(lib, device, w, states, news, keep_x=False, fresh=fresh)
    assert fresh == [True], "the conv or its SiLU did not take the new columns' bytes"
    for j, (state, new) in enumerate(zip(states, news, strict=True)):
        assert_conv_step(w, state, new, t, ours[j], None)


def assert_conv_step(w, state, new, t, ours, theirs):
    """``conv_steps``' first three results of one feed (``ours``): the state after exact, the
    SiLU and the normed heads within float rounding of the exact math and, where given, of
    ggml's (``theirs``). Returns the joined columns, exact."""
    joined, exact, normed = conv_exact(w, state, new, t)
    [after], act, l2 = ours[:3]
    np.testing.assert_array_equal(after, joined[:, :, t:].reshape(-1).astype(np.float32))
    for got, want in ((act, exact), (l2, normed)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if theirs:
        np.testing.assert_array_equal(after, theirs[0][0])
        for got, ref in ((act, theirs[1]), (l2, theirs[2])):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    return joined


def delta_gates(lib, device, bias, a, alphas, betas, heads):
    """qwen35's DeltaNet gates as its graph writes them (models/qwen35.py ``_delta_net``):
    softplus(alpha + bias) * a and sigmoid(beta), bias and a [heads], alpha and beta [T, heads]
    each; or, where ``betas`` is None, both parts of one wider product [T, more than 2 heads]
    (the stacked DeltaNet inputs'): alpha its first ``heads`` columns (a view), beta the next
    ``heads`` (a view copied out, a CONT). Per feed, [the decay, the sigmoid] (``computed``)."""
    T, wide = alphas[0].shape
    consts = gate_consts(bias, a)

    def build(c, ts, ins):
        return gate_nodes(lib, c, *ts, ins[0], ins[1] if betas else None, heads)

    if betas is None:
        return computed(lib, device, consts, [(wide, T)], build, [(x,) for x in alphas])
    feeds = list(zip(alphas, betas, strict=True))
    return computed(lib, device, consts, [(wide, T), (heads, T)], build, feeds)


def gate_consts(bias, a):
    """``delta_gates``' constants: bias and a, [heads] each."""
    return [(GGML_TYPE_F32, len(v), 1, np.asarray(v, dtype=np.float32)) for v in (bias, a)]


def gate_nodes(lib, c, bias, a, alpha, beta, heads):
    """``delta_gates``' graph nodes (beta None: the columns after alpha's, copied out): [the
    decay, the sigmoid]."""
    T = alpha.ne[1]
    if beta is None:
        nb1, es = alpha.nb[1], lib.ggml_element_size(alpha)
        beta = lib.ggml_cont(c, lib.ggml_view_2d(c, alpha, heads, T, nb1, es * heads))
    alpha = lib.ggml_view_2d(c, alpha, heads, T, alpha.nb[1], 0)
    decay = lib.ggml_mul(c, lib.ggml_softplus(c, lib.ggml_add(c, alpha, bias)), a)
    return [decay, lib.ggml_sigmoid(c, beta)]


def gates_exact(bias, a, alpha, beta):
    """The exact math of ``delta_gates`` for one feed: [the decay, the sigmoid]."""
    s = alpha.astype(np.float64) + bias.astype(np.float32)
    soft = np.where(s > 20, s, np.log1p(np.exp(np.minimum(s, 20))))
    return [soft * a.astype(np.float32), 1 / (1 + np.exp(-beta.astype(np.float64)))]


@pytest.mark.parametrize(("T", "more"), [(1, 0), (16, 0), (16, 56)])
def test_gpu_delta_gates_are_one_kernel(T, more, cuda):
    """qwen35's DeltaNet gates of a decode (1 token) or a verify (16; alpha a strided view of a
    wider product too, beta the next columns' copy, as parts of the stacked DeltaNet inputs):
    the decay (ADD of the dt bias, SOFTPLUS, MUL by A) and beta's SIGMOID are one kernel of ours
    (counted once per compute; the CUDA graph then replays it) that reads beta where its copy
    would have (the CONT not computed: counted as a copy made), each result no further from the
    exact math than twice ggml's own error, past softplus' linear branch (inputs above 20)."""
    lib, device, kernels = cuda
    heads = 48
    rng = np.random.default_rng(70 + T + more)
    bias, a = rng.normal(size=heads), -np.exp(rng.normal(size=heads))
    alphas = [8.0 * rng.normal(size=(T, heads + more)).astype(np.float32) for _ in range(3)]
    alphas[1][0, :4] = 30.0
    betas = (
        None if more else [3.0 * rng.normal(size=(T, heads)).astype(np.float32) for _ in range(3)]
    )
    ops, copies = kernels.ops, kernels.copies
    delta_gates(lib, device, bias, a, alphas[:1], betas and betas[:1], heads)
    assert (kernels.ops - ops, kernels.copies - copies) == (1, 1 if more else 0)
    ours, theirs = ours_and_theirs(
        kernels, lambda: delta_gates(lib, device, bias, a, alphas, betas, heads)
    )
    for j, alpha in enumerate(alphas):
        beta = alpha[:, heads : 2 * heads] if more else betas[j]
        assert_gates(ours[j], theirs[j], gates_exact(bias, a, alpha[:, :heads], beta))


def assert_gates(ours, theirs, exact):
    """The gates' [decay, sigmoid] (``ours``) no further from the exact math than twice ggml's
    (``theirs``) error (its formulas: log(1 + exp(s)) loses about 1e-3 of a value near zero)."""
    for got, ref, want in zip(ours, theirs, exact, strict=True):
        bound = 2 * float(np.abs(ref - want).max())
        assert float(np.abs(got - want).max()) <= bound


@pytest.mark.parametrize("T", [1, 16])
def test_gpu_conv_step_and_gates_are_one_kernel(T, cuda):
    """qwen35's conv step with the DeltaNet gates after it (as its graph orders them: a decode's
    and a verify's, beta copied out of the stacked product) is one kernel of ours: two ops, one
    of them joined to the other's kernel, beta's copy made; the conv's results within float
    rounding of the exact math and of ggml's, the gates no further from the exact math than
    twice ggml's own error (the bounds of the two ops' own tests)."""
    lib, device, kernels = cuda
    C, K, N, heads, more = 1152, 4, 1, 48, 56
    rng = np.random.default_rng(90 + T)
    w = rng.normal(size=(C, K)).astype(np.float32)
    states = [rng.normal(size=(N * C, K - 1)).astype(np.float32) for _ in range(3)]
    news = [rng.normal(size=(N * T, C)).astype(np.float32) for _ in range(3)]
    bias, a = rng.normal(size=heads), -np.exp(rng.normal(size=heads))
    alphas = [8.0 * rng.normal(size=(T, heads + more)).astype(np.float32) for _ in range(3)]

    def build(c, ts, ins):
        state, new, alpha = ins
        conv = conv_nodes(lib, c, ts[0], state, new, (C, K, N, T), keep_x=False)
        return conv + gate_nodes(lib, c, ts[1], ts[2], alpha, None, heads)

    consts = [(GGML_TYPE_F32, K, C, w), *gate_consts(bias, a)]
    inputs = [(K - 1, C * N), (C, T * N), (heads + more, T)]
    feeds = list(zip(states, news, alphas, strict=True))

    def run(feeds):
        return computed(lib, device, consts, inputs, build, feeds, tensors=64)

    ops, joined, copies = kernels.ops, kernels.joined, kernels.copies
    run(feeds[:1])
    assert (kernels.ops - ops, kernels.joined - joined, kernels.copies - copies) == (2, 1, 1)
    ours, theirs = ours_and_theirs(kernels, lambda: run(feeds))
    for j, (state, new, alpha) in enumerate(feeds):
        assert_conv_step(w, state, new, T, ours[j], theirs[j])
        exact = gates_exact(bias, a, alpha[:, :heads], alpha[:, heads : 2 * heads])
        assert_gates(ours[j][3:], theirs[j][3:], exact)


ROPE = {"hd": 256, "dims": 64, "sections": (11, 11, 10, 0), "base": 1e7, "ctx": 64}


def rope_norm_weights() -> np.ndarray:
    """``heads_roped``'s q and k norm weights [2, hd]."""
    return np.random.default_rng(5).uniform(0.5, 1.5, size=(2, ROPE["hd"])).astype(np.float32)


def heads_roped(lib, device, xs, positions, rows, nq=6, nk=2):
    """qwen35's attention q and k heads as its graph writes them (``_attention``): from a wider
    product [T, 2 hd nq + hd nk] (each q head beside its gate, then k's heads) q and k normed
    times their weights and roped (IMROPE, ROPE's dims and sections; ``positions`` [4, T]: the
    sections' positions), k's heads written as one f16 row of a cache of ROPE's ctx rows at
    ``rows`` [T]. Returns, per entry of ``xs``, [q roped [T, hd nq], k roped [T, hd nk], the
    cache as f32 [ctx, hd nk] (its other rows 0.5)] (``computed``)."""
    hd, ctx_rows = ROPE["hd"], ROPE["ctx"]
    T = xs[0].shape[0]
    width = 2 * hd * nq + hd * nk
    wq, wk = rope_norm_weights()
    consts = [
        (GGML_TYPE_F32, hd, 1, wq),
        (GGML_TYPE_F32, hd, 1, wk),
        (GGML_TYPE_I32, 4 * T, 1, positions.astype(np.int32).reshape(-1)),
        (GGML_TYPE_I64, T, 1, rows.astype(np.int64)),
        (GGML_TYPE_F16, hd * nk, ctx_rows, np.full((ctx_rows, hd * nk), 0.5, dtype=np.float16)),
    ]

    def build(c, ts, ins):
        wq_t, wk_t, pos, idx, cache = ts
        (y,) = ins
        q = lib.ggml_view_3d(c, y, hd, nq, T, 4 * 2 * hd, y.nb[1], 0)
        k = lib.ggml_view_3d(c, y, hd, nk, T, 4 * hd, y.nb[1], 4 * 2 * hd * nq)
        sections = ffi.new("int[4]", list(ROPE["sections"]))
        out = []
        for t, w in ((q, wq_t), (k, wk_t)):
            normed = lib.ggml_mul(c, lib.ggml_rms_norm(c, t, 1e-6), w)
            args = (ROPE["ctx"], ROPE["base"], 1.0, 0.0, 1.0, 32.0, 1.0)
            out.append(
                lib.ggml_rope_multi(c, normed, pos, ffi.NULL, ROPE["dims"], sections, 40, *args)
            )
        lib.ggml_set_output(out[0])
        flat = lib.ggml_view_2d(c, out[1], hd * nk, T, out[1].nb[2], 0)
        written = lib.ggml_set_rows(c, cache, flat, idx)
        read = lib.ggml_cpy(c, written, lib.ggml_new_tensor_2d(c, GGML_TYPE_F32, hd * nk, ctx_rows))
        lib.ggml_set_output(out[1])
        return [
            lib.ggml_reshape_2d(c, out[0], hd * nq, T),
            lib.ggml_reshape_2d(c, out[1], hd * nk, T),
            read,
        ]

    feeds = [(x,) for x in xs]
    return computed(lib, device, consts, [(width, T)], build, feeds, tensors=64)


def roped_exact(x, w, positions):
    """x [T, heads, hd] normed times w and roped in float64 (IMROPE, ROPE's dims and
    sections: pair k of the first dims channels, k and k + dims / 2, turned by pos_s k-th
    frequency, s the section IMROPE gives k)."""
    dims, sec = ROPE["dims"], ROPE["sections"]
    x = x.astype(np.float64)
    y = x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + 1e-6) * w
    out = y.copy()
    for k in range(dims // 2):
        s = k % sum(sec)
        p = (
            1
            if s % 3 == 1 and s < 3 * sec[1]
            else 2
            if s % 3 == 2 and s < 3 * sec[2]
            else 0
            if s % 3 == 0 and s < 3 * sec[0]
            else 3
        )
        theta = positions[p][:, None] * ROPE["base"] ** (-2.0 * k / dims)
        a, b = y[:, :, k], y[:, :, k + dims // 2]
        out[:, :, k] = a * np.cos(theta) - b * np.sin(theta)
        out[:, :, k + dims // 2] = a * np.sin(theta) + b * np.cos(theta)
    return out


@pytest.mark.parametrize("T", [1, 16])
def test_gpu_head_norm_and_rope_are_one_kernel(T, cuda):
    """qwen35's q and k heads (a decode's and a verify's): each head's RMS norm, its weight and
    its IMROPE rope are one kernel of ours, k's cache write in it too (two ops, three joined);
    the roped heads no further from the exact math than twice ggml's own error, and the cache
    rows ggml's f16 of them, the rows not written left as they were."""
    lib, device, kernels = cuda
    hd, nq, nk = ROPE["hd"], 6, 2
    rng = np.random.default_rng(40 + T)
    xs = [2.0 * rng.normal(size=(T, 2 * hd * nq + hd * nk)).astype(np.float32) for _ in range(3)]
    base = np.arange(T) + 37
    positions = np.stack([base, base + 3, base + 7, np.zeros(T, dtype=int)])
    rows = np.arange(T) * 3 + 2
    ops, joined = kernels.ops, kernels.joined
    heads_roped(lib, device, xs[:1], positions, rows)
    assert (kernels.ops - ops, kernels.joined - joined) == (2, 3)
    ours, theirs = ours_and_theirs(kernels, lambda: heads_roped(lib, device, xs, positions, rows))
    w = rope_norm_weights()
    for j, x in enumerate(xs):
        q = x[:, : 2 * hd * nq].reshape(T, nq, 2, hd)[:, :, 0]
        k = x[:, 2 * hd * nq :].reshape(T, nk, hd)
        for got, ref, want in zip(
            ours[j][:2],
            theirs[j][:2],
            [roped_exact(q, w[0], positions), roped_exact(k, w[1], positions)],
            strict=True,
        ):
            want = want.reshape(T, -1)
            bound = 2 * float(rel_err(ref, want).max())
            assert float(rel_err(got, want).max()) <= bound, f"input {j}"
        np.testing.assert_array_equal(
            ours[j][2][rows], ours[j][1].astype(np.float16).astype(np.float32)
        )
        np.testing.assert_array_equal(ours[j][2], theirs[j][2])


def recurrence(lib, c, shape, qk, v, g, beta, state, own_state=True, attention=True):
    """Graph nodes of one layer's DeltaNet recurrence as qwen35 writes it (``delta_nets``' inputs,
    ``shape`` (T, N, Hk, H)): the op from the state s0 (the state input itself, or without
    ``own_state`` a copy of it, kept as an output) and the copy of its new state over the state
    input. Returns (the op's result, [its attention (an output; without ``attention`` neither
    kept nor returned, as in a rollback), the state's copy], s0)."""
    T, N, Hk, H = shape
    S = 128
    qk4 = lib.ggml_reshape_4d(c, qk, S, 2 * Hk, T, N)
    nb = (qk4.nb[1], qk4.nb[2], qk4.nb[3])
    q = lib.ggml_view_4d(c, qk4, S, Hk, T, N, *nb, 0)
    k = lib.ggml_view_4d(c, qk4, S, Hk, T, N, *nb, qk4.nb[1] * Hk)
    v4 = lib.ggml_reshape_4d(c, v, S, H, T, N)
    g4, beta4 = (lib.ggml_reshape_4d(c, t, 1, H, T, N) for t in (g, beta))
    mine = lib.ggml_view_1d(c, state, S * S * H * N, 0)
    s0 = lib.ggml_reshape_4d(c, mine, S, S, H, N)
    if not own_state:
        s0 = lib.ggml_dup(c, s0)
        lib.ggml_set_output(s0)
    res = lib.ggml_gated_delta_net(c, q, k, v4, g4, beta4, s0, 1)
    new = lib.ggml_view_1d(c, res, S * S * H * N, 4 * S * H * T * N)
    copy = lib.ggml_cpy(c, new, mine)
    if not attention:
        return res, [copy], s0
    attn = lib.ggml_view_2d(c, res, S * H, T * N, res.nb[1], 0)
    lib.ggml_set_output(attn)
    return res, [attn, copy], s0


def recurrence_inputs(shape) -> list[tuple[int, int]]:
    """(ne0, ne1) of ``recurrence``'s f32 inputs qk, v, g, beta and the state."""
    T, N, Hk, H = shape
    S = 128
    return [(2 * Hk * S, T * N), (H * S, T * N), (H, T * N), (H, T * N), (S * S * H, N)]


def delta_nets(lib, device, shape, feeds, own_state=True, keep=False, tail=False):
    """qwen35's DeltaNet recurrence as its graphs write it (models/qwen35.py ``_delta_net``,
    models/state.py ``rollback``): ``ggml_gated_delta_net`` of T tokens of N sequences (q's and
    k's Hk heads of 128 side by side, v's H, a scalar gate and beta a head and token) from the
    state s0, then the copy of its new state into the sequences' state: s0 itself (a decode,
    ``own_state``) or a copy of it (a verify); with ``keep`` the graph keeps the op's own result
    too. ``shape``: (T, N, Hk, H); ``feeds``: (qk [T N, 2 Hk 128], v [T N, H 128], g and beta
    [T N, H], s0 [N, H 128 128]) each. Returns, per feed, [the attention [T N, H 128], the state
    after [1, N H 128 128], with ``tail`` a copy after it (as a rollback's of the conv's tail:
    values 2..4 of each row of a sixth feed [40, 6], dense [1, 120]), without ``own_state`` the
    copy of the state before [N, H 128 128], with ``keep`` the op's state [N, H 128 128]]
    (``computed``)."""
    T, N, Hk, H = shape
    S = 128

    def build(c, ts, ins):
        res, outs, s0 = recurrence(lib, c, shape, *ins[:5], own_state=own_state)
        kept = [] if own_state else [lib.ggml_reshape_2d(c, s0, S * S * H, N)]
        if tail:
            rows = ins[5]
            cols = lib.ggml_view_2d(c, rows, 3, 40, rows.nb[1], 2 * rows.nb[0])
            outs.append(lib.ggml_cpy(c, cols, lib.ggml_new_tensor_1d(c, GGML_TYPE_F32, 120)))
        outs += kept
        if keep:
            lib.ggml_set_output(res)
            outs.append(lib.ggml_view_2d(c, res, S * S * H, N, 4 * S * S * H, 4 * S * H * T * N))
        return outs

    inputs = recurrence_inputs(shape) + [(6, 40)] * tail
    return computed(lib, device, [], inputs, build, feeds)


def delta_net_exact(shape, feed):
    """The recurrence in float64, ggml's layout (a head's state [column][row]): per token
    M <- e^g M, delta = (v - M k) beta, M <- M + delta k^T, out = M q / sqrt(128)."""
    T, N, Hk, H = shape
    S = 128
    qk, v, g, beta, s0 = (np.asarray(a, dtype=np.float64) for a in feed)
    qk = qk.reshape(N, T, 2, Hk, S)
    v, g, beta = v.reshape(N, T, H, S), g.reshape(N, T, H), beta.reshape(N, T, H)
    m = s0.reshape(N, H, S, S).copy()
    out = np.zeros((N, T, H, S))
    for n in range(N):
        for t in range(T):
            for h in range(H):
                q, k = qk[n, t, 0, h % Hk], qk[n, t, 1, h % Hk]
                m[n, h] *= np.exp(g[n, t, h])
                delta = (v[n, t, h] - m[n, h] @ k) * beta[n, t, h]
                m[n, h] += np.outer(delta, k)
                out[n, t, h] = m[n, h] @ q / np.sqrt(S)
    return out.reshape(N * T, H * S), m.reshape(1, -1)


def delta_net_feeds(shape, seed: int, count: int = 3) -> list[tuple]:
    T, N, Hk, H = shape
    rng = np.random.default_rng(seed)

    def unit(rows, heads):  # l2-normed heads of 128, as qwen35's q and k are
        x = rng.normal(size=(rows, heads, 128))
        return (x / np.linalg.norm(x, axis=2, keepdims=True)).reshape(rows, heads * 128)

    return [
        tuple(
            a.astype(np.float32)
            for a in (
                unit(T * N, 2 * Hk),
                rng.normal(size=(T * N, H * 128)),
                -0.5 * np.abs(rng.normal(size=(T * N, H))),  # the log of the decay
                1 / (1 + np.exp(-rng.normal(size=(T * N, H)))),
                0.1 * rng.normal(size=(N, H * 128 * 128)),
            )
        )
        for _ in range(count)
    ]


@pytest.mark.parametrize(
    ("T", "N", "own_state", "keep", "tail"),
    [
        (1, 2, True, False, False),
        (16, 1, False, False, True),
        (16, 1, True, True, False),
        (40, 2, True, False, False),
    ],
)
def test_gpu_delta_net_is_one_kernel(T, N, own_state, keep, tail, cuda):
    """qwen35's DeltaNet recurrence of a decode (1 token a sequence, 2 sequences), a verify (16
    tokens, its state copied first as a verify keeps it for a rollback) or a prompt chunk (40
    tokens: tiles of 8 and a partial one), with the copy of its new state, is one kernel of ours
    (counted once per compute; the CUDA graph then replays it), which also makes the verify's
    copy of the state before it (its DUP not computed: counted as a copy made) and a copy that
    comes after the state's (a rollback's of the conv's tail, counted alike): the attention and
    the state after no further from the exact math than twice ggml's own kernel is, the copies
    bit for bit, and the op's own state, where the graph keeps it, the same state."""
    lib, device, kernels = cuda
    shape = (T, N, 2, 4)  # q's and k's 2 heads, v's 4: tiled as qwen35's (head h reads h % 2)
    feeds = delta_net_feeds(shape, 80 + T)
    if tail:
        rng = np.random.default_rng(85)
        feeds = [(*f, rng.normal(size=(40, 6)).astype(np.float32)) for f in feeds]
    ops, copies = kernels.ops, kernels.copies
    delta_nets(lib, device, shape, feeds[:1], own_state, keep, tail)
    assert (kernels.ops - ops, kernels.copies - copies) == (1, (not own_state) + tail)
    ours, theirs = ours_and_theirs(
        kernels, lambda: delta_nets(lib, device, shape, feeds, own_state, keep, tail)
    )
    for j, feed in enumerate(feeds):
        exact = delta_net_exact(shape, feed[:5])
        for got, ref, want in zip(ours[j][:2], theirs[j][:2], exact, strict=True):
            bound = 2 * float(rel_err(ref, want).max())
            assert float(rel_err(got, want).max()) <= bound
        if tail:
            np.testing.assert_array_equal(ours[j][2], feed[5][:, 2:5].reshape(1, -1))
        if not own_state:
            np.testing.assert_array_equal(ours[j][2 + tail], feed[4])
        if keep:
            np.testing.assert_array_equal(ours[j][-1].reshape(1, -1), ours[j][1])


def two_layers(lib, device, shape, feeds, kind):
    """Two layers' DeltaNet recurrences in one graph (a rollback's: each from its own state,
    each new state copied over it), ``feeds`` pairs of ``delta_nets``' five. ``kind``: "apart"
    (each attention kept), "chained" (the second layer's v is the first's attention: a graph
    whose second recurrence needs the first) or "states" (only the states copied, as a model's
    rollback: neither result is read past its copy, and the allocator lays the second over the
    first). Returns, per feed, [attention, state after] of each layer, or the states only
    (``computed``)."""
    attention = kind != "states"

    def build(c, ts, ins):
        _, first, _ = recurrence(lib, c, shape, *ins[:5], attention=attention)
        second = list(ins[5:])
        if kind == "chained":
            second[1] = first[0]  # (a view of the first's result: only recurrences and copies)
        return first + recurrence(lib, c, shape, *second, attention=attention)[1]

    inputs = recurrence_inputs(shape) * 2
    return computed(lib, device, [], inputs, build, [a + b for a, b in feeds], tensors=64)


@pytest.mark.parametrize("kind", ["apart", "chained", "states"])
def test_gpu_rollback_recurrences_need_not_wait(kind, cuda):
    """A rollback's graph of DeltaNet recurrences (two layers, 16 tokens) whose kernels read and
    write apart from each other's bytes (the results that only their copies read not written at
    all, though laid over each other): captured as a CUDA graph (ggml-cuda's second compute),
    ours need not wait for each other (lucepy-deltanet.cu's recurrences_apart) and are one launch,
    one op joined to the other's kernel; where the second reads the first's attention, it waits,
    a launch of its own. Either way, over replays of the CUDA graph, each layer's attention and
    state no further from the exact math than twice ggml's own kernels are."""
    lib, device, kernels = cuda
    shape = (16, 1, 2, 4)
    feeds = list(zip(delta_net_feeds(shape, 96), delta_net_feeds(shape, 97), strict=True))
    ops, joined = kernels.ops, kernels.joined
    two_layers(lib, device, shape, feeds[:2], kind)
    assert (kernels.ops - ops, kernels.joined - joined) == (4, int(kind != "chained"))
    ours, theirs = ours_and_theirs(kernels, lambda: two_layers(lib, device, shape, feeds, kind))
    for j, (a, b) in enumerate(feeds):
        first = delta_net_exact(shape, a)
        if kind == "chained":
            b = (b[0], first[0], *b[2:])
        exact = first + delta_net_exact(shape, b)
        if kind == "states":
            exact = exact[1::2]
        assert len(ours[j]) == len(exact)
        for got, ref, want in zip(ours[j], theirs[j], exact, strict=True):
            bound = 2 * float(rel_err(ref, want).max())
            assert float(rel_err(got, want).max()) <= bound, f"input {j}"


def test_gpu_delta_net_keeps_ggmls_arithmetic(cuda):
    """Ours computes each token as ggml-cuda's kernel does (the same sums in the same order), so
    a 16-token verify gives ggml's attention and state bit for bit."""
    lib, device, kernels = cuda
    shape = (16, 1, 2, 4)
    feeds = delta_net_feeds(shape, 90)
    ours, theirs = ours_and_theirs(kernels, lambda: delta_nets(lib, device, shape, feeds))
    for j in range(len(feeds)):
        for got, ref in zip(ours[j], theirs[j], strict=True):
            np.testing.assert_array_equal(got, ref)


def attention_of(lib, device, shape, k, v, mask, qs, scale):
    """ggml's FLASH_ATTN_EXT as lucepy's builder writes it (``shape`` (D, nh, nkv, T, n_kv)): q
    [D * nh, T] f32 permuted to [D, T, nh], over the first n_kv rows of an f16 cache ``k``, ``v``
    ([rows, D * nkv]) viewed and permuted to [D, n_kv, nkv], under ``mask`` ([T, n_kv] f16), at
    F32 precision; one graph, once per entry of ``qs``. Returns each result as [T, D * nh]."""
    D, nh, nkv, T, n_kv = shape
    rows = k.shape[0]
    consts = [
        (GGML_TYPE_F16, D * nkv, rows, k),
        (GGML_TYPE_F16, D * nkv, rows, v),
        (GGML_TYPE_F16, n_kv, T, mask),
    ]

    def build(c, ts, ins):
        kc, vc, m = ts
        q = lib.ggml_permute(c, lib.ggml_reshape_3d(c, ins[0], D, nh, T), 0, 2, 1, 3)
        kv = [
            lib.ggml_permute(c, lib.ggml_view_3d(c, t, D, nkv, n_kv, 2 * D, t.nb[1], 0), 0, 2, 1, 3)
            for t in (kc, vc)
        ]
        out = lib.ggml_flash_attn_ext(c, q, kv[0], kv[1], m, scale, 0.0, 0.0)
        lib.ggml_flash_attn_ext_set_prec(out, lib.GGML_PREC_F32)
        return [lib.ggml_reshape_2d(c, out, D * nh, T)]

    feeds = [(q,) for q in qs]
    return [out for [out] in computed(lib, device, consts, [(D * nh, T)], build, feeds)]


def attention_exact(q, k, v, mask, shape, scale):
    """The attention of ``attention_of`` in float64, on the cache's f16 values."""
    D, nh, nkv, T, n_kv = shape
    q = q.astype(np.float64).reshape(T, nh, D)
    k = k[:n_kv].astype(np.float64).reshape(n_kv, nkv, D)
    v = v[:n_kv].astype(np.float64).reshape(n_kv, nkv, D)
    ratio = nh // nkv
    out = np.zeros((T, nh, D))
    for h in range(nh):
        s = scale * q[:, h] @ k[:, h // ratio].T + mask.astype(np.float64)  # [T, n_kv]
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h // ratio]
    return out.reshape(T, nh * D)


@pytest.mark.parametrize(
    "shape",
    [(256, 24, 4, 16, 256), (256, 24, 4, 1, 256), (256, 24, 4, 5, 298), (128, 8, 2, 16, 64),
     (256, 24, 4, 16, 1024), (256, 24, 4, 16, 32)],
)  # fmt: skip
def test_gpu_attention_of_few_queries_matches_the_exact_math(shape, cuda):
    """The attention of 1-16 queries over an f16 cache (a decode's, a verify's: qwen35's heads of
    256, 6 query heads a KV head; heads of 128) is ours: causal rows whose unseen keys (-inf in
    the mask) include whole chunks, a key count that is not a multiple of the kernel's chunk, a
    long cache (several chunks a CTA), one chunk (no second kernel to join the CTAs'); no further
    from the exact math than twice ggml's own kernel's error, and a new q gives a new result (the
    CUDA graph replayed)."""
    lib, device, kernels = cuda
    D, nh, nkv, T, n_kv = shape
    rng = np.random.default_rng(D + T + n_kv)
    rows = n_kv + 16  # (cache rows past the view: never read)
    k, v = (rng.normal(size=(rows, D * nkv)).astype(np.float16) for _ in range(2))
    seen = max(0, n_kv - 40)  # the sequence before the queries; keys past the last one unseen
    mask = np.full((T, n_kv), -np.inf, dtype=np.float32)
    for t in range(T):
        mask[t, : seen + t + 1] = 0.0
    mask[:, 3:70] = -np.inf  # keys 32-63 unseen: a chunk of the kernel's 32 keys whole
    mask = mask.astype(np.float16)
    qs = [2.0 * rng.normal(size=(T, D * nh)).astype(np.float32) for _ in range(3)]
    scale = 1.0 / np.sqrt(D)
    ops = kernels.ops
    attention_of(lib, device, shape, k, v, mask, qs[:1], scale)
    assert kernels.ops - ops == 1
    ours, theirs = ours_and_theirs(
        kernels, lambda: attention_of(lib, device, shape, k, v, mask, qs, scale)
    )
    for j, q in enumerate(qs):
        exact = attention_exact(q, k, v, mask, shape, scale)
        bound = 2 * float(rel_err(theirs[j], exact).max())
        assert float(rel_err(ours[j], exact).max()) <= bound, f"q {j}"
    assert not np.array_equal(ours[0], ours[1])


def argmaxes(lib, device, xs):
    """ggml's ARGMAX of each row of each of ``xs`` ([rows, n] f32), one graph (``computed``)."""
    rows, n = xs[0].shape

    def build(c, ts, ins):
        return [lib.ggml_argmax(c, ins[0])]

    return [
        out.view(np.int32)[0]
        for [out] in computed(lib, device, [], [(n, rows)], build, [(x,) for x in xs])
    ]


@pytest.mark.parametrize(("rows", "n"), [(1, 248_320), (16, 248_320), (3, 16_384)])
def test_gpu_argmax_of_long_rows(rows, n, cuda):
    """The argmax of long rows (a greedy step's logits: one row, or a verify's 16) is ours (two
    kernels of many CTAs, counted once per compute): the first column of the largest value,
    past ties, -inf and NaN, as numpy finds it; new rows give new columns (the CUDA graph
    replayed). Rows shorter than 16,384 values (a MoE router's) are ggml's."""
    lib, device, kernels = cuda
    rng = np.random.default_rng(60 + rows)
    xs = [rng.normal(size=(rows, n)).astype(np.float32) for _ in range(3)]
    for r in range(rows):  # a tie at the top (the lower column wins), -inf and NaN around
        top = xs[1][r].max() + 1.0
        a, b = sorted(rng.choice(n, size=2, replace=False))
        xs[1][r, b], xs[1][r, a] = top, top
        xs[2][r, rng.choice(n, size=8, replace=False)] = -np.inf
        xs[2][r, rng.integers(n)] = np.nan
    ops = kernels.ops
    argmaxes(lib, device, xs[:1])
    assert kernels.ops - ops == 1
    for x, got in zip(xs, argmaxes(lib, device, xs), strict=True):
        np.testing.assert_array_equal(got, np.nanargmax(x, axis=1))
    short = rng.normal(size=(4, 1000)).astype(np.float32)
    ops = kernels.ops
    [got] = argmaxes(lib, device, [short])
    assert kernels.ops == ops
    np.testing.assert_array_equal(got, short.argmax(axis=1))


def test_gpu_rows_the_kernels_do_not_take_run_on_ggmls(cuda):
    """One column of Q4_0 rows of 3 blocks (54 bytes: no 4-byte copies for gemv), 17 columns,
    and 5 columns of a product too small to give gemm a CTA per multiprocessor (ggml's vector
    kernel is faster there) fall back to ggml; 9 columns of those rows are gemm's (any 2-byte
    aligned row), a partial chunk and segment of 3 pieces."""
    lib, device, kernels = cuda
    rng = np.random.default_rng(7)
    x, x5, x9 = (rng.normal(size=(k, 96)).astype(np.float32) for k in (1, 5, 9))
    gtype, raw, exact_w = weights_of(lib, "q4_0", 8, rows=64, n=96)
    calls = kernels.calls
    [[out]] = products(lib, device, [(gtype, raw)], [x])
    x17 = np.random.default_rng(8).normal(size=(17, N)).astype(np.float32)
    gtype, raw17, exact17 = weights_of(lib, "q4_0", 9, rows=64)
    [[out17]] = products(lib, device, [(gtype, raw17)], [x17])
    [[out5]] = products(lib, device, [(gtype, raw)], [x5])
    assert kernels.calls == calls
    [[out9]] = products(lib, device, [(gtype, raw)], [x9])
    assert kernels.calls == calls + 1
    assert rel_err(out, x.astype(np.float64) @ exact_w.T).max() < 2e-2
    assert rel_err(out17, x17.astype(np.float64) @ exact17.T).max() < 2e-2
    assert rel_err(out5, x5.astype(np.float64) @ exact_w.T).max() < 2e-2
    assert rel_err(out9, x9.astype(np.float64) @ exact_w.T).max() < 2e-3
