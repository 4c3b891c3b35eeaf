"""Request slots of the vLLM plugin (pure Python, runs without vLLM)."""

import pytest

from kvarn_compile.integrations.vllm.slots import RequestSlots, rows_reading_pages_written_in_step
from kvarn_compile.integrations.vllm.speculative import Row, plan_step


def test_a_request_keeps_its_slot_while_rows_move():
    slots = RequestSlots(3)
    slots.update(["a", "b", "c"], released=())
    first = dict(zip("abc", slots.rows(3)))
    assert sorted(first.values()) == [0, 1, 2]
    slots.update(["c", "a"], released=["b"])  # b finished, condense moved c into row 0
    assert slots.rows(2) == [first["c"], first["a"]]
    slots.update(["c", "a", "d"], released=())  # d takes the slot b gave back
    assert slots.rows(3)[2] == first["b"]


def test_rows_outside_a_step_get_the_scratch_slot():
    slots = RequestSlots(2)
    assert slots.num_slots == 3 and slots.scratch == 2
    assert slots.rows(2) == [2, 2]  # profiling before any step
    slots.update(["a"], released=())
    assert slots.rows(3) == [0, 2, 2]  # padded rows of a real step
    with slots.no_requests():  # a dummy run inside a step
        assert slots.rows(1) == [2]
    assert slots.rows(1) == [0]


def test_preempted_and_finished_requests_give_their_slots_back():
    slots = RequestSlots(2)
    slots.update(["a", "b"], released=())
    slots.update(["c"], released=["a", "b"])
    assert list(slots.live()) == ["c"]
    slots.update(["c", "a"], released=())  # a resumes after preemption: a fresh slot (it restarts at a tile)
    live = slots.live()
    assert sorted(live) == ["a", "c"] and sorted(live.values()) == [0, 1]


def test_more_live_requests_than_slots_is_an_error_not_a_shared_slot():
    slots = RequestSlots(2)
    slots.update(["a", "b"], released=())
    with pytest.raises(RuntimeError, match="more than max_num_seqs=2 live requests"):
        slots.update(["a", "b", "c"], released=())
    with pytest.raises(ValueError, match="max_requests must be >= 1"):
        RequestSlots(0)


def test_rows_reading_pages_written_in_the_same_step():
    """Tiles of 4 tokens. Row 0 prefills 10 tokens into blocks [7, 8, 9] (completing 7 and 8); rows 1-3 are new
    and start at 8 (a hit on two blocks): 1 on 7 and 8 (late), 2 on 7 and 5 (late: 7), 3 on 5 and 6 (not).
    Row 4 is a running request reading 7: never late (it wrote or read 7 in an earlier step)."""
    new = [True, True, True, True, False]
    starts, counts = [0, 8, 8, 8, 8], [10, 2, 2, 2, 1]
    blocks = [([7, 8, 9],), ([7, 8, 10],), ([7, 5, 11],), ([5, 6, 12],), ([7, 8, 13],)]
    assert rows_reading_pages_written_in_step(new, starts, counts, blocks, 4) == [1, 2]
    # a page completed in another KV-cache group (another layer kind's blocks) is another page
    assert rows_reading_pages_written_in_step(new, starts, counts, [(b[0], []) for b in blocks], 4) == [1, 2]
    assert rows_reading_pages_written_in_step(new, starts, counts, [([], b[0]) for b in blocks][:1] + blocks[1:],
                                              4) == []  # fmt: skip
    # no new row with a hit: nothing to look at
    assert rows_reading_pages_written_in_step([True, False], [0, 8], [10, 1], [([7, 8, 9],), ([7, 8, 9],)], 4) == []
    slots = RequestSlots(4)
    slots.update(["a", "b"], released=())
    slots.find_late([0, 8], [10, 2], [([7, 8, 9],), ([7, 8, 10],)], 4)
    assert slots.late(2) == [1] and slots.late(1) == []
    with slots.no_requests():
        assert slots.late(2) == []
    slots.update(["a", "b"], released=())  # the next step: found again or not at all
    assert slots.late(2) == []


def row(slot, tokens, drafts, start, committed, new=False):
    return Row(slot, tokens, drafts, start, committed, new)


def test_speculative_plan_commits_accepted_drafts_and_stages_new_ones():
    # step 1: slot 0 decodes its certain token + 3 drafts; slot 1 prefills 10 tokens
    plan = plan_step([row(0, 4, 3, 50, 50), row(1, 10, 0, 0, 0, new=True)], {})
    assert plan.catch_up == []
    assert plan.certain_tokens == [0, *range(4, 14)] and plan.certain_counts == [1, 10]
    assert plan.stage == [(1, 0, 0), (2, 0, 1), (3, 0, 2)]
    # step 2: vLLM accepted 2 of the 3 drafts: slot 0 continues at 53 (51 committed + 2)
    plan = plan_step([row(0, 3, 2, 53, 51), row(1, 1, 0, 10, 10)], plan.staged_after)
    assert plan.catch_up == [(0, 2, 51)]
    assert plan.staged_after == {0: 2, 1: 0}


def test_speculative_plan_ignores_a_new_requests_stale_slot_and_refuses_a_mismatch():
    staged = {0: 3}
    # slot 0 was freed and taken by a new request (prefix-cache hit at 128): nothing to commit
    assert plan_step([row(0, 5, 0, 128, 57, new=True)], staged).catch_up == []
    with pytest.raises(RuntimeError, match="holds 51 tokens and 3 staged drafts, but vLLM continues it at position 55"):
        plan_step([row(0, 1, 0, 55, 51)], staged)  # more accepted than were staged
    with pytest.raises(RuntimeError, match="continues it at position 50"):
        plan_step([row(0, 1, 0, 50, 51)], staged)  # behind what the cache holds


def test_request_slots_plan_once_per_step_for_every_builder():
    slots = RequestSlots(4)
    slots.update(["a"], released=[], drafts=[2])
    first = slots.speculative_plan([3], [40], [40])
    assert slots.speculative_plan([3], [40], [40]) is first  # a second KV-cache group's builder
    slots.update(["a"], released=[], drafts=[0])
    assert slots.speculative_plan([1], [42], [41]).catch_up == [(0, 1, 41)]
    slots.update(["a"], released=[], drafts=[0])
    assert slots.speculative_plan([1], [43], [43]) is None  # nothing drafted or staged: the plain path
