"""Where a MoE model's routed experts live (issue 12), and the hotness profile that decides it.

A layer's experts are "hot" (with the layer, on its shard's device) or "cold" (in host RAM,
computed by a CPU backend in the same step: ``runtime/shard.py`` runs such a layer's graph through
``ggml_backend_sched``). Two policies choose:

- by hotness, under a byte budget for experts on the device (``--moe-gpu-mb``): the experts that
  most tokens chose, over every layer, until the budget is spent;
- by layer, as llama.cpp's ``--n-cpu-moe N``: every expert of the first N layers is cold.

The profile counts, per layer and expert, how many tokens chose it. Engines count while they run
(the ``routing`` output of prompt and verify steps, one read for all layers; decode steps count
nothing, their read was too dear) and save the counts beside the caches,
``<cache>/experts/<model identity>.npz``, where the next start's placement and
``lucepy experts`` find them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lucepy.errors import ConfigError
from lucepy.gguf import GGUFFile
from lucepy.runtime.backends import cache_root

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def expert_layers(f: GGUFFile, n_layer: int) -> list[int]:
    """The layers with routed experts stored as separate gate, up and down tensors."""
    layers = [il for il in range(n_layer) if f"blk.{il}.ffn_down_exps.weight" in f.tensors]
    fused = [il for il in layers if f"blk.{il}.ffn_gate_up_exps.weight" in f.tensors]
    if fused:
        raise ConfigError(
            f"{f.path}: layer {fused[0]} stores its experts' gate and up as one tensor; "
            f"placing those experts apart is not built: drop --moe-gpu-mb and --n-cpu-moe"
        )
    return layers


def placement_for(f: GGUFFile, params, config) -> ExpertPlacement | None:
    """The placement ``config`` asks for (``None``: every expert with its layer)."""
    n_expert = getattr(params, "n_expert", 0)
    if not config.n_cpu_moe and config.moe_device_mb is None:
        return None
    if not n_expert:
        raise ConfigError(f"{f.path}: --n-cpu-moe and --moe-gpu-mb need a model with experts")
    k = params.n_expert_used
    if config.n_cpu_moe:
        return by_layers(f, params.n_layer, n_expert, config.n_cpu_moe, k)
    counts = ExpertCounts.load(profile_for(f, config), params.n_layer, n_expert).counts
    budget = int(config.moe_device_mb * 2**20)
    return by_hotness(f, params.n_layer, n_expert, counts, budget, k)


def expert_bytes(f: GGUFFile, il: int) -> int:
    """Bytes of one routed expert of layer ``il`` (its gate, up and down rows)."""
    total = 0
    for name in EXPERT_TENSORS:
        info = f.tensors[f"blk.{il}.{name}.weight"]
        total += info.nbytes // info.shape[2]
    return total


@dataclass(frozen=True)
class ExpertPlacement:
    """Per layer, the experts kept on the device, sorted; a layer not in ``hot`` keeps them all."""

    policy: str  # how it was chosen, for plans and logs
    n_expert: int
    hot: dict[int, tuple[int, ...]]
    expert_bytes: dict[int, int]  # layer -> bytes of one expert
    padding: int = 0  # all-zero experts beside the device part of a split layer (runtime/shard.py)

    def is_split(self, il: int) -> bool:
        return il in self.hot

    def cold(self, il: int) -> tuple[int, ...]:
        keep = set(self.hot.get(il, range(self.n_expert)))
        return tuple(e for e in range(self.n_expert) if e not in keep)

    def bytes(self, layers: range | None = None) -> tuple[int, int]:
        """(device, host) bytes of the routed experts of ``layers`` (default: all)."""
        device = host = 0
        for il, one in self.expert_bytes.items():
            if layers is not None and il not in layers:
                continue
            n_cold = len(self.cold(il))
            pad = self.padding if n_cold and self.hot.get(il) else 0
            device += one * (self.n_expert - n_cold + pad)
            host += one * n_cold
        return device, host

    def to_dict(self) -> dict:
        device, host = self.bytes()
        return {
            "policy": self.policy,
            "device_bytes": device,
            "host_bytes": host,
            "hot": {str(il): len(e) for il, e in sorted(self.hot.items())},
        }


def by_layers(
    f: GGUFFile, n_layer: int, n_expert: int, n_cpu_moe: int, padding: int = 0
) -> ExpertPlacement:
    """llama.cpp's ``--n-cpu-moe N``: all experts of the first N layers stay in host RAM."""
    layers = expert_layers(f, n_layer)
    sizes = {il: expert_bytes(f, il) for il in layers}
    hot = {il: () for il in layers[:n_cpu_moe]}
    return ExpertPlacement(f"n-cpu-moe {n_cpu_moe}", n_expert, hot, sizes, padding)


