"""Completion marks without a process group: nothing is marked, and a failure is still
reported (naming this rank and the collective's error) instead of escaping."""

import os

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


def test_a_rank_is_gone_only_on_its_own_nodes_evidence_which_is_shared_through_the_store():
    """A real store (torch's HashStore) and a real process: alive (even stopped) is not
    gone; killed is, and the finding is left for ranks on other nodes; a process
    described from another node is never judged here."""
    import signal
    import subprocess

    from torch.distributed import HashStore

    from ckpt_client.arrivals import _node, _started, gone

    store = HashStore()
    child = subprocess.Popen(["sleep", "60"])
    try:
        store.set("ckpt_client/process/1", f"{_node()} {child.pid} {_started(child.pid)}")
        store.set("ckpt_client/process/2", f"elsewhere:1 {child.pid} {_started(child.pid)}")
        child.send_signal(signal.SIGSTOP)
        assert gone(store, 1) is None and gone(store, 2) is None
        assert gone(store, 3) is None  # never said which process it is
        child.kill()
        child.wait()
        assert gone(store, 1) == f"its process (pid {child.pid}) exited"
        assert store.get("ckpt_client/gone/1").decode() == gone(store, 1)
        assert gone(store, 2) is None
    finally:
        child.kill()
        child.wait()


def test_a_rank_on_a_lost_node_is_named_after_the_grace_not_the_group_timeout():
    """A node lost whole leaves nobody to find its processes gone: a rank described from
    another node that never reaches the check is named once CKPTD_LATE_RANK_GRACE has
    passed (the process group's own timeout, 30 min for gloo, would leave the operator
    without a name for half an hour); a rank that arrived is never named."""
    from torch.distributed import HashStore

    from ckpt_client.arrivals import MARKS, _node, lost_ranks_failure
    from ckptd import knobs

    store = HashStore()
    store.set("ckpt_client/process/0", f"{_node()} {os.getpid()} x")
    store.set("ckpt_client/completion/0", str(MARKS.completion))
    store.set("ckpt_client/process/1", "another-node:1 4242 17")
    with knobs.override(LATE_RANK_GRACE=0.3):
        failures = lost_ranks_failure(RuntimeError("Connection closed by peer"), 0, 2, store)
    assert list(failures) == [1]
    assert "CKPTD_LATE_RANK_GRACE" in failures[1] and "node may be lost" in failures[1]
