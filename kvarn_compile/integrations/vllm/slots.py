"""Stable cache slots for vLLM requests (pure Python: no vLLM import).

KVarN keeps the tokens of each sequence's current, incomplete tile unquantized, in a small pool of
exact tiles beside vLLM's paged KV cache; a slot of that pool belongs to one request for its whole
life. vLLM identifies a request only by its row in the persistent batch, and rows move (``condense``
fills holes, backends may reorder), so the model runner's step update tells this table which request
is in which row and which requests finished or were preempted (``compat.track_request_slots``).

Rows that belong to no request of a real step (profiling and warm-up runs, CUDA-graph padding) are
given the last slot, a scratch slot no request ever owns, so they never touch a live request's tile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from .speculative import Plan, Row, plan_step


class RequestSlots:
    """Maps request ids to slots ``0 .. max_requests-1``; slot ``max_requests`` is the scratch slot."""

    def __init__(self, max_requests: int):
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.max_requests = max_requests
        self._slot_of: dict[str, int] = {}
        self._free = list(range(max_requests - 1, -1, -1))  # pop() hands out the lowest slot first
        self._rows: list[int] | None = None  # slot of each batch row during a real step, else None
        self._new: list[bool] = []  # per row: its request took this slot in this step
        self._drafts: list[int] = []  # per row: speculative draft tokens it carries in this step
        self._step = 0
        self._plan: tuple[int, Plan] | None = None  # (step, plan): one plan per step for all builders
        self._staged: dict[int, int] = {}  # slot -> drafts staged by its last step (speculative decoding)
        self._late: list[int] = []  # rows whose prefix-cache hit reads pages this step writes (``find_late``)

    @property
    def num_slots(self) -> int:
        """Slots to allocate: one per request the scheduler may run at once, plus the scratch slot."""
        return self.max_requests + 1

    @property
    def scratch(self) -> int:
        return self.max_requests

    def update(self, row_req_ids: Iterable[str], released: Iterable[str], drafts: Iterable[int] = ()) -> None:
        """A step begins: ``released`` requests (finished or preempted) give their slots back, then
        every request of the batch, in row order, keeps its slot or takes a free one. ``drafts``: the
        speculative draft tokens of each row (none when not given).

        A preempted request restarts from a tile boundary (vLLM recomputes it from scratch or from
        prefix-cached full blocks), so nothing in its old slot is needed again.
        """
        for req_id in released:
            slot = self._slot_of.pop(req_id, None)
            if slot is not None:
                self._free.append(slot)
        rows, new = [], []
        for req_id in row_req_ids:
            slot = self._slot_of.get(req_id)
            new.append(slot is None)
            if slot is None:
                if not self._free:
                    raise RuntimeError(
                        f"KVarN: more than max_num_seqs={self.max_requests} live requests hold a current "
                        f"tile; a request finished or preempted without the model runner saying so"
                    )
                slot = self._slot_of[req_id] = self._free.pop()
            rows.append(slot)
        self._rows, self._new, self._late = rows, new, []
        self._drafts = list(drafts) or [0] * len(rows)
        self._step += 1

    def has_new_rows(self) -> bool:
        """Whether a request of this step took its slot in it (a new or resumed request)."""
        return any(self._new)

    def find_late(self, starts: list[int], counts: list[int], blocks: list, tile: int) -> None:
        """After ``update``: record the rows of this step that read pages another row of it writes
        (``rows_reading_pages_written_in_step``; per row: vLLM's start position, tokens in the step, its block ids
        per KV-cache group)."""
        self._late = rows_reading_pages_written_in_step(self._new, starts, counts, blocks, tile)

    def late(self, num_rows: int) -> list[int]:
        """The rows among the first ``num_rows`` that ``find_late`` found (none outside a real step)."""
        return [row for row in self._late if row < num_rows] if self._rows is not None else []

    @contextlib.contextmanager
    def no_requests(self) -> Iterator[None]:
        """Inside, batch rows belong to no request (a dummy run in the middle of a step)."""
        saved, self._rows = self._rows, None
        try:
            yield
        finally:
            self._rows = saved

    def rows(self, num_rows: int) -> list[int]:
        """The slot of each of the first ``num_rows`` batch rows; rows past the step's requests (or all
        rows outside a real step) get the scratch slot."""
        known = self._rows or []
        return known[:num_rows] + [self.scratch] * max(0, num_rows - len(known))

    def speculative_plan(self, num_tokens: list[int], starts: list[int], committed: list[int]) -> Plan | None:
        """This step's ``speculative.plan_step`` (made once, shared by every KV-cache group's builder), or
        None outside a real step or when no row carries or left drafts. Per row: tokens in the step,
        vLLM's start position, tokens the cache holds for its slot."""
        if self._rows is None:
            return None
        if self._plan is None or self._plan[0] != self._step:
            rows = [Row(slot, n, d, start, held, new) for slot, n, d, start, held, new in
                    zip(self._rows, num_tokens, self._drafts, starts, committed, self._new)]  # fmt: skip
            if not any(self._drafts) and not any(self._staged.get(r.slot, 0) and not r.new for r in rows):
                self._plan = (self._step, None)
            else:
                plan = plan_step(rows, self._staged)
                self._staged = plan.staged_after
                self._plan = (self._step, plan)
        return self._plan[1]

    def live(self) -> dict[str, int]:
        return dict(self._slot_of)


def rows_reading_pages_written_in_step(new: list[bool], starts: list[int], counts: list[int], blocks: list,
                                       tile: int) -> list[int]:  # fmt: skip
    """The rows whose prefix-cache hit reads a page that another row of the same step completes: vLLM caches a
    block as soon as it schedules it full, so a request admitted in the same step (the same prompt twice, a shared
    system prompt, ``n > 1``) can hit blocks before their tokens are computed. vLLM's own backends write every row's
    keys before any row attends; KVarN's ops attend over the cache as it was, then append. Only a row in its first
    step in a slot (``new``) reads pages it did not write itself. Per row: vLLM's start position, its tokens in the
    step, its block ids per KV-cache group (block i holds tile i)."""
    if not any(is_new and start >= tile for is_new, start in zip(new, starts)):
        return []
    written = {}
    for row, (start, count, groups) in enumerate(zip(starts, counts, blocks)):
        for group, ids in enumerate(groups):
            for tile_index in range(start // tile, min((start + count) // tile, len(ids))):
                written[group, ids[tile_index]] = row
    return [row for row, (is_new, start, groups) in enumerate(zip(new, starts, blocks))
            if is_new and any(written.get((group, ids[i]), row) != row
                              for group, ids in enumerate(groups) for i in range(min(start // tile, len(ids))))]  # fmt: skip


_PROCESS_SLOTS: RequestSlots | None = None


def start_request_slots(max_requests: int) -> RequestSlots:
    """A fresh table for this process, made when a model runner starts: an engine made after another one in
    the same process (a notebook, a test) starts with no live requests and its own max_num_seqs."""
    global _PROCESS_SLOTS
    _PROCESS_SLOTS = RequestSlots(max_requests)
    return _PROCESS_SLOTS


def request_slots(max_requests: int) -> RequestSlots:
    """The table of this process (a vLLM worker serves one model at a time: one table for all its layers)."""
    if _PROCESS_SLOTS is None:
        return start_request_slots(max_requests)
    if _PROCESS_SLOTS.max_requests != max_requests:
        raise RuntimeError(
            f"KVarN: request slots were made for max_num_seqs={_PROCESS_SLOTS.max_requests}, "
            f"now asked for {max_requests}"
        )
    return _PROCESS_SLOTS
