"""Which engine blocks hold bytes a copy may read: the write fence.

vLLM puts a block into its prefix cache when it *allocates* it for the
tokens a step will compute, before that step's forward writes it. A second
request scheduled in the same step (or, with asynchronous scheduling, in
the step after) hits the block: for the scheduler its tokens are
"computed", but its bytes exist only once that forward ran. kvbm copies on
its own threads and streams, unordered with the model's forward, so a copy
of such a block must wait until the forward that writes it is known to
have finished, whoever asks for the copy.

The fence numbers the scheduler's steps (one per ``build_connector_meta``)
and remembers, per engine block id, the last step whose forward writes it.
vLLM keeps at most ``max_concurrent_batches`` (B) scheduled steps whose
output it has not processed, and schedules step s + B only after it
processed the output of step s. So while step s is being built, every
forward up to s - B has finished; anywhere else (a request finishing or
aborted between or inside output processing), every forward up to
s - B + 1 has. With B = 1 (synchronous scheduling) a request finishing
therefore reads every block it computed at once, and a block written by
step s is readable from step s + 1's metadata on.

A load that failed leaves its blocks holding garbage until vLLM recomputes
them: they are *poisoned* (never copied out) until a forward writes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvbm_py import InvalidArgumentError


class WriteFence:
    """Tracks the forwards still writing engine blocks (see the module
    doc). Not thread-safe: vLLM's scheduler calls the connector from one
    thread."""

    def __init__(self, concurrent_batches: int) -> None:
        if concurrent_batches < 1:
            raise InvalidArgumentError(f"kvbm: {concurrent_batches} concurrent batches")
        #: vLLM's ``max_concurrent_batches``: scheduled steps in flight.
        self.batches = concurrent_batches
        #: The step being built or last built (0 before the first).
        self.step = 0
        #: Whether ``build_connector_meta`` of `step` is running.
        self.building = False
        #: Engine block id -> the last step whose forward writes it.
        self._writes: dict[int, int] = {}
        #: Engine block ids holding the garbage of a failed load.
        self._poisoned: set[int] = set()

    def begin_step(self) -> None:
        """``build_connector_meta`` of a new step started."""
        self.step += 1
        self.building = True
        done = self.done()
        if self._writes:
            self._writes = {b: s for b, s in self._writes.items() if s > done}

    def end_step(self) -> None:
        """``build_connector_meta`` returned: the step's forward may run."""
        self.building = False

    def done(self) -> int:
        """The last step whose forward is known to have finished now."""
        return self.step - self.batches + (0 if self.building else 1)

    def writes(self, block_ids: Iterable[int]) -> None:
        """The forward of the step being built writes `block_ids` (a garbage
        block written by a forward is whole again once that forward ran)."""
        for b in block_ids:
            self._writes[b] = self.step
            self._poisoned.discard(b)

    def poison(self, block_ids: Iterable[int]) -> None:
        """A load into `block_ids` failed: nothing may copy them out until
        a forward rewrote them."""
        self._poisoned.update(block_ids)

    def whole(self, block_ids: Iterable[int]) -> None:
        """A load into `block_ids` landed: their bytes are whole."""
        self._poisoned.difference_update(block_ids)

    def clean_prefix(self, block_ids: Sequence[int]) -> int:
        """How many leading blocks of `block_ids` are not poisoned."""
        if not self._poisoned:
            return len(block_ids)
        for i, b in enumerate(block_ids):
            if b in self._poisoned:
                return i
        return len(block_ids)

    def written_by(self, block_ids: Iterable[int]) -> int:
        """The step whose forward must have finished before `block_ids`
        can be read (0: none is being written)."""
        return max((self._writes.get(b, 0) for b in block_ids), default=0)

    def is_done(self, step: int) -> bool:
        """Whether the forward of `step` (from :meth:`written_by`) is known
        to have finished; step 0, no forward, always is."""
        return step <= 0 or step <= self.done()
