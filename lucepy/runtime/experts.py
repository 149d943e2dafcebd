"""Where a MoE model's routed experts live (issue 12), and the hotness profile that decides it.

A layer's experts are "hot" (with the layer, on its shard's device) or "cold" (in host RAM,
computed by a CPU backend in the same step: ``runtime/shard.py`` runs such a layer's graph through
``ggml_backend_sched``; or, with ``reads``, computed by the device, which reads them there). Two
policies choose:

- by hotness, under a byte budget for experts on the device (``--moe-gpu-mb``): the placement
  whose decode step leaves the host the least work, given how often tokens chose each expert
  (whole layers on the device, or a layer's most chosen experts there and the rest on the host);
- by layer, as llama.cpp's ``--n-cpu-moe N``: every expert of the first N layers is cold.

The profile counts, per layer and expert, how many tokens chose it. Engines count while they run
(the ``routing`` output of prompt and verify steps, one read for all layers; decode steps count
nothing, their read was too dear) and save the counts beside the caches,
``<cache>/experts/<model identity>.npz``, where the next start's placement and
``lucepy experts`` find them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
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
    k, reads = params.n_expert_used, config.cold_experts == "device"
    if config.n_cpu_moe:
        return by_layers(f, params.n_layer, n_expert, config.n_cpu_moe, k, reads)
    counts = ExpertCounts.load(profile_for(f, config), params.n_layer, n_expert).counts
    budget = int(config.moe_device_mb * 2**20)
    granule = READ_GRANULE if reads and config.beyond_cpus else 0
    return by_hotness(f, params.n_layer, n_expert, counts, budget, k, reads, granule)


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
    reads: bool = False  # the device computes the cold experts, reading them from host RAM

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
            "cold_experts": "device" if self.reads else "cpu",
            "device_bytes": device,
            "host_bytes": host,
            "hot": {str(il): len(e) for il, e in sorted(self.hot.items())},
        }


def by_layers(
    f: GGUFFile, n_layer: int, n_expert: int, n_cpu_moe: int, padding: int = 0,
    reads: bool = False,
) -> ExpertPlacement:  # fmt: skip
    """llama.cpp's ``--n-cpu-moe N``: all experts of layers 0..N-1 stay in host RAM (counted
    by layer index, dense layers too: laguna's leading dense layer is one of the N)."""
    layers = expert_layers(f, n_layer)
    sizes = {il: expert_bytes(f, il) for il in layers}
    hot = {il: () for il in layers if il < n_cpu_moe}
    return ExpertPlacement(f"n-cpu-moe {n_cpu_moe}", n_expert, hot, sizes, padding, reads)


# A layer split between the device and host RAM costs a decode step about this much on top of
# its host experts' reads, counted in reads of one expert: the trip to the host and back, the
# synchronisation and the host graph. Fitted on two H200 machines (tools/bench_moe.py): 0.26 ms
# a split and 0.021 ms a read (12.4), 0.23 and 0.034 ms (6.8). docs/BENCHMARKS.md, issue 12.
SPLIT_COST = 10.0
# A layer read by the device from host RAM maps its hot experts' bytes of each matrix in whole
# units of this (CUDA's virtual memory granularity on the H200): ggml/vmm.py.
READ_GRANULE = 2 << 20


