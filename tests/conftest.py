"""Shared fixtures: tiny GGUF models generated once per session, and the llama.cpp reference."""

from __future__ import annotations

import contextlib
import os
import shutil

import numpy as np
import pytest

from lucepy.testing.tiny import write_qwen35

# Two hparam sets: the default, and one with full_attention_interval != 4, an n_embd that is not a
# power of two and an odd layer count.
HPARAMS = {
    "base": {},
    "odd": {"n_layer": 5, "n_embd": 96, "full_attention_interval": 3, "n_ff": 160, "seed": 7},
    # rows of 256 values and multiples of 16 rows (the DeltaNet's four input products stacked:
    # 768 + 512 + 2 x 8 rows): what lucepy's CUDA layout for Q4_0 takes (tests/test_gpu.py)
    "wide": {
        "n_embd": 256,
        "n_ff": 512,
        "ssm_state_size": 64,
        "ssm_time_step_rank": 8,
        "seed": 11,
    },
}
THREADS = 2


def _has_gpu() -> bool:
    from lucepy.ggml import load
    from lucepy.runtime.devices import list_devices

    return any(d.kind == "gpu" for d in list_devices(load()))


def pytest_collection_modifyitems(config, items):
    if not any("gpu" in item.keywords for item in items) or _has_gpu():
        return
    skip = pytest.mark.skip(reason="no GPU backend in this ggml build")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(model_dir):
    """tiny_model(name, weight_type) -> path, written once per session."""
    made = {}

    def make(name: str = "base", weight_type: str = "f32", **extra):
        key = (name, weight_type, tuple(sorted(extra.items())))
        if key not in made:
            path = model_dir / f"{name}-{weight_type}-{len(made)}.gguf"
            made[key] = write_qwen35(path, weight_type=weight_type, **HPARAMS[name], **extra)
        return made[key]

    return make


@pytest.fixture
def copy_model(tmp_path, tiny_model):
    def copy(name="base", weight_type="f32"):
        dst = tmp_path / "model.gguf"
        shutil.copy(tiny_model(name, weight_type), dst)
        return dst

    return copy


class Reference:
    """llama.cpp (llama-cpp-python) on the same file, prompts processed in ``chunk`` batches;
    ``gpu`` offloads every layer (to the GPU of the libllama that llama_cpp loaded)."""

    def __init__(
        self, path, chunk: int, n_ctx: int = 512, gpu: bool = False, flash_attn: bool = True
    ):
        import llama_cpp

        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_batch=chunk,
                n_ubatch=chunk,
                n_gpu_layers=-1 if gpu else 0,
                logits_all=True,
                flash_attn=flash_attn,
                n_threads=THREADS,
                verbose=False,
            )

    def prompt_logits(self, tokens: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(tokens)
        return np.array(self.llm.scores[: len(tokens)], dtype=np.float32)

    def feed(self, token: int) -> np.ndarray:
        self.llm.eval([token])
        return np.array(self.llm.scores[self.llm.n_tokens - 1], dtype=np.float32)

    def greedy(self, tokens: list[int], n: int) -> list[int]:
        """``n`` greedy tokens after ``tokens``, one decode call each."""
        logits, out = self.prompt_logits(tokens)[-1], []
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            logits = self.feed(out[-1])
        return out

    def close(self):
        self.llm.close()


@pytest.fixture
def reference():
    made = []

    def make(path, chunk, n_ctx=512, gpu=False, flash_attn=True):
        made.append(Reference(path, chunk, n_ctx, gpu, flash_attn))
        return made[-1]

    yield make
    for r in made:
        r.close()
