"""What a model with sliding-window layers on rings (``RingKVCache``) does the same way: gemma4
and laguna. Full layers read ``mask``/``rows`` over the cache; sliding ones ``mask_swa``/
``rows_swa`` over a ring of the window plus the longest step, padded to 256 rows. The mixin reads
``self.p.window`` (0: no sliding layers), ``self.options`` and the model's ``make_state``."""

from __future__ import annotations

from lucepy.errors import ConfigError
from lucepy.models.base import GraphSpec
from lucepy.models.batch import StepBatch, StepInput
from lucepy.models.builder import Builder
from lucepy.models.state import spec_nbytes, state_specs


class SlidingWindow:
    def ring_rows(self) -> int:
        """Rows of a sliding layer's ring, for a context larger than the ring (a smaller context
        gets a ring of its own size, which never wraps, so positions map the same)."""
        return self.options.ring_rows(self.p.window, 0)

    def ring_note(self, sliding: list[int], n_ctx: int) -> str:
        """The plan's line about the rings of the ``sliding`` layers that hold a cache."""
        if not sliding:
            return ""
        states = [s for s in self.make_state(range(self.p.n_layer), n_ctx) if s.layer in sliding]
        ring = sum(spec_nbytes(t, shape) for t, shape in state_specs(states).values())
        rows = self.options.ring_rows(self.p.window, n_ctx)
        return (
            f"sliding-window KV: {len(sliding)} layers keep a ring of {rows} rows (window "
            f"{self.p.window} + step {self.options.max_step}, padded to 256), "
            f"{ring / 2**20:.1f} MiB in all, not the context of {n_ctx}"
        )

    def step_inputs(self, batch: StepBatch, names) -> dict[str, StepInput]:
        out = {"tokens": batch.tokens, "pos": batch.pos}
        if "mask" in names:
            out["mask"] = batch.mask_input()
            out["rows"] = batch.slots
        if "mask_swa" in names:
            ring = batch.ring(self.ring_rows(), self.ring_span(batch))
            out["mask_swa"] = ring.mask_input(self.p.window)
            out["rows_swa"] = ring.slots
        return {k: v for k, v in out.items() if k in names}

    def ring_span(self, batch: StepBatch) -> int:
        """The ring's rows that positions before the step's end have filled: the ring follows
        positions, not the cache rows a KV Flash pool gives the full layers."""
        return min(self.ring_rows(), batch.n_span) if self.p.window else 0

    def check_step(self, spec: GraphSpec, sliding: bool) -> None:
        """Refuse a step that the cache window, or (with ``sliding`` layers) the ring, cannot
        hold."""
        T = spec.n_tokens
        if T > spec.n_kv:
            raise ConfigError(f"{T} tokens do not fit a {spec.n_kv}-row attention window")
        if sliding and T > self.options.max_step:
            raise ConfigError(
                f"a step of {T} tokens is longer than the sliding-window ring allows "
                f"({self.options.max_step}); feed at most that many tokens per step"
            )

    def kv_inputs(self, g: Builder, spec: GraphSpec, kinds: set[bool]) -> None:
        """The mask and row inputs of the layer kinds (True: sliding) this graph holds."""
        T = spec.n_tokens
        if False in kinds:
            g.input_f16("mask", spec.n_kv, T)  # 0 where a token may attend, -inf elsewhere
            g.input_i64("rows", T)
        if True in kinds:
            g.input_f16("mask_swa", spec.ring, T)
            g.input_i64("rows_swa", T)