def by_hotness(
    f: GGUFFile,
    n_layer: int,
    n_expert: int,
    counts: np.ndarray | None,
    budget: int,
    k: int = 0,
    reads: bool = False,
    granule: int = 0,
) -> ExpertPlacement:
    """The placement under ``budget`` bytes of experts on the device that costs a decode step
    the least host work, with ``counts`` (the profile) as the odds that a token chooses each
    expert; ``k`` experts per token.

    A layer may keep all its experts on the device (no host work), or its ``n`` most chosen ones
    plus ``k`` padding experts (runtime/shard.py) and the rest in host RAM. Then a token costs
    ``SPLIT_COST`` plus one read per cold expert it chooses (one read when it chooses none: the
    host part still runs). Over the layers this is a knapsack, solved exactly by dynamic
    programming over the budget in units of one expert. Without a profile every expert is as
    likely, no split pays, and whole layers go to the device (llama.cpp's ``--n-cpu-moe``, from
    the last layers back).

    When the device ``reads`` its cold experts from host RAM, a layer is one tensor per matrix
    over both memories (runtime/shard.py's ReadExperts): a token costs one read over the bus
    per cold expert it chooses, nothing else, and no padding experts; each split layer's device
    part is rounded up to the mapping ``granule`` (on a GPU), which the budget sets aside first."""
    layers = expert_layers(f, n_layer)
    sizes = {il: expert_bytes(f, il) for il in layers}
    if counts is None:
        counts = np.zeros((n_layer, n_expert), dtype=np.int64)
    unit = min(sizes.values())
    if reads:  # each layer's device part may round up by one granule a matrix
        budget = max(0, budget - len(layers) * len(EXPERT_TENSORS) * granule)
    units = budget // unit
    best = np.zeros(units + 1)  # least host cost of the layers so far within b units
    picks = []
    for il in layers:
        order, cost, size = layer_options(counts[il], k, -(-sizes[il] // unit), reads)
        new, pick = np.full(units + 1, np.inf), np.zeros(units + 1, dtype=np.int32)
        for n in range(n_expert, -1, -1):  # ties: more on the device, so the later layers
            if size[n] > units:
                continue
            cand = best[: units + 1 - size[n]] + cost[n]
            better = cand < new[size[n] :]
            new[size[n] :][better] = cand[better]
            pick[size[n] :][better] = n
        best = new
        picks.append((il, order, pick, size))
    split, b = {}, units
    for il, order, pick, size in reversed(picks):
        n = int(pick[b])
        b -= int(size[n])
        if n < n_expert:
            split[il] = tuple(sorted(int(e) for e in order[:n]))
    source = "profile" if counts.any() else "no profile: whole layers"
    if reads:
        source += "; the rest read by the device"
    policy = f"hotness ({source}), {budget / 2**20:,.1f} MiB of experts on the device"
    padding = 0 if reads else k
    return ExpertPlacement(policy, n_expert, dict(sorted(split.items())), sizes, padding, reads)


def layer_options(
    row: np.ndarray, k: int, size: int, reads: bool = False
) -> tuple[np.ndarray, ...]:
    """For a layer whose experts were chosen ``row`` times: its experts, most chosen first (ties
    to the lower index), and for each ``n`` of them on the device (0..n_expert) the host cost of
    a decode step (``by_hotness``) and the device units it takes."""
    X = len(row)
    order = np.argsort(-row, kind="stable")
    total = row.sum()
    odds = np.full(X, k / X) if not total else np.minimum(1.0, row[order] * k / total)
    cold = np.concatenate([np.cumsum(odds[::-1])[::-1], [0.0]])  # sum over experts n..X-1
    with np.errstate(divide="ignore"):
        log_none = np.log1p(-odds)
    none = np.exp(np.concatenate([np.cumsum(log_none[::-1])[::-1], [0.0]]))
    cost = cold if reads else SPLIT_COST + cold + none
    cost[X] = 0.0
    n = np.arange(X + 1)
    units = n * size if reads else np.where(n == 0, 0, (n + k) * size)
    units[X] = X * size
    return order, cost, units


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

    def add(self, layers: Sequence[int], routing: np.ndarray) -> None:
        """One step's ``routing`` output [len(layers), k*T]: the experts each token chose in each
        of ``layers`` (a graph's MoE layers; a leading dense layer has no row)."""
        # one bincount over (layer, expert) cells: a third of np.add.at's time (1.3 ms for a
        # 512-token prompt of 40 layers, 3 % of its prefill on the H200)
        X = self.counts.shape[1]
        cells = (np.asarray(layers, dtype=np.int64)[:, None] * X + routing).reshape(-1)
        self.counts += np.bincount(cells, minlength=self.counts.size).reshape(self.counts.shape)
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
