"""GPU tier (issue 7): on a CUDA build of the pinned ggml (LUCEPY_GGML_LIB) with llama-cpp-python
pointed at the same build's libllama (LLAMA_CPP_LIB_PATH), lucepy on ``cuda:0`` matches llama.cpp
on the same GPU, and a split across the GPU and a CPU worker computes what the GPU alone computes.
Skipped where the loaded ggml has no GPU (tests/conftest.py); tools/gpu_run.sh runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS
from test_batch import run_cancelling, seeded
from test_kv_pool import engine as pool_engine
from test_kv_pool import paged_run
from test_kv_pool import tokens as pool_tokens
from test_reference import CHUNK, N_GEN, prompt, rel_err
from test_speculative import N_GEN as N_SPEC
from test_speculative import PROMPT
from test_speculative import models as models  # noqa: F401  (the fixture, for test 3)
from test_speculative import run as generate_on
from test_split import run as run_split

from lucepy.decode.batch import Batcher
from lucepy.engine import open_engine
from lucepy.ggml import load
from lucepy.ggml.kernels import cuda_kernels
from lucepy.gguf import GGUFFile
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine

pytestmark = pytest.mark.gpu
GPU = "cuda:0"
# f32 weights: ggml-cuda multiplies in TF32 (CUBLAS_TF32_TENSOR_OP_MATH, a 10-bit mantissa), the
# CPU in f32
TF32_TOLERANCE = 5e-2
GEMMA4 = Path(__file__).parent / "fixtures" / "hf" / "gemma4-f32.gguf"
GEMMA4_CTX = 512


def gemma4_prompt(n_vocab: int) -> list[int]:
    """300 tokens: past the sliding layers' ring (256 rows), so the GPU wraps it."""
    return np.random.default_rng(4).integers(0, n_vocab, 300).tolist()


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


def llama_cpp_reference(
    path, tokens, tmp_path, n_ctx: int = 256, flash_attn: bool = True
) -> dict[str, np.ndarray]:
    """llama.cpp's logits for this prompt and model. On the H200, llama-cpp-python 0.3.36 over
    the CUDA build's libllama segfaults for these prompts whether it offloads or not (with no
    lucepy in the process), so tools/make_gpu_ref.py makes them on the CPU machine, for the
    byte-identical model (same GGUF identity), and $LUCEPY_GPU_REF carries them here. Without
    it, tests/llama_ref.py runs in a process of its own."""
    with GGUFFile(path) as f:
        ident = f.identity()
    stored = Path(os.environ.get("LUCEPY_GPU_REF", "/nonexistent")) / f"{ident}.npz"
    out = stored if stored.exists() else tmp_path / "ref.npz"
    if not stored.exists():
        script = Path(__file__).with_name("llama_ref.py")
        subprocess.run(
            [
                sys.executable,
                str(script),
                str(path),
                str(CHUNK),
                str(N_GEN),
                json.dumps(tokens),
                str(out),
                "--n-ctx",
                str(n_ctx),
                *([] if flash_attn else ["--no-fa"]),
            ],
            check=True,
            timeout=300,
        )
    return dict(np.load(out))


def gpu_forward(engine, tokens: list[int], forced) -> tuple[np.ndarray, np.ndarray]:
    """lucepy's prompt logits, then its logits at each step fed the ``forced`` tokens."""
    ours = engine.prefill(tokens, chunk=CHUNK, all_logits=True)
    steps, last = [], ours[-1]
    for token in forced:
        steps.append(last.copy())
        last = engine.decode(int(token))
    return ours, np.array(steps)


