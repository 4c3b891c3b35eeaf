"""Request slots of the vLLM plugin (pure Python, runs without vLLM)."""

import pytest

from kvarn_compile.integrations.vllm.slots import RequestSlots


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
