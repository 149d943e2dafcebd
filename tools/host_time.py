"""Where a step's wall time goes on the host: lucepy's decode steps (the logits read back,
then their argmax alone as a greedy loop reads it), then 16-token verify-and-rollback calls,
each call split by phase (medians over --calls of each kind).

    python tools/host_time.py MODEL [--device cuda:0] [--calls 40] [--json OUT]

Phases, timed by wrapping what lucepy.runtime.shard calls, in this process:
- inputs: ``CompiledGraph.write_inputs`` (the numpy writes and the one queued copy);
- compute: ``graphs.compute`` waited for (a decode's, a verify's: the launch and the wait for
  the GPU);
- launch: ``graphs.compute`` not waited for (a rollback's, left running on a GPU);
- read: ``graphs.get`` (the logits or the argmaxes copied to the host);
- python: the rest of the call (the engine's, the pipeline's and the shard's own work).

The GPU's own time per call is ``tools/trace_gpu.py trace``'s span; ``compute`` less that span
is the launch and the wait's own cost.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

from bench_gpu import verify_step

PHASES = ("inputs", "compute", "launch", "read")


class PhaseClock:
    """Seconds spent in each phase since ``reset``."""

    def __init__(self) -> None:
        self.spent: collections.Counter[str] = collections.Counter()

    def reset(self) -> None:
        self.spent.clear()

    def wrap(self, phase, fn):
        """``fn`` timed as ``phase``, or as ``phase(kwargs)`` where that is a function."""

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = phase(kwargs) if callable(phase) else phase
                self.spent[spent] += time.perf_counter() - t0

        return timed


@contextmanager
def timed_phases(clock: PhaseClock):
    """lucepy.runtime.shard's compute and get and CompiledGraph.write_inputs, timed by ``clock``
    while inside."""
    from lucepy.runtime import graphs, shard

    saved = (shard.compute, shard.get, graphs.CompiledGraph.write_inputs)
    # a compute not waited for (a rollback's left running) is its launch alone
    shard.compute = clock.wrap(
        lambda kw: "launch" if kw.get("wait") is False else "compute", saved[0]
    )
    shard.get = clock.wrap("read", saved[1])
    graphs.CompiledGraph.write_inputs = clock.wrap("inputs", saved[2])
    try:
        yield
    finally:
        shard.compute, shard.get, graphs.CompiledGraph.write_inputs = saved


def split(calls: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Medians, us, of each phase and of the call's wall time, and the rest (python)."""
    out = {p: 1e6 * statistics.median(spent.get(p, 0.0) for _, spent in calls) for p in PHASES}
    walls = [wall - sum(spent.values()) for wall, spent in calls]
    out["python"] = 1e6 * statistics.median(walls)
    out["wall"] = 1e6 * statistics.median(wall for wall, _ in calls)
    return {k: round(v, 1) for k, v in out.items()}


def measure(engine, calls: int, block: int = 16) -> dict[str, dict[str, float]]:
    """``calls`` decode steps one after another, as many greedy ones, then as many
    verify-and-rollback calls (as a plain decode and a DFlash loop run them), each kind after a
    warm-up of its own."""
    clock = PhaseClock()
    tokens = [5 + i for i in range(block)]
    engine.reset()
    engine.prefill(list(range(3, 67)))

    out = {}
    with timed_phases(clock):
        steps = {
            "decode": lambda: engine.decode(5),  # the logits read back
            "greedy decode": lambda: engine.decode_greedy(5),  # their argmax alone
            "verify": lambda: verify_step(engine, tokens),
        }
        for kind, step in steps.items():
            runs = []
            for i in range(calls + 3):
                clock.reset()
                t0 = time.perf_counter()
                step()
                wall = time.perf_counter() - t0
                if i >= 3:  # (warm-up: graphs built, caches filled)
                    runs.append((wall, dict(clock.spent)))
            out[kind] = split(runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()
    from lucepy.runtime.config import RuntimeConfig
    from lucepy.runtime.engine import Engine

    cfg = RuntimeConfig(device=args.device, max_ctx=2048)
    with Engine(args.model, cfg, tokenizer=False) as engine:
        out = measure(engine, args.calls)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
