"""DFlash speculative decoding: greedy equals greedy, rollback is clean, sampling is lossless."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import THREADS

from lucepy.decode.ar import generate
from lucepy.decode.sampling import Sampler, SamplingParams
from lucepy.decode.speculative import accept_sampled
from lucepy.errors import ConfigError, StaleVerify
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine
from lucepy.testing.tiny import Qwen35Spec, write_qwen35
from lucepy.testing.tiny_draft import AGREEING_TARGET, write_agreeing_pair, write_dflash

PROMPT = list(range(3, 40))
N_GEN = 72
FAVOURED = AGREEING_TARGET


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    plain = Qwen35Spec(n_layer=5, n_embd=96, full_attention_interval=3, n_ff=160, seed=7)
    favoured, agree = write_agreeing_pair(d)
    return {
        "plain": write_qwen35(d / "plain.gguf", plain),
        "random": write_dflash(d / "random.gguf", plain, target_layers=(1, 3, 5), block_size=8),
        "favoured": favoured,
        "agree": agree,
    }


def run(
    path,
    device="cpu",
    split=None,
    draft=None,
    n=N_GEN,
    sampling=None,
    prompt=PROMPT,
    draft_device=None,
):
    cfg = RuntimeConfig(
        device=device,
        layer_split=split,
        threads=THREADS,
        max_ctx=256,
        draft=str(draft) if draft else None,
        draft_device=draft_device,
    )
    with Engine(path, cfg, tokenizer=False) as engine:
        return generate(engine, prompt, n, sampling=sampling)


@pytest.mark.parametrize(
    "device,split", [("cpu", None), ("cpu,cpu", "1,1"), ("cpu,cpu@worker", "2,3")]
)
@pytest.mark.parametrize("target,draft", [("plain", "random"), ("favoured", "agree")])
def test_greedy_with_draft_equals_greedy(target, draft, device, split, models):
    plain = run(models[target], device, split)
    spec = run(models[target], device, split, draft=models[draft])
    assert len(spec.tokens) == N_GEN >= 64
    assert spec.tokens == plain.tokens
    stats = spec.accept
    assert stats.steps > 0 and sum(stats.histogram) == stats.steps
    if draft == "agree":
        assert stats.mean_len > 2.0, stats.to_dict()
        partial = stats.histogram[1:-1]
        assert sum(partial) >= 3, f"too few partial acceptances to exercise rollback: {partial}"
        assert len(set(plain.tokens)) >= 8  # the continuation varies, so a bad state would show


@pytest.mark.parametrize("device", ["cpu", "cpu,cpu@worker"])
def test_rollback_equals_never_seeing_the_rejected_tokens(device, models):
    cfg = RuntimeConfig(device=device, threads=THREADS, max_ctx=256)
    block = [50, 60, 70, 80, 90, 100, 110, 120]
    with Engine(models["plain"], cfg, tokenizer=False) as engine:
        for keep in (1, 4, 7, 8):
            engine.reset()
            engine.prefill(PROMPT)
            engine.verify(block, greedy=True)
            engine.rollback(keep)
            after = [engine.decode(t).copy() for t in (7, 9)]
            engine.reset()
            engine.prefill(PROMPT + block[:keep])
            fresh = [engine.decode(t).copy() for t in (7, 9)]
            for a, b in zip(after, fresh, strict=True):
                np.testing.assert_array_equal(a, b)


def test_a_rollback_left_running_is_waited_for_before_the_state_is_read(models):
    """On a GPU a rollback returns once launched (``Shard.async_rollback``; forced here, where the
    CPU backend runs it at once): the shard stays unsettled until its next step, or a read of
    the state, waits for it. Exported states and logits are the waited rollback's."""
    cfg = RuntimeConfig(threads=THREADS, max_ctx=256)
    block = [50, 60, 70, 80, 90]
    runs = []
    for unwaited in (False, True):
        with Engine(models["plain"], cfg, tokenizer=False) as engine:
            shard = engine.shard
            shard.async_rollback = unwaited
            engine.prefill(PROMPT)
            engine.verify(block, greedy=True)
            engine.rollback(3)
            assert shard.unsettled is unwaited
            state = engine.export_state()
            assert not shard.unsettled
            engine.verify(block, greedy=True)
            engine.rollback(2)
            assert shard.unsettled is unwaited
            logits = engine.decode(7).copy()
            assert not shard.unsettled
            runs.append((state, logits))
    (state, logits), (state_unwaited, logits_unwaited) = runs
    assert state.keys() == state_unwaited.keys()
    for name, a in state.items():
        np.testing.assert_array_equal(a, state_unwaited[name], err_msg=name)
    np.testing.assert_array_equal(logits, logits_unwaited)


