"""lucepy's Q4_1 CPU kernel (vendor/ggml/cpu/lucepy-cpu.c): bit for bit ggml's mul_mat, in every
variant this CPU runs, and what the default model's graphs give it."""

from __future__ import annotations

import platform

import numpy as np
import pytest
from conftest import THREADS
from test_llama import SMOLLM2, prompt_logits

from lucepy.ggml import cpu, load
from lucepy.ggml.owners import Context
from lucepy.runtime.devices import open_backend


def _avx2() -> bool:
    if platform.machine() != "x86_64":
        return False
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    return all(f" {flag}" in flags for flag in ("avx2", "fma", "f16c"))


pytestmark = pytest.mark.skipif(not _avx2(), reason="the kernel needs x86-64 with AVX2")


@pytest.fixture(scope="module")
def backend():
    lib = load()
    with open_backend(lib, "cpu", THREADS) as b:
        yield lib, b


def test_it_is_built_for_this_ggml_and_cpu():
    """pip built it (setup.py), for the pinned tensor layout; this CPU runs at least the AVX2
    variant, and AVX-VNNI's first where it has it."""
    found, why = cpu._find()
    assert why is None and found is not None
    names = [k.variant for k in cpu.variants()]
    assert names[-1] == "avx2"
    with open("/proc/cpuinfo") as f:
        assert ("avx2+avxvnni" in names) == (" avx_vnni" in f.read())


@pytest.mark.parametrize("K", [32, 256, 1536])
@pytest.mark.parametrize("rows,cols", [(1, 3), (2, 4), (37, 11), (130, 5), (5, 33), (64, 16)])
def test_every_variant_gives_ggml_bits(backend, rows, cols, K):
    """Every tile shape (odd rows, 1-3 columns left over) and block count, against ggml's
    mul_mat on the same backend, every value's bits."""
    lib, b = backend
    for k in cpu.variants():
        assert cpu.check(lib, b, k, rows, cols, K) is None, k.variant


def test_few_columns_and_other_types_stay_ggml(backend):
    """One or two columns, Q8_0 weights and f32 weights are left to ggml; three columns are
    taken, and two products of the same x share one Q8_1 copy."""
    lib, b = backend
    k = cpu.kernel(lib, b)
    assert k is not None, cpu.why_not()
    ctx = Context(lib, 16, graph_nodes=32)
    try:
        from lucepy.ggml.owners import Buffer

        q41 = lib.ggml_new_tensor_2d(ctx.ptr, cpu.Q4_1, 64, 8)
        q41b = lib.ggml_new_tensor_2d(ctx.ptr, cpu.Q4_1, 64, 8)
        q80 = lib.ggml_new_tensor_2d(ctx.ptr, lib.GGML_TYPE_Q8_0, 64, 8)
        f32 = lib.ggml_new_tensor_2d(ctx.ptr, cpu.F32, 64, 8)
        with Buffer(lib, ctx, b, "weights"):
            xs = {n: lib.ggml_new_tensor_2d(ctx.ptr, cpu.F32, 64, n) for n in (1, 2, 3)}
            gf = lib.ggml_new_graph_custom(ctx.ptr, 32, False)
            products = [lib.ggml_mul_mat(ctx.ptr, q41, xs[n]) for n in (1, 2, 3)]
            products += [lib.ggml_mul_mat(ctx.ptr, w, xs[3]) for w in (q41b, q80, f32)]
            for p in products:
                lib.ggml_build_forward_expand(gf, p)
            before = lib.ggml_graph_n_nodes(gf)
            assert cpu.take_products(lib, ctx.ptr, gf, k) == 2
            assert lib.ggml_graph_n_nodes(gf) == before + 1  # one Q8_1 copy of xs[3]
            ops = [int(p.op) for p in products]
            assert ops == [
                cpu.MUL_MAT,
                cpu.MUL_MAT,
                cpu.CUSTOM,
                cpu.CUSTOM,
                cpu.MUL_MAT,
                cpu.MUL_MAT,
            ]
            assert products[2].src[1] == products[3].src[1]
    finally:
        ctx.close()


def test_the_default_model_gives_the_same_logits_with_it(monkeypatch):
    """SmolLM2's prompt logits at every position: the products of its 12-token prefill go to
    the kernel, and every logit has the bits it has on ggml's kernels."""
    tokens = list(range(100, 112))
    monkeypatch.setenv(cpu.ENV, "0")
    theirs = prompt_logits(SMOLLM2, tokens)
    monkeypatch.setenv(cpu.ENV, "1")
    taken = cpu.taken_count()
    ours = prompt_logits(SMOLLM2, tokens)
    assert cpu.taken_count() - taken == 30 * 7  # every Q4_1 product of its 30 layers
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