# the tiny models compared with llama.cpp (tools/make_gpu_ref.py makes their references)
PARITY = [(name, wtype) for name in ("base", "odd") for wtype in ("f32", "q8_0")]
# models whose Q4_0, Q4_K, Q5_K or Q6_K rows lucepy's CUDA layouts take (q4_k_mix: the DeltaNet's
# qkv and the attention's V in Q8_0, so that z, beta and alpha are one product, Q and K another)
REPACKED = [
    ("wide", "q4_0"),
    ("wide", "q4_k"),
    ("wide", "q4_k_mix"),
    ("wide", "q5_k"),
    ("wide", "q6_k"),
]


def assert_like_llama_cpp(engine, path, wtype, tmp_path, chunks=(CHUNK,)) -> None:
    """Every prompt position (prefilled in each of ``chunks``' sizes, from the start), then every
    decode step fed llama.cpp's greedy tokens.

    f32: within TF32 of llama.cpp. Quantized: the GPU quantizes activations otherwise than the
    CPU, and these tiny random models amplify each rounding, so both are measured against the
    exact math of the same rounded weights (llama.cpp on a dequantized f32 twin, made by
    tools/make_gpu_ref.py): lucepy on the GPU may be no further from it than twice llama.cpp."""
    tokens = prompt(engine.params.n_vocab)
    ref = llama_cpp_reference(path, tokens, tmp_path)
    assert ref["prompt"].std(axis=-1).min() > 0.1  # the model is not degenerate
    assert len(set(ref["tokens"].tolist())) > 1, "greedy output does not vary"
    ours, steps = gpu_forward(engine, tokens, ref["tokens"])
    prompts = [(f"prompt (chunks of {CHUNK})", ours)]
    for chunk in chunks[1:]:
        engine.reset()
        prompts.append(
            (f"prompt (chunks of {chunk})", engine.prefill(tokens, chunk=chunk, all_logits=True))
        )
    if wtype == "f32":
        want = {"prompt": ref["prompt"], "steps": ref["steps"]}
        bound = {"prompt": TF32_TOLERANCE, "steps": TF32_TOLERANCE}
    else:
        assert "prompt_exact" in ref, "run tools/make_gpu_ref.py and carry it (LUCEPY_GPU_REF)"
        want = {k: ref[f"{k}_exact"] for k in ("prompt", "steps")}
        bound = {k: 2 * float(rel_err(ref[k], want[k]).max()) for k in want}
    pairs = [(what, mine, "prompt") for what, mine in prompts] + [("decode", steps, "steps")]
    for what, mine, key in pairs:
        err = rel_err(mine, want[key])
        assert err.max() <= bound[key], (
            f"{what} row {err.argmax()}: {err.max():.2e} > {bound[key]:.2e}"
        )


@pytest.mark.parametrize(("name", "wtype"), PARITY)
def test_gpu_logits_match_llama_cpp(name, wtype, gpu_engine, tiny_model, tmp_path):
    engine = gpu_engine(name, wtype)
    assert engine.shard.backend.name == GPU
    assert_like_llama_cpp(engine, tiny_model(name, wtype), wtype, tmp_path)


@pytest.mark.parametrize(("name", "wtype"), REPACKED)
def test_gpu_repacked_model_matches_llama_cpp(name, wtype, gpu_engine, tiny_model, tmp_path):
    """A Q4_0, Q4_K, Q5_K or Q6_K model whose rows lucepy's CUDA layouts take is repacked at load
    by default and computed by the repacked kernels: its prompt in chunks of 24 (64 columns'
    tiles, gemm_rq, and a tail of 8, gemm_r or gemm_rb) and of 16 (two column tiles), its decode
    steps (gemv_r), within twice llama.cpp's error against the exact math, as any quantized model
    here."""
    kernels = cuda_kernels(load())
    assert kernels is not None, "a CUDA build with lucepy's kernels (lucepy backends build cuda)"
    kernels.set(True)  # whatever this GPU's default
    try:
        engine = gpu_engine(name, wtype)
    finally:
        kernels.set(None)
    repacked = set(engine.shard.weights.repacked)
    with GGUFFile(tiny_model(name, wtype)) as f:
        alone = {  # weights no stack takes in (qwen35's stacks: their keys end in .stacked)
            name
            for name in f.tensors
            if name == "output.weight"
            or name.endswith(("ffn_down.weight", "ssm_out.weight", "attn_output.weight"))
        }
    assert len(alone) == 1 + engine.params.n_layer * 2
    assert alone <= repacked, f"not repacked: {sorted(alone - repacked)}"
    assert any(name.endswith(".stacked") for name in repacked), repacked
    if wtype == "q4_k_mix":
        stacks = {name.split(".")[2] for name in repacked if name.endswith(".stacked")}
        assert stacks == {"ssm_zba", "attn_qk"}, stacks
    calls = kernels.calls
    assert_like_llama_cpp(engine, tiny_model(name, wtype), wtype, tmp_path, (CHUNK, 16))
    assert kernels.calls > calls


