"""Rules both sides compute alike: session ids, replica holders, loopback addresses, and
which export a CUDA IPC description is."""

import pytest

from ckptd import protocol


def test_holders_follow_the_owner_in_clique_order():
    assert protocol.holder_order([4, 5, 6, 7], 6) == [7, 4, 5]
    assert protocol.holder_order([3], 3) == []


@pytest.mark.parametrize("session", ["", "job-42", "a.b_c"])
def test_plain_session_ids_are_accepted(session):
    assert protocol.check_session_id(session) == session


@pytest.mark.parametrize("session", ["..", ".", "a/b", "x" * 129, "sp ace", 7])
def test_unsafe_session_ids_are_refused(session):
    with pytest.raises(ValueError, match="not a plain name"):
        protocol.check_session_id(session)


@pytest.mark.parametrize("address, loopback", [
    ("tcp://127.0.0.1:5555", True), ("127.0.0.2:1", True), ("localhost", True),
    ("tcp://[::1]:5555", True), ("::1", True), ("tcp://10.0.0.1:5555", False),
    ("tcp://[fe80::1]:1", False), ("node7:5555", False),
])
def test_loopback_addresses(address, loopback):
    assert protocol.is_loopback_address(address) is loopback


def test_every_export_of_a_storage_is_its_own_export():
    a = {"ref_counter_handle": b"h", "ref_counter_offset": 0, "handle": b"s"}
    b = {**a, "ref_counter_offset": 8}
    assert protocol.ipc_export_id(a) == protocol.ipc_export_id(dict(a))
    assert protocol.ipc_export_id(a) != protocol.ipc_export_id(b)