def test_sampled_rejection_rule_is_lossless():
    """Unit: over 40k trials, the first committed token is distributed as p, not as q."""
    rng = np.random.default_rng(0)
    V = 6
    p_logits = rng.normal(size=(3, V)).astype(np.float32)  # rows: target after d0, d1, d2
    q = [np.array([0.5, 0.3, 0.1, 0.05, 0.05, 0.0]) for _ in range(2)]
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    p0 = sampler.probs(p_logits[0]).astype(np.float64)
    counts = np.zeros(V)
    n = 40_000
    for _ in range(n):
        drafts = np.array([sampler.draw(q[0]), sampler.draw(q[1])])
        j, bonus = accept_sampled(sampler, drafts, q, p_logits)
        counts[drafts[0] if j > 0 else bonus] += 1
    # chi-square goodness of fit, 5 degrees of freedom: 20.5 is the p = 0.001 critical value
    chi2 = float(((counts - n * p0) ** 2 / (n * p0)).sum())
    assert chi2 < 20.5, (chi2, counts / n, p0)


def rank_counts(path, tokens_list, sampling, prompt, **config):
    """Observed and expected counts of each sampled token's rank under the target's own
    (transformed) distribution at its position, from one teacher-forced pass per sequence."""
    k = sampling.top_k
    observed, expected = np.zeros(k), np.zeros(k)
    sampler = Sampler(sampling)
    cfg = RuntimeConfig(**{"threads": THREADS, "max_ctx": 256, **config})
    with Engine(path, cfg, tokenizer=False) as engine:
        for tokens in tokens_list:
            engine.reset()
            logits = engine.prefill(prompt + tokens[:-1], all_logits=True)[len(prompt) - 1 :]
            for row, token in zip(logits, tokens, strict=True):
                p = sampler.probs(row)
                order = np.argsort(-p, kind="stable")[:k]
                expected += p[order]
                observed[int(np.nonzero(order == token)[0][0])] += 1
    return observed, expected


def assert_target_distribution(path, tokens_list, sampling, prompt, **config) -> None:
    """Chi-square of ``rank_counts`` over the top-k ranks, k-1 degrees of freedom, rejected at
    p < 0.001 (16.3 for k = 4)."""
    assert sampling.top_k == 4, "the critical value below is for 3 degrees of freedom"
    observed, expected = rank_counts(path, tokens_list, sampling, prompt, **config)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, (observed, expected.round(1))


@pytest.mark.parametrize("with_draft", [False, True])
def test_sampling_matches_the_target_distribution(with_draft, models):
    """At temperature 1 (top-k 4), each generated token's rank under the target's distribution
    at its position is distributed as that distribution says: chi-square over the 4 ranks,
    3 degrees of freedom, rejected at p < 0.001 (16.3)."""
    sampling = SamplingParams(temperature=1.0, top_k=4)
    seqs, stats = [], []
    for seed in range(12):
        gen = run(
            models["favoured"],
            draft=models["agree"] if with_draft else None,
            n=60,
            sampling=SamplingParams(1.0, 4, 1.0, seed),
        )
        seqs.append(gen.tokens)
        stats.append(gen.accept)
    assert_target_distribution(models["favoured"], seqs, sampling, PROMPT)
    if with_draft:
        assert sum(s.accepted for s in stats) > 100  # the drafts really were accepted


def test_draft_for_another_target_is_refused(models, tmp_path):
    cases = [
        (models["agree"], models["plain"], "fc takes 128 features, but 2 target layers of 96"),
        (
            write_dflash(tmp_path / "deep.gguf", FAVOURED, target_layers=(1, 9)),
            models["favoured"],
            "reads target layer 9, but the target has 4 layers",
        ),
        (
            write_dflash(tmp_path / "wide.gguf", Qwen35Spec(n_embd=96), target_layers=(1,)),
            models["favoured"],
            "fc takes 96 features",
        ),
    ]
    for draft, target, words in cases:
        cfg = RuntimeConfig(threads=THREADS, max_ctx=256, draft=str(draft))
        with pytest.raises(ConfigError, match=words):
            Engine(target, cfg, tokenizer=False)


def test_draft_block_is_bounded_by_training(models):
    cfg = RuntimeConfig(threads=THREADS, max_ctx=256, draft=str(models["agree"]), draft_block=9)
    with pytest.raises(ConfigError, match="--draft-block must be 2..8"):
        Engine(models["favoured"], cfg, tokenizer=False)


