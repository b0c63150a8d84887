"""Completion marks without a process group: nothing is marked, and a failure is still
reported (naming this rank and the collective's error) instead of escaping."""

from ckpt_client.arrivals import CompletionMarks, lost_ranks_failure


def test_without_a_group_nothing_is_marked_and_nobody_is_named():
    marks = CompletionMarks()
    marks.entering(0)
    assert marks.missing(2) is None
    marks.agreed_done()
    assert marks.completion == 1


def test_a_failure_nobody_can_be_blamed_for_names_this_rank_and_the_error():
    failures = lost_ranks_failure(RuntimeError("Connection closed by peer"), 3, 4)
    assert list(failures) == [3]
    assert "Connection closed by peer" in failures[3] and "store is unreachable" in failures[3]
