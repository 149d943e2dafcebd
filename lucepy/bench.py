"""Benchmarks: lucepy against llama.cpp (llama-cpp-python) on the same GGUF, in one process and run.

Both sides get the same prompt, batch size, thread count, flash attention setting and f16 KV
cache. Each figure is the median of ``repeats`` timed runs after one untimed warm-up run. lucepy
runs with the config as given: its prefix cache is off unless the config turns it on.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from lucepy.decode.verify_len import median_s
from lucepy.engine import open_engine
from lucepy.gguf import GGUFFile
from lucepy.models import architecture_for
from lucepy.runtime.config import RuntimeConfig


@dataclass
class Figures:
    prefill_tok_s: float
    decode_tok_s: float


@dataclass
class BenchResult:
    model: str
    prompt_len: int
    gen: int
    threads: int
    chunk: int
    lucepy: Figures
    llama_cpp: Figures | None = None
    devices: str = "cpu"

    @property
    def ratios(self) -> dict[str, float] | None:
        if self.llama_cpp is None:
            return None
        return {
            "prefill": self.lucepy.prefill_tok_s / self.llama_cpp.prefill_tok_s,
            "decode": self.lucepy.decode_tok_s / self.llama_cpp.decode_tok_s,
        }

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ratios"] = self.ratios
        return out


def _median_rate(n: int, run, repeats: int) -> float:
    return n / median_s(run, repeats)


def _lucepy(path: Path, prompt: list[int], gen: int, cfg: RuntimeConfig, repeats: int) -> Figures:
    with open_engine(path, cfg, tokenizer=False) as engine:

        def prefill():
            engine.reset()
            return engine.prefill(prompt)

        def decode():  # greedy through the engine's generate: gen decode steps after the prompt
            out = engine.generate(prompt, gen + 1, stop_at_end=False)
            decode.elapsed = out.timings.decode_ms / 1e3

        pre = _median_rate(len(prompt), prefill, repeats)
        dec = _median_decode(gen, decode, repeats)
    return Figures(round(pre, 2), round(dec, 2))


def _median_decode(gen: int, run, repeats: int) -> float:
    """``run`` prefills, then times only its ``gen`` decode steps into ``run.elapsed``."""
    run()
    rates = []
    for _ in range(repeats):
        run()
        rates.append(gen / run.elapsed)
    return statistics.median(rates)


def _llama_cpp(
    path: Path, prompt: list[int], gen: int, cfg: RuntimeConfig, n_ctx: int, repeats: int
) -> Figures:
    import llama_cpp

    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=cfg.chunk,
            n_ubatch=cfg.chunk,
            n_threads=cfg.thread_count(),
            n_threads_batch=cfg.thread_count(),
            flash_attn=cfg.flash_attn,
            verbose=False,
        )
    try:
        n_vocab = llm.n_vocab()

        def last_logits() -> np.ndarray:
            ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
            return np.ctypeslib.as_array(ptr, shape=(n_vocab,))

        def prefill():
            llm.reset()
            llm.eval(prompt)
            return last_logits()

        def decode():
            logits = prefill()
            t0 = time.perf_counter()
            for _ in range(gen):
                llm.eval([int(np.argmax(logits))])
                logits = last_logits()
            decode.elapsed = time.perf_counter() - t0

        pre = _median_rate(len(prompt), prefill, repeats)
        dec = _median_decode(gen, decode, repeats)
    finally:
        llm.close()
    return Figures(round(pre, 2), round(dec, 2))


def run(
    model: str | os.PathLike,
    config: RuntimeConfig,
    *,
    prompt_len: int = 512,
    gen: int = 64,
    vs_llama_cpp: bool = True,
    repeats: int = 3,
) -> BenchResult:
    """Measure lucepy as ``config`` places it; llama.cpp (if asked) runs unsplit on the CPU."""
    path = Path(model)
    n_ctx = prompt_len + gen + 1
    if config.max_ctx is None or config.max_ctx < n_ctx:
        config = replace(config, max_ctx=n_ctx)
    with GGUFFile(path) as f:
        n_vocab = architecture_for(f).from_gguf(f).p.n_vocab
    prompt = np.random.default_rng(0).integers(0, n_vocab, prompt_len).tolist()
    ours = _lucepy(path, prompt, gen, config, repeats)
    ref = _llama_cpp(path, prompt, gen, config, n_ctx, repeats) if vs_llama_cpp else None
    return BenchResult(
        str(path),
        prompt_len,
        gen,
        config.thread_count(),
        config.chunk,
        ours,
        ref,
        devices=config.device,
    )
