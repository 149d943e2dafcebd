"""Train a DFlash draft for SmolLM2-135M-Instruct with torch, on a GPU (or, tiny, on a CPU).

1. Data: the target, read from its GGUF and dequantized, writes a request after each seed of
   tools/dflash_prompts.json at temperature 1, then answers it: greedily for three in four,
   at temperature 0.7 for the rest, up to 256 tokens. A request equal to a held-out prompt is
   dropped. It generates in bf16 products (``--gen-dtype``), 4,096 sequences a batch. A draft
   trained for many passes over few sequences learns them, not the target: train in rounds,
   each on sequences it has just made (``--init`` the last round's weights, a new ``--seed``).
2. Training, DFlash's way: blocks of 16 at random anchors in the answers. Row 0 holds the
   anchor's token, rows 1..15 the mask token, at the anchor's positions onward. A block sees the
   target's features of every position before its anchor (``fc``, then each layer's K/V of it:
   the KV injection of ``src/models/dflash.cpp``) and the whole block. The loss is cross-entropy
   on rows 1..15, row k weighted exp(-(k-1)/7); the target's embedding and head are frozen.
   Two variants, each measured no better than a plain round on the same data and time
   (docs/BENCHMARKS.md, session 24): ``--layers`` past ``--init``'s grows the draft (new layers
   after its own, starting as the identity), ``--soft`` trains each row on the target's whole
   distribution at its position instead of its token.
3. Evaluation on the held-out prompts: the target's greedy answer of 256 tokens, and the greedy
   speculative walk over it (tau, the histogram of accepted drafts).

Writes OUT/draft.gguf (tools/dflash_gguf.py), OUT/weights.N.npz (f16 parts, for re-writing),
OUT/train.json (the config, the loss curve, the evaluation):
    python3 tools/train_dflash.py TARGET.gguf OUT [--train-s 300] [--sequences 16384]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from dflash_gguf import DraftConfig, config_json, load_npz, write  # noqa: E402
from dflash_model import Draft, Target, block_batch, rms  # noqa: E402

LOSS_DECAY = 7.0  # DFlash's gamma for a block of 16


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- 1. data ---
def make_data(target: Target, prompts: dict, args, have: int) -> list[tuple]:
    """(tokens, prompt length) per sequence: a request written after a seed, then its answer;
    ``args.sequences`` in all with the ``have`` made before, or what ``args.data_s`` seconds
    make."""
    n_seq, batch, seed = args.sequences - have, args.gen_batch, args.seed + have
    gen = torch.Generator(device=target.device).manual_seed(seed)
    rng = np.random.default_rng(seed)
    end = prompts["end"][0]
    heldout = {tuple(p) for p in prompts["heldout"]}
    seeds = [prompts["seed_head"] + tail for tail in prompts["seeds"]]
    out, t0 = [], time.time()
    dtype = getattr(torch, args.gen_dtype)
    while len(out) < n_seq and time.time() - t0 < args.data_s:
        picks = rng.integers(len(seeds), size=batch).tolist()
        requests = target.generate([seeds[i] for i in picks], 64, 1.0, end, gen, dtype=dtype)
        starts = [
            seeds[i] + r[: r.index(end) if end in r else len(r)] + prompts["assistant"]
            for i, r in zip(picks, requests, strict=False)
        ]
        starts = [s for s in starts if tuple(s) not in heldout]
        temps = [0.0 if i % 4 else 0.7 for i in range(len(starts))]  # greedy for three in four
        answers = target.generate(starts, 256, temps, end, gen, dtype=dtype)
        for s, a in zip(starts, answers, strict=False):
            if len(a) >= 8:
                out.append((s + a, len(s)))
        n_tok = sum(len(s) for s, _ in out)
        log(f"data: {len(out)} sequences, {n_tok} tokens ({time.time() - t0:.0f} s)")
    return out[:n_seq]


# --- 2. training ---
@dataclass
class Corpus:
    """The training sequences, with the target's features: computed once and kept on the device,
    or, when they would take more than ``gpu_gib`` of it, computed again for each batch (100,000
    sequences' features would take 190 GiB; a batch's cost a third of a training step)."""

    tokens: torch.Tensor  # [N, L] padded at the end
    plen: torch.Tensor  # [N] prompt lengths: anchors start there
    lens: torch.Tensor  # [N]
    feats: torch.Tensor | None  # [N, L, n_target_layers * n_embd] bf16, or None: per batch
    target: Target
    layers: tuple

    @classmethod
    def of(cls, target: Target, data: list, layers: tuple, chunk: int = 64, gpu_gib: float = 60):
        tokens, plen, lens = target.pad(data)
        shape = (*tokens.shape, len(layers) * target.embd.shape[1])
        corpus = cls(tokens, plen, lens, None, target, layers)
        if math.prod(shape) * 2 <= gpu_gib * 2**30:
            corpus.feats = torch.empty(*shape, dtype=torch.bfloat16, device=tokens.device)
            for i in range(0, len(data), chunk):
                n = int(lens[i : i + chunk].max())
                got = target.features(tokens[i : i + chunk, :n], layers)
                corpus.feats[i : i + chunk, :n] = got.to(torch.bfloat16)
        return corpus

    def batch(self, idx: torch.Tensor) -> Corpus:
        n = int(self.lens[idx].max())
        tokens = self.tokens[idx, :n]
        if self.feats is None:  # bf16 products: the draft reads them as bf16 anyway
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=tokens.is_cuda):
                feats = self.target.features(tokens, self.layers).to(torch.bfloat16)
        else:
            feats = self.feats[idx, :n]
        return Corpus(tokens, self.plen[idx], self.lens[idx], feats, self.target, self.layers)


def loss_of(
    draft: Draft, embd: torch.Tensor, c: Corpus, anchors: int, gen, soft: Target | None = None
) -> torch.Tensor:
    """The weighted cross-entropy of ``anchors`` random blocks a sequence. With ``soft`` (the
    target), the corpus's last feature slice is the target's output residual, and each row
    learns the target's whole distribution at its position (a soft cross-entropy: the KL
    divergence up to a constant) instead of its token alone."""
    lo, hi = c.plen, c.lens - 2  # the last anchor predicts at least one token
    u = torch.rand(len(lo), anchors, generator=gen, device=lo.device)
    anchor = (lo[:, None] + (u * (hi - lo + 1)[:, None].clamp(min=1)).long()).clamp(max=hi[:, None])
    b = block_batch(c.tokens, c.lens, anchor, draft.cfg.block_size, draft.cfg.mask_token)
    feats, e = c.feats, draft.cfg.n_embd
    if soft is not None:
        feats, last = feats[..., :-e], feats[..., -e:]
    with torch.autocast("cuda" if lo.is_cuda else "cpu", dtype=torch.bfloat16):
        hidden = draft(feats, b)  # [S, M*B, n_embd]
        logits = hidden @ embd.T.to(hidden.dtype)
        if soft is not None:  # row k's token follows position anchor + k - 1
            at = (b.pos - 1).clamp(max=last.shape[1] - 1)[..., None].expand(-1, -1, e)
            h = rms(last.gather(1, at).float(), soft.w["output_norm.weight"], soft.eps)
            want = torch.softmax((h @ embd.T.to(h.dtype)).float().flatten(0, 1), -1)
    flat = logits.float().flatten(0, 1)
    if soft is None:
        ce = F.cross_entropy(flat, b.labels.flatten(), ignore_index=-100, reduction="none")
    else:
        ce = F.cross_entropy(flat, want, reduction="none")
    weight = row_weights(b.labels, draft.cfg.block_size).flatten()
    return (ce * weight).sum() / weight.sum()


def row_weights(labels: torch.Tensor, B: int) -> torch.Tensor:
    """The loss's weight of each row of blocks of B: row k exp(-(k-1)/gamma), 0 where there is
    no label (row 0, past the end)."""
    k = torch.arange(labels.shape[-1], device=labels.device) % B
    return torch.exp(-(k - 1).clamp(min=0) / LOSS_DECAY) * (labels >= 0)


def train(
    draft: Draft, embd: torch.Tensor, corpus: Corpus, args, soft: Target | None
) -> list[dict]:
    """AdamW; the learning rate warms up over 100 steps, then follows a cosine over the time
    budget (to a tenth)."""
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator(device=embd.device).manual_seed(args.seed + 1)
    n = corpus.tokens.shape[0]
    curve, t0, step = [], time.time(), 0
    if args.train_s <= 0 and not args.steps:  # data only
        return curve
    while True:
        done = (time.time() - t0) / args.train_s
        if done >= 1 or (args.steps and step >= args.steps):
            break
        if args.steps:
            done = step / args.steps
        scale = min(1.0, (step + 1) / 100) * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))
        for group in opt.param_groups:
            group["lr"] = args.lr * scale
        idx = torch.randperm(n, generator=gen, device=embd.device)[: args.batch]
        loss = loss_of(draft, embd, corpus.batch(idx), args.anchors, gen, soft)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            curve.append({"step": step, "s": round(time.time() - t0, 1), "loss": loss.item()})
            log(f"step {step} loss {loss.item():.3f} lr {args.lr * scale:.2e}")
        step += 1
    log(f"trained {step} steps in {time.time() - t0:.0f} s")
    return curve


def load_data(path: Path | None) -> list[tuple]:
    if path is None or not path.exists():
        return []
    return [(list(s), p) for s, p in json.loads(path.read_text())]


# --- 3. evaluation ---
@torch.no_grad()
def evaluate(draft: Draft, target: Target, prompts: dict, n_tokens: int) -> dict:
    """tau of the greedy speculative walk over the target's greedy answers to the held-out
    prompts: from the first answer token, a step accepts the drafts up to the first mismatch,
    then takes the target's token (the bonus). Also the training loss on those answers (a block
    at every position) and each row's accuracy: set beside the training loss, they say whether
    the draft learnt this target or only its training sequences."""
    held = prompts["heldout"]
    answers = target.generate(held, n_tokens, 0.0, None, None)
    seqs = [(p + a, len(p)) for p, a in zip(held, answers, strict=False)]
    B, hist, steps = draft.cfg.block_size, np.zeros(draft.cfg.block_size, int), 0
    loss, weights, hits, rows = 0.0, 0.0, torch.zeros(B - 1), torch.zeros(B - 1)
    for seq, plen in seqs:
        tokens, _, lens = target.pad([(seq, plen)])
        feats = target.features(tokens, draft.cfg.target_layers).to(torch.bfloat16)
        anchor = torch.arange(plen, len(seq) - 1, device=tokens.device)[None]
        b = block_batch(tokens, lens, anchor, B, draft.cfg.mask_token)
        with torch.autocast("cuda" if tokens.is_cuda else "cpu", dtype=torch.bfloat16):
            hidden = draft(feats, b)
        logits = hidden.float()[0] @ target.embd.T
        labels = b.labels[0]
        w = row_weights(labels, B)
        loss += float(
            (F.cross_entropy(logits, labels, ignore_index=-100, reduction="none") * w).sum()
        )
        weights += float(w.sum())
        top = logits.argmax(-1).view(-1, B)[:, 1:]
        labeled = labels.view(-1, B)[:, 1:] >= 0
        hits += ((top == labels.view(-1, B)[:, 1:]) & labeled).sum(0).cpu()
        rows += labeled.sum(0).cpu()
        guess = top.cpu().numpy()
        a, end = plen, len(seq) - 1
        while a < end:
            want = np.array(seq[a + 1 : a + B])
            got = guess[a - plen, : want.size]
            miss = np.nonzero(got != want)[0]
            j = int(miss[0]) if miss.size else want.size
            hist[j] += 1
            steps += 1
            a += j + 1
    accepted = int((hist * np.arange(B)).sum())
    return {
        "prompts": len(held),
        "tokens": n_tokens,
        "steps": steps,
        "tau": round((accepted + steps) / steps, 3),
        "histogram": hist.tolist(),
        "loss": round(loss / weights, 3),
        "accuracy": [round(float(h / max(r, 1)), 3) for h, r in zip(hits, rows, strict=True)],
    }


def save(draft: Draft, out: Path, target_path: Path, part_mib: int = 12) -> None:
    """The weights in f16 parts of at most about ``part_mib`` (what one device call brings back),
    and the draft GGUF."""
    weights = {k: v.float().cpu().numpy() for k, v in draft.gguf_weights().items()}
    names = sorted(weights)
    parts = max(2, math.ceil(sum(w.size * 2 for w in weights.values()) / (part_mib << 20)))
    for i in range(parts):
        part = {n: weights[n].astype(np.float16) for n in names[i::parts]}
        np.savez(out / f"weights.{i}.npz", config=config_json(draft.cfg), **part)
    write(out / "draft.gguf", weights, draft.cfg, target_path, "q5_1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--prompts", type=Path, default=Path(__file__).with_name("dflash_prompts.json"))
    ap.add_argument("--sequences", type=int, default=16384)
    ap.add_argument("--gen-batch", type=int, default=4096)
    ap.add_argument("--gen-dtype", default="bfloat16", help="of the target's products for data")
    ap.add_argument("--data-s", type=float, default=150.0, help="data generation time budget")
    ap.add_argument("--train-s", type=float, default=300.0, help="training time budget")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: time)")
    ap.add_argument("--batch", type=int, default=64, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=32, help="blocks per sequence per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--data", type=Path, help="sequences made before (JSON), extended and saved")
    ap.add_argument(
        "--layers",
        type=int,
        help=f"of the draft (default {DraftConfig.n_layer}, or --init's); more than --init's "
        "adds layers after its own, each starting as the identity",
    )
    ap.add_argument("--features-gib", type=float, default=40.0, help="past this, per batch")
    ap.add_argument("--init", type=Path, nargs="+", help="weights.N.npz to go on training from")
    ap.add_argument(
        "--soft",
        action="store_true",
        help="each row learns the target's whole distribution, not only its token",
    )
    ap.add_argument("--eval-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    prompts = json.loads(args.prompts.read_text())
    target = Target(args.target, device)
    log(f"target on {device}: {target.n_layer} layers")
    cfg = DraftConfig()
    if args.init:
        weights, cfg = load_npz(args.init)
    if args.layers:
        if args.layers < cfg.n_layer:
            raise SystemExit(f"--layers {args.layers}: the draft to go on from has {cfg.n_layer}")
        cfg = dataclasses.replace(cfg, n_layer=args.layers)
    draft = Draft(cfg, target.embd, target.w["output_norm.weight"]).to(device)
    if args.init:
        grown = draft.load_gguf_weights(weights)
        log(f"draft from {[str(p) for p in args.init]}, {grown} layers added")
    report = {
        "config": json.loads(config_json(cfg)),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    report["before"] = evaluate(draft, target, prompts, args.eval_tokens)
    held = prompts["heldout"]  # one step's work before the long part, so that errors come early
    soft = target if args.soft else None
    layers = cfg.target_layers + ((target.n_layer,) if soft else ())  # + the output residual
    probe = Corpus.of(target, [(held[0] + held[1], len(held[0]))], layers)
    loss_of(draft, target.embd, probe, 4, None, soft).backward()
    draft.zero_grad(set_to_none=True)
    data = load_data(args.data)
    data += make_data(target, prompts, args, len(data))
    if args.data:
        args.data.write_text(json.dumps(data))
    report["data"] = {"sequences": len(data), "tokens": sum(len(s) for s, _ in data)}
    corpus = Corpus.of(target, data, layers, gpu_gib=args.features_gib)
    if corpus.feats is None:
        log(f"features of {len(data)} sequences: computed for each batch")
    else:
        log(f"features of {len(data)} sequences: {corpus.feats.nbytes / 2**30:.1f} GiB")
    report["curve"] = train(draft, target.embd, corpus, args, soft)
    report["heldout"] = evaluate(draft, target, prompts, args.eval_tokens)
    log(f"held-out: {report['heldout']}")
    save(draft, args.out, args.target)
    (args.out / "train.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