def by_hotness(
    f: GGUFFile,
    n_layer: int,
    n_expert: int,
    counts: np.ndarray | None,
    budget: int,
    padding: int = 0,
) -> ExpertPlacement:
    """The most chosen experts, over all layers, until ``budget`` bytes are on the device (with
    the ``padding`` experts a split layer's device part carries); the rest in host RAM. Without
    a profile every expert counts the same, and the budget goes to expert 0 of every layer, then
    expert 1, and so on: an even share per layer."""
    layers = expert_layers(f, n_layer)
    sizes = {il: expert_bytes(f, il) for il in layers}
    if counts is None:
        counts = np.zeros((n_layer, n_expert), dtype=np.int64)
    order = sorted(
        ((il, e) for il in layers for e in range(n_expert)),
        key=lambda le: (-int(counts[le[0], le[1]]), le[1], le[0]),
    )
    hot: dict[int, list[int]] = {il: [] for il in layers}
    left = budget
    for il, e in order:
        # the layer's first device expert brings its padding; its last one takes it away
        cost = sizes[il] * (1 + (padding if not hot[il] else 0))
        if len(hot[il]) == n_expert - 1:
            cost -= sizes[il] * padding
        if cost <= left:
            hot[il].append(e)
            left -= cost
    split = {il: tuple(sorted(e)) for il, e in hot.items() if len(e) < n_expert}
    source = "profile" if counts.any() else "no profile: an even share"
    policy = f"hotness ({source}), {budget / 2**20:,.1f} MiB of experts on the device"
    return ExpertPlacement(policy, n_expert, split, sizes, padding)


# --- the hotness profile ---


def profile_path(f: GGUFFile) -> Path:
    return cache_root() / "experts" / f"{f.identity()}.npz"


def profile_for(f: GGUFFile, config) -> Path:
    return Path(config.expert_profile) if config.expert_profile else profile_path(f)


class ExpertCounts:
    """How many tokens chose each expert of each layer, [n_layer, n_expert]."""

    def __init__(self, n_layer: int, n_expert: int, path: Path | None = None):
        self.counts = np.zeros((n_layer, n_expert), dtype=np.int64)
        self.path = path
        self.steps = 0

    @classmethod
    def load(cls, path: Path, n_layer: int, n_expert: int) -> ExpertCounts:
        """The counts saved at ``path`` (zeros if there is no file yet)."""
        out = cls(n_layer, n_expert, path)
        if path.is_file():
            with np.load(path) as data:
                saved = data["counts"]
            if saved.shape != out.counts.shape:
                raise ConfigError(
                    f"{path}: an expert profile of shape {saved.shape}, not {out.counts.shape}"
                    f" ({n_layer} layers x {n_expert} experts); remove it to start again"
                )
            out.counts += saved
        return out

    def add(self, layers: range, routing: np.ndarray) -> None:
        """One step's ``routing`` output [len(layers), k*T]: the experts each token chose."""
        rows = np.repeat(np.arange(layers.start, layers.stop), routing.shape[1])
        np.add.at(self.counts, (rows, routing.reshape(-1)), 1)
        self.steps += 1

    def save(self) -> None:
        """Add the counts so far to the file's (then start again from zero)."""
        if self.path is None:
            return
        n_layer, n_expert = self.counts.shape
        total = ExpertCounts.load(self.path, n_layer, n_expert).counts + self.counts
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, counts=total)
        os.replace(tmp, self.path)
        self.counts[:] = 0
        self.steps = 0


def skew(counts: np.ndarray, share: float = 0.1) -> float:
    """The fraction of all choices that went to the most chosen ``share`` of each layer's experts
    (0.1 of uniform routing: ``share`` itself)."""
    total = counts.sum()
    if not total:
        return 0.0
    top = max(1, round(counts.shape[1] * share))
    return float(np.sort(counts, axis=1)[:, -top:].sum() / total)


def report(counts: np.ndarray, k: int, top: int) -> dict:
    """What ``lucepy experts`` shows: per layer the tokens counted, the ``top`` most chosen
    experts with their share of the layer's choices, and the share of its top 10 %."""
    layers = []
    for il, row in enumerate(counts):
        total = int(row.sum())
        if not total:
            continue
        best = np.argsort(-row, kind="stable")[:top]
        layers.append(
            {
                "layer": il,
                "tokens": total // k,
                "top": [[int(e), round(float(row[e]) / total, 4)] for e in best],
                "top10pct_share": round(skew(row[None, :]), 4),
            }
        )
    return {"tokens": int(counts.sum()) // (k * max(1, len(layers))), "skew": skew(counts),
            "layers": layers}  # fmt: skip
