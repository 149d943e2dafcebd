"""tools/trace_gpu.py's share of the span by kernel (``critical``) and its decode-against-verify
table (``path``), on made-up kernel timelines: no GPU needed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "trace_gpu", Path(__file__).parent.parent / "tools" / "trace_gpu.py"
)
trace_gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_gpu)


def shares(calls):
    return {r["kernel"]: (r["us"], r["per_call"]) for r in trace_gpu.critical(calls)}


def test_a_kernel_launched_early_counts_only_what_it_adds_and_gaps_count_to_none():
    # norm runs 0-4; gemm starts early at 1 (waiting inside) and ends at 20; sum starts after an
    # idle gap at 22 and ends at 25; a kernel wholly inside gemm's time adds nothing
    call = [("norm", 0.0, 4.0), ("gemm", 1.0, 20.0), ("inside", 5.0, 9.0), ("sum", 22.0, 25.0)]
    got = shares([call, list(reversed(call))])  # (start order is the kernels' own)
    assert got == {
        "norm": (4.0, 1),
        "gemm": (16.0, 1),
        "inside": (0.0, 1),
        "sum": (3.0, 1),
        "idle": (2.0, 0),
    }
    assert sum(us for us, _ in got.values()) == pytest.approx(25.0)  # the span


def test_the_path_table_puts_what_the_verify_adds_first():
    decode = {"critical_path": trace_gpu.critical([[("gemv", 0.0, 10.0), ("norm", 10.0, 12.0)]])}
    verify = {
        "critical_path": trace_gpu.critical(
            [[("gemm", 0.0, 15.0), ("norm", 15.0, 17.0), ("sum", 17.0, 20.0)]]
        )
    }
    table = trace_gpu.path(decode, verify)
    assert table.startswith("Share of the span, us a call: a decode 12.0, a verify 20.0")
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| `")]
    assert rows == ["`gemm`", "`sum`", "`norm`", "`gemv`"]
    assert "| `gemv` | 10.0 (1) | 0.0 (0) | -10.0 |" in table
