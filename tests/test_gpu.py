"""GPU tier (issue 7): on a CUDA build of the pinned ggml (LUCEPY_GGML_LIB) with llama-cpp-python
pointed at the same build's libllama (LLAMA_CPP_LIB_PATH), lucepy on ``cuda:0`` matches llama.cpp
on the same GPU, and a split across the GPU and a CPU worker computes what the GPU alone computes.
Skipped where the loaded ggml has no GPU (tests/conftest.py); tools/gpu_run.sh runs them."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import THREADS
from test_reference import CHUNK, N_GEN, TOLERANCE, is_tie, prompt, rel_err
from test_speculative import models as models  # noqa: F401  (the fixture, for test 3)
from test_speculative import run as generate_on
from test_split import run as run_split

from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine

pytestmark = pytest.mark.gpu
GPU = "cuda:0"
SPLIT_TOLERANCE = 1e-3  # GPU and CPU kernels round differently; same math, same tokens


@pytest.fixture
def gpu_engine(tiny_model):
    made = []

    def make(name, wtype):
        cfg = RuntimeConfig(device=GPU, threads=THREADS, max_ctx=512)
        made.append(Engine(tiny_model(name, wtype), cfg, tokenizer=False))
        return made[-1]

    yield make
    for e in made:
        e.close()


@pytest.mark.parametrize("wtype", ["f32", "q8_0"])
@pytest.mark.parametrize("name", ["base", "odd"])
def test_gpu_logits_match_llama_cpp_on_the_gpu(name, wtype, gpu_engine, tiny_model, reference):
    """Every prompt position, then every decode step fed llama.cpp's greedy tokens."""
    tol = TOLERANCE[wtype]
    engine = gpu_engine(name, wtype)
    assert engine.shard.backend.name == GPU
    tokens = prompt(engine.params.n_vocab)
    ref = reference(tiny_model(name, wtype), CHUNK, gpu=True)
    ours = engine.prefill(tokens, chunk=CHUNK, all_logits=True)
    want = ref.prompt_logits(tokens)
    err = rel_err(ours, want)
    assert err.max() <= tol, f"prompt position {err.argmax()}: {err.max():.2e}"
    assert want.std(axis=-1).min() > 0.1  # the model is not degenerate

    ours_last, want_last, ref_tokens = ours[-1], want[-1], []
    for step in range(N_GEN):
        token = int(np.argmax(want_last))
        assert rel_err(ours_last, want_last) <= tol, f"decode step {step}"
        assert int(np.argmax(ours_last)) == token or is_tie(want_last, tol), f"step {step}"
        ref_tokens.append(token)
        ours_last, want_last = engine.decode(token).copy(), ref.feed(token)
    assert len(set(ref_tokens)) > 1, "greedy output does not vary; the model is degenerate"


@pytest.fixture(scope="module")
def on_gpu(tiny_model):
    return run_split(tiny_model("odd", "f32"), GPU)


@pytest.mark.parametrize(
    "device,split,layers",
    [
        (f"{GPU},cpu@worker", "3,2", [(0, 3, "local"), (3, 5, "worker")]),
        (f"{GPU},cpu", "2,3", [(0, 2, "local"), (2, 5, "local")]),
        (f"cpu@worker,{GPU}", "1,4", [(0, 1, "worker"), (1, 5, "local")]),
    ],
)
def test_gpu_and_cpu_split_equals_gpu_alone(device, split, layers, tiny_model, on_gpu):
    logits, tokens, got = run_split(tiny_model("odd", "f32"), device, split)
    assert got == layers
    want_logits, want_tokens, _ = on_gpu
    err = rel_err(logits, want_logits)
    assert err.max() <= SPLIT_TOLERANCE, f"prompt position {err.argmax()}: {err.max():.2e}"
    assert tokens == want_tokens


def test_gpu_greedy_with_draft_equals_greedy(models):
    """Verify and rollback (the delta-net snapshots) on the GPU kernels."""
    plain = generate_on(models["favoured"], GPU)
    spec = generate_on(models["favoured"], GPU, draft=models["agree"])
    assert spec.tokens == plain.tokens
    assert spec.accept.steps > 0 and sum(spec.accept.histogram[1:-1]) >= 1
