"""The write fence's step accounting (kvbm_py.vllm.fence), without vLLM:
a block is readable only once the forward that writes it is known done."""

import pytest

import kvbm_py
from kvbm_py.vllm.fence import WriteFence


def test_synchronous_scheduling_reads_a_block_from_the_next_step_on():
    f = WriteFence(1)
    f.begin_step()  # step 1 is built: its forward has not run
    f.writes([3, 4])
    assert f.written_by([3]) == 1 and not f.is_done(1)
    f.end_step()
    # Output processing of step 1 (a request finishing): the forward ran.
    assert f.is_done(1)
    f.begin_step()
    assert f.is_done(1) and f.written_by([3, 4]) == 0, "finished writes are forgotten"


def test_two_batches_in_flight_wait_one_step_more():
    f = WriteFence(2)
    f.begin_step()
    f.writes([7])
    f.end_step()
    assert not f.is_done(1), "step 2 may be scheduled before step 1's output"
    f.begin_step()
    assert not f.is_done(1)
    f.end_step()
    assert f.is_done(1), "output processing of step 1 happens after step 2 is built"
    f.begin_step()
    assert f.is_done(1) and f.written_by([7]) == 0


def test_a_block_rewritten_later_waits_for_the_later_forward():
    f = WriteFence(1)
    f.begin_step()
    f.writes([1])
    f.end_step()
    f.begin_step()
    f.writes([1, 2])  # chunked prefill or a reallocated block
    assert f.written_by([1]) == 2 and f.written_by([0, 1, 2]) == 2
    assert f.is_done(0), "a block no forward writes is readable at once"


def test_poisoned_blocks_stay_out_until_a_forward_rewrites_them():
    f = WriteFence(1)
    f.poison([5, 6])
    assert f.clean_prefix([4, 5, 6, 7]) == 1
    f.begin_step()
    f.writes([5])
    assert f.clean_prefix([4, 5, 6, 7]) == 2
    f.whole([6])
    assert f.clean_prefix([4, 5, 6, 7]) == 4


def test_no_batches_is_refused():
    with pytest.raises(kvbm_py.InvalidArgumentError):
        WriteFence(0)
