"""A graph's host-written inputs (runtime/graphs.py, InputBlock): one buffer, one copy a step."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import THREADS

from lucepy.ggml import ffi
from lucepy.models.batch import StepBatch
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine


def test_step_inputs_land_in_the_graphs_input_buffer_and_are_checked(tiny_model):
    with Engine(tiny_model("base", "f32"), RuntimeConfig(threads=THREADS, max_ctx=256)) as e:
        e.prefill([1, 2, 3, 4])
        e.decode(7)
        [g] = [g for s, g in e.shard.graphs.items() if s.n_tokens == 1]
        step, constants = g.blocks
        assert {"tokens", "pos", "mask", "rows"} <= set(step.arrays)
        assert "x" not in step.arrays  # carried inputs stay in the compute buffer
        lib = e.lib
        for name in ("tokens", "pos", "rows"):
            t = g.inputs[name]
            got = np.empty(step.arrays[name].size, dtype=step.arrays[name].dtype)
            lib.ggml_backend_tensor_get(t, ffi.from_buffer(got), 0, got.nbytes)
            np.testing.assert_array_equal(got, step.arrays[name])
        assert int(step.arrays["tokens"][0]) == 7
        assert int(step.arrays["rows"][0]) == 4  # the fifth position's cache row
        # the mask written in place (StepBatch.mask_input): rows 0-4 seen, every other -inf
        mask = step.arrays["mask"]
        assert np.flatnonzero(mask == 0).tolist() == [0, 1, 2, 3, 4]
        assert np.isneginf(np.delete(mask, range(5))).all()
        with pytest.raises(ValueError, match="takes"):
            g.write_inputs({"pos": np.zeros(1, dtype=np.int64)})
        with pytest.raises(ValueError, match="takes"):
            g.write_inputs({"tokens": np.zeros(2, dtype=np.int32)})
        # a mask written in place is checked as an array is: another step's size is refused,
        # the graph's array left as it was
        other = e.pipeline.slots.batch(np.zeros(3, dtype=np.int32), 5)
        before = mask.copy()
        with pytest.raises(ValueError, match="input mask: got 768 float16, the graph takes 256"):
            g.write_inputs({"mask": other.mask_input()})
        np.testing.assert_array_equal(step.arrays["mask"], before)


def _mask_by_definition(b: StepBatch, window: int, causal: bool) -> np.ndarray:
    """StepBatch.mask's docstring, one token and row at a time."""
    out = np.empty((b.n_tokens, b.n_kv), dtype=np.float16)
    for t in range(b.n_tokens):
        p = int(b.pos[t]) if causal else int(b.pos.max())
        for r in range(b.n_kv):
            if b.streams:
                ok = r <= p
            else:
                c = int(b.cell_pos[r])
                ok = c >= 0 and b.cell_seq[r] == b.seq[t] and c <= p
                ok = ok and (window <= 0 or p - c < window)
                ok = ok and (b.cell_until is None or p < b.cell_until[r])
            out[t, r] = 0 if ok else -np.inf
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_steps_mask_is_its_definition_whether_made_or_written_in_place(seed):
    rng = np.random.default_rng(seed)
    T, n_kv, nseq = int(rng.integers(1, 12)), int(rng.integers(1, 70)), int(rng.integers(1, 4))
    pos = rng.integers(0, 90, T).astype(np.int32)
    seq = (rng.integers(0, nseq, T) if seed % 2 else np.zeros(T)).astype(np.int32)
    b = StepBatch(
        tokens=np.zeros(T, np.int32),
        pos=pos,
        seq=seq,
        slots=pos.astype(np.int64),
        cell_pos=rng.integers(-1, 90, n_kv).astype(np.int32),
        cell_seq=rng.integers(0, nseq, n_kv).astype(np.int32),
        cell_until=rng.integers(0, 120, n_kv).astype(np.int32) if seed % 3 == 0 else None,
    )
    if seed == 5:
        b = replace(b, streams=1, stream_rows=n_kv)
    for window, causal in ((0, True), (int(rng.integers(1, 40)), True), (0, False)):
        want = _mask_by_definition(b, window, causal)
        made = b.mask(window, causal)
        flat = np.full(T * n_kv, np.nan, dtype=np.float16)  # (every value written over)
        fill = b.mask_input(window, causal)
        assert (fill.size, fill.dtype) == (T * n_kv, np.float16)
        fill.fill(flat)
        for got in (made, flat.reshape(T, n_kv)):
            assert got.dtype == np.float16
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