@pytest.mark.parametrize(("device", "split"), [("cpu", None), ("cpu,cpu@worker", "2,3")])
def test_greedy_reads_back_each_steps_argmax_alone(device, split, models):
    """A greedy plain generation (no logprobs, no grammar) reads each decode step's argmax alone
    (``Engine.decode_greedy``: 4 bytes where the logits are n_vocab floats), never the logits;
    its tokens are the argmax of the logits ``Engine.decode`` reads, step by step, on one device
    and on a split over a worker."""
    cfg = RuntimeConfig(device=device, layer_split=split, threads=THREADS, max_ctx=256)
    with Engine(models["plain"], cfg, tokenizer=False) as engine:

        def no_logits(token):
            raise AssertionError("a greedy generation read the logits")

        engine.decode = no_logits
        fast = generate(engine, PROMPT, 24).tokens
        del engine.decode
        engine.reset()
        logits, slow = engine.prefill(PROMPT), []
        for _ in range(24):
            slow.append(int(np.argmax(logits)))
            logits = engine.decode(slow[-1])
    assert fast == slow


def test_generation_runs_to_the_end_of_the_context(models):
    """Near the context's end the block shrinks to what fits, and greedy still equals greedy."""
    prompt = list(range(3, 40))
    n_ctx = len(prompt) + 30  # not a multiple of the block: the last blocks are short
    outs, expected = [], n_ctx - len(prompt) + 1  # the last token is never fed back
    for draft in (None, models["agree"]):
        cfg = RuntimeConfig(threads=THREADS, max_ctx=n_ctx, draft=str(draft) if draft else None)
        with Engine(models["favoured"], cfg, tokenizer=False) as engine:
            outs.append(generate(engine, prompt, 100).tokens)
    assert outs[0] == outs[1]
    assert len(outs[0]) == expected


@pytest.mark.parametrize("device", ["cpu", "cpu,cpu@worker"])
def test_a_draft_in_a_worker(device, models):
    """--draft-device cpu@worker: the draft's weights, KV and steps live in a worker."""
    plain = run(models["favoured"], device, "1,1" if "," in device else None)
    spec = run(
        models["favoured"],
        device,
        "1,1" if "," in device else None,
        draft=models["agree"],
        draft_device="cpu@worker",
    )
    assert spec.tokens == plain.tokens and spec.accept.mean_len > 2.0


def test_a_dead_draft_worker_fails_the_request_then_comes_back(models):
    import os
    import signal

    from lucepy.errors import WorkerError

    cfg = RuntimeConfig(
        threads=THREADS, max_ctx=256, draft=str(models["agree"]), draft_device="cpu@worker"
    )
    with Engine(models["favoured"], cfg, tokenizer=False) as engine:
        first = generate(engine, PROMPT, 24).tokens
        victim = engine.pipeline.workers[0]
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        again = generate(engine, PROMPT, 24).tokens  # noticed at reset, before any RPC
        assert again == first and engine.draft.remote
        assert engine.pipeline.workers[0].proc.pid != victim.proc.pid
        stream = iter_generate(engine)
        next(stream)
        os.kill(engine.pipeline.workers[0].proc.pid, signal.SIGKILL)  # mid-generation
        with pytest.raises(WorkerError):
            list(stream)
        assert generate(engine, PROMPT, 24).tokens == first


def iter_generate(engine):
    from lucepy.decode.ar import stream

    return stream(engine, PROMPT, 200)


def test_a_verify_is_committed_only_before_the_next_step(models):
    """Decision 11: a commit after another step would roll back the wrong step, and a second
    commit of the same verify would roll back twice; both are refused."""
    cfg = RuntimeConfig(threads=THREADS, max_ctx=256)
    with Engine(models["plain"], cfg, tokenizer=False) as engine:
        engine.prefill(PROMPT)
        done = engine.verify([50, 60, 70], greedy=True)
        engine.commit(done, 3)
        with pytest.raises(StaleVerify, match="committed already"):
            engine.commit(done, 2)
        late = engine.verify([80, 90], greedy=True)
        engine.decode(5)
        with pytest.raises(StaleVerify, match="commit a verify before the next"):
            engine.commit(late, 1)
        fresh = engine.verify([100, 110], greedy=True)
        engine.commit(fresh, 1)
        assert engine.n_past == len(PROMPT) + 3 + 2 + 1 + 1
