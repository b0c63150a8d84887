"""``check_peer_table``: the trainers refuse a table whose daemons cannot reach each other."""

from __future__ import annotations

import pytest

from ckpt_client.local.session import check_peer_table


def entry(address: str | None = "10.0.0.1:7000", encryption: str = "aes-256-gcm",
          network: str = "net-a") -> dict:
    return {"address": address, "encryption": encryption, "network": network}


def test_daemons_that_all_listen_alike_pass():
    check_peer_table([entry("10.0.0.1:7000"), entry("10.0.0.2:7000", network="net-b")])


def test_several_ranks_of_one_host_may_all_use_loopback():
    check_peer_table([entry("127.0.0.1:7000"), entry("127.0.0.1:7000")])


def test_a_daemon_without_a_peer_address_is_named():
    with pytest.raises(ValueError, match=r"ranks \[1, 2\] have no --peer-listen"):
        check_peer_table([entry(), entry(None), entry("")])


def test_daemons_protecting_replicas_differently_are_refused():
    with pytest.raises(ValueError, match="same --peer-encryption"):
        check_peer_table([entry(), entry(encryption="none")])


@pytest.mark.parametrize("loopback", ["127.0.0.1:7000", "[::1]:7000", "localhost:7000"])
def test_a_loopback_address_across_hosts_is_refused_naming_the_rank(loopback):
    table = [entry("10.0.0.1:7000"), entry(loopback, network="net-b")]
    with pytest.raises(ValueError, match=r"rank 1 advertises the loopback address"):
        check_peer_table(table)