def test_gpu_gemma4_matches_llama_cpp(tmp_path):
    """The converter-made gemma4 (sliding and full layers, shared KV, per-layer inputs, V = K,
    softcap) on the GPU, past the wrap of the sliding layers' ring, within TF32 of llama.cpp.
    Without flash attention: ggml-cuda's has no kernel for the fixture's 16- and 32-wide heads."""
    cfg = RuntimeConfig(device=GPU, threads=THREADS, max_ctx=GEMMA4_CTX, flash_attn=False)
    with Engine(GEMMA4, cfg, tokenizer=False) as engine:
        assert engine.shard.backend.name == GPU
        tokens = gemma4_prompt(engine.params.n_vocab)
        ref = llama_cpp_reference(GEMMA4, tokens, tmp_path, GEMMA4_CTX, flash_attn=False)
        assert len(set(ref["tokens"].tolist())) > 1, "greedy output does not vary"
        ours, steps = gpu_forward(engine, tokens, ref["tokens"])
    for what, mine, want in (("prompt", ours, ref["prompt"]), ("decode", steps, ref["steps"])):
        err = rel_err(mine, want)
        assert err.max() <= TF32_TOLERANCE, f"{what} row {err.argmax()}: {err.max():.2e}"


def test_gpu_experts_in_host_ram_equal_all_on_the_gpu():
    """qwen35moe with half its experts (by --n-cpu-moe, and by hotness) in host RAM, computed by
    the CPU in the same step, or by the GPU reading them there (--cold-experts device: a layer's
    tensor spans GPU memory and pinned host RAM, ggml/vmm.py): the GPU-only tokens, logits within
    TF32; the cold matmuls on the CPU (the GPU, the CPU and back in every graph), or on the GPU
    (one split)."""
    from lucepy.ggml import Sched

    path = Path(__file__).parent / "fixtures" / "hf" / "qwen35moe-f32.gguf"
    runs = []
    placements = ({"n_cpu_moe": 2}, {"moe_device_mb": 0.1})  # 0.1 MB: layers split, read
    reads = [dict(p, cold_experts="device") for p in placements]
    for extra in ({}, *placements, *reads):
        cfg = RuntimeConfig(device=GPU, threads=THREADS, max_ctx=256, **extra)
        with Engine(path, cfg, tokenizer=False) as engine:
            logits = engine.prefill(PROMPT, chunk=16, all_logits=True).copy()
            tokens, steps = [int(np.argmax(logits[-1]))], []
            for _ in range(15):  # one-token steps: another kernel than the prompt's
                steps.append(engine.decode(tokens[-1]).copy())
                tokens.append(int(np.argmax(steps[-1])))
            logits = np.concatenate([logits, np.stack(steps)])
            scheds = [g.alloc for g in engine.shard.graphs.values() if isinstance(g.alloc, Sched)]
            splits = [engine.lib.ggml_backend_sched_get_n_splits(s.ptr) for s in scheds]
            if extra.get("cold_experts"):  # hot experts in GPU memory, the rest in host RAM
                (read,) = engine.shard.split
                assert read.host_nbytes > 0 and read.nbytes > 0
        runs.append((extra, logits, tokens, splits))
    for extra, logits, tokens, splits in runs[1:]:
        read = extra.get("cold_experts") == "device"
        assert splits and (max(splits) == 1 if read else min(splits) >= 2), extra
        assert tokens == runs[0][2], extra
        err = rel_err(logits, runs[0][1])  # the prompt's rows, then each decode step's
        assert err.max() <= TF32_TOLERANCE, f"{extra} row {err.argmax()}: {err.max():.2e}"


def test_gpu_expert_tensors_over_gpu_and_host_memory_equal_all_on_the_gpu(tmp_path):
    """--cold-experts device on a model whose expert matrices outgrow the mapping granularity
    (4 layers of Qwen3.6-35B-A3B's shapes, Q4_0): a budget of 200 MB splits a layer's tensors
    at an expert boundary inside one address range, GPU memory before it and pinned host RAM
    after (ggml/vmm.py). The same kernels read both: the GPU-only tokens and logits."""
    path = tmp_path / "moe.gguf"
    subprocess.run(
        [sys.executable, "-m", "lucepy.testing.big", str(path), "--arch", "qwen35moe",
         "--type", "q4_0", "--layers", "4"],
        check=True, capture_output=True,
    )  # fmt: skip
    prompt, runs = list(range(100, 140)), []
    for extra in ({}, {"moe_device_mb": 200, "cold_experts": "device"}):
        profile = str(tmp_path / "profile.npz")
        cfg = RuntimeConfig(device=GPU, max_ctx=256, expert_profile=profile, **extra)
        with Engine(path, cfg, tokenizer=False) as engine:
            logits = engine.prefill(prompt, chunk=16, all_logits=True).copy()
            tokens, steps = [int(np.argmax(logits[-1]))], []
            for _ in range(15):
                steps.append(engine.decode(tokens[-1]).copy())
                tokens.append(int(np.argmax(steps[-1])))
            if extra:
                (read,) = engine.shard.split
                mixed = [m for m, _, _ in read._memory if 0 < m.device_bytes < m.size]
                assert mixed, "no tensor spans both memories"
        runs.append((tokens, np.concatenate([logits, np.stack(steps)])))
    (want, want_logits), (got, got_logits) = runs
    assert got == want
    err = rel_err(got_logits, want_logits)
    assert err.max() <= 1e-3, f"row {err.argmax()}: {err.max():.2e}"


@pytest.fixture(scope="module")
def on_gpu(tiny_model):
    return run_split(tiny_model("odd", "f32"), GPU)


@pytest.mark.parametrize(
    "split,worker,local",
    [
        ("3,2", f"{GPU},cpu@worker", f"{GPU},cpu"),
        ("1,4", f"cpu@worker,{GPU}", f"cpu,{GPU}"),
    ],
)
def test_gpu_with_a_cpu_worker(split, worker, local, tiny_model, on_gpu):
    """The worker computes exactly what the same CPU layers compute in-process (two builds, two
    processes, one answer), and the GPU+CPU split stays within TF32 of the GPU alone: ggml-cuda
    runs f32 matmuls with CUBLAS_TF32_TENSOR_OP_MATH, the CPU in full f32."""
    path = tiny_model("odd", "f32")
    w_logits, w_tokens, w_layers = run_split(path, worker, split)
    l_logits, l_tokens, l_layers = run_split(path, local, split)
    assert [p for *_, p in w_layers].count("worker") == 1
    assert [(a, b) for a, b, _ in w_layers] == [(a, b) for a, b, _ in l_layers]
    assert rel_err(w_logits, l_logits).max() <= 1e-4
    assert w_tokens == l_tokens
    err = rel_err(l_logits, on_gpu[0])
    assert err.max() <= TF32_TOLERANCE, f"prompt position {err.argmax()}: {err.max():.2e}"


def greedy_steps(engine, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """``n`` greedy tokens from a fresh sequence, with the logits each was chosen from."""
    engine.reset()
    logits, tokens, steps = engine.prefill(prompt), [], []
    for _ in range(n):
        steps.append(logits.copy())
        tokens.append(int(np.argmax(logits)))
        logits = engine.decode(tokens[-1])
    return tokens, steps


def greedy_with_logits(path, n):
    cfg = RuntimeConfig(device=GPU, threads=THREADS, max_ctx=256)
    with Engine(path, cfg, tokenizer=False) as engine:
        return greedy_steps(engine, PROMPT, n)


def first_difference_is_a_tie(want: list[int], got: list[int], steps) -> int | None:
    """Where ``got`` first leaves the greedy ``want`` (None: nowhere), after checking that the
    two tokens were a near-tie in the logits ``want`` was chosen from."""
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        if a != b:
            gap = steps[i][a] - steps[i][b]
            assert gap <= 1e-2 * np.abs(steps[i]).max(), f"step {i}: not a tie ({gap:.3g})"
            return i
    return None


def test_gpu_batched_sequences_equal_each_alone(tiny_model):
    """Continuous batching on CUDA (KV streams, the delta net's slices per sequence): four
    requests decoded together agree with each decoded alone, up to a near-tie (a 4-row step and
    a 1-row step run different kernels)."""
    path, rng = tiny_model("odd", "f32"), np.random.default_rng(3)
    cfg = dict(device=GPU, threads=THREADS, max_ctx=128)
    with Engine(path, RuntimeConfig(**cfg), tokenizer=False) as engine:
        prompts = [rng.integers(3, engine.params.n_vocab, 6 + 5 * i).tolist() for i in range(4)]
        alone = [greedy_steps(engine, p, 16) for p in prompts]
    with Engine(path, RuntimeConfig(**cfg, parallel=4), tokenizer=False) as engine:
        batcher = Batcher(engine)
        reqs = [batcher.submit(p, 16, stop_at_end=False) for p in prompts]
        batcher.run()
        assert batcher.steps["decoded"] > batcher.steps["decode"]
    for req, (tokens, steps) in zip(reqs, alone, strict=True):
        first_difference_is_a_tie(tokens, req.tokens, steps)


LLAMA = Path(__file__).parent / "fixtures" / "hf" / "llama-untied-f32.gguf"


@pytest.mark.parametrize("parallel", [8, 32])
def test_gpu_batched_requests_equal_each_alone(parallel):
    """Issue 16's cross-talk check on CUDA (llama, converter-made): parallel + 2 requests of
    different lengths on ``parallel`` sequences, two of them restoring a cached prefix, one
    cancelled after 6 tokens (a waiting one takes its sequence); each request's tokens equal its
    tokens alone, up to a near-tie (a many-row step and a one-row step run different kernels)."""
    rng, n = np.random.default_rng(16 + parallel), parallel + 2
    # head size 32, which ggml-cuda's flash attention does not take
    cfg = dict(device=GPU, threads=THREADS, max_ctx=256, chunk=32, flash_attn=False)
    with Engine(LLAMA, RuntimeConfig(**cfg), tokenizer=False) as engine:
        picked = [rng.integers(3, engine.params.n_vocab, 12 + 3 * i).tolist() for i in range(n)]
        lengths = [12 + i % 9 for i in range(n)]
        alone = [greedy_steps(engine, p, k) for p, k in zip(picked, lengths, strict=True)]
    cfg |= dict(parallel=parallel, prefix_cache_slots=16)
    with open_engine(LLAMA, RuntimeConfig(**cfg), tokenizer=False) as engine:
        batcher = Batcher(engine)
        seeded(batcher, [picked[5][:12], picked[7][:24]])  # the prefix cache holds these
        reqs = [
            batcher.submit(p, k, stop_at_end=False) for p, k in zip(picked, lengths, strict=True)
        ]
        most = run_cancelling(batcher, reqs[3], 6)
    assert most == parallel
    assert reqs[5].cache["restored_tokens"] >= 12 and reqs[7].cache["restored_tokens"] >= 24
    assert reqs[3].finish_reason == "cancelled" and len(reqs[3].tokens) == 6
    for req, (tokens, steps) in zip(reqs, alone, strict=True):
        k = len(req.tokens)
        first_difference_is_a_tie(tokens[:k], req.tokens, steps[:k])


def test_gpu_greedy_with_draft_equals_greedy(models):
    """Verify and rollback (the delta-net snapshots) on the GPU kernels. A 16-token verify and a
    1-token decode run different CUDA kernels (batched vs vector matmuls), so they round
    differently: the outputs agree token for token up to a near-tie, where either is greedy."""
    plain, steps = greedy_with_logits(models["favoured"], N_SPEC)
    spec = generate_on(models["favoured"], GPU, draft=models["agree"])
    assert spec.accept.steps > 0 and sum(spec.accept.histogram[1:-1]) >= 1
    i = first_difference_is_a_tie(plain, spec.tokens, steps)
    assert i is None or i >= 8, f"diverged at step {i}, too early to have tested rollback"


def test_gpu_rollback_left_running_leaves_the_state_a_waited_one_does(models):
    """On a GPU a rollback returns once launched (``Shard.async_rollback``): the state exported
    straight after four verify-and-commit rounds (one keeping the whole block: no rollback),
    and the logits after them, equal those of rollbacks waited for, bit for bit (the same
    kernels)."""
    cfg = RuntimeConfig(device=GPU, threads=THREADS, max_ctx=256)
    block = [50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180, 190, 200]
    runs = []
    for unwaited in (True, False):
        with Engine(models["plain"], cfg, tokenizer=False) as engine:
            assert engine.shard.async_rollback  # the default on a GPU
            engine.shard.async_rollback = unwaited
            engine.prefill(PROMPT)
            for keep in (3, 1, 16, 9):
                engine.verify(block, greedy=True)
                engine.rollback(keep)
            state = engine.export_state()
            runs.append((state, engine.decode(7).copy()))
    (state, logits), (waited, waited_logits) = runs
    assert state.keys() == waited.keys()
    for name, a in state.items():
        np.testing.assert_array_equal(a, waited[name], err_msg=name)
    np.testing.assert_array_equal(logits, waited_logits)


@pytest.mark.parametrize("rank", ["lru", "qk"])
def test_gpu_kv_pool_pages_as_the_cpu_does(rank, tiny_model):
    """KV Flash on ggml-cuda (issue 14): a pool of 640 tokens over a 1000-token prompt and 24
    greedy tokens pages the same chunks out and in as on the CPU (the qk ranking reads the
    queries back from the GPU and brings chunks back), keeps the same chunks resident, and its
    logits stay within TF32 of the CPU's at every position."""
    path, prompt, runs = tiny_model("base", "f32"), pool_tokens(1000, 512, seed=4), []
    for device in (GPU, "cpu"):
        config = {"max_ctx": 2048, "chunk": 128, "kv_pool_rank": rank, "device": device}
        with pool_engine(path, pool=640, **config) as engine:
            runs.append(paged_run(engine, prompt))
    (gpu, gpu_tokens, *gpu_pager), (cpu, cpu_tokens, *cpu_pager) = runs
    assert gpu_pager == cpu_pager and gpu_pager[1] >= 6
    assert gpu_pager[2] >= (rank == "qk")  # qk pages chunks back in
    err = rel_err(gpu, cpu)
    assert err.max() <= TF32_TOLERANCE, f"prompt position {err.argmax()}: {err.max():.2e}"
    assert gpu_tokens == cpu_tokens
