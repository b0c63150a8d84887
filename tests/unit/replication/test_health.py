"""A peer's heartbeat: up while it answers within the miss budget, down after, redialed."""

from ckptd import knobs
from ckptd.replication.health import DOWN, UNKNOWN, UP, PeerHealth


def test_a_peer_is_unknown_then_up_then_down_after_its_budget():
    with knobs.override(PEER_PING_INTERVAL=1.0, PEER_MISS_BUDGET=3):
        health = PeerHealth("tcp://n1:7", dialed_at=100.0)
        assert health.ping_due(100.0) and not health.ping_due(100.5)
        assert health.assess(101.0) == UNKNOWN
        health.pong(101.2)
        assert health.assess(104.0) == UP
        assert health.assess(104.3) == DOWN and health.last_heard(104.3) > 3.0
        assert not health.wants_redial(104.3), "the link had no time to connect yet"
        assert health.wants_redial(106.0)


def test_a_silent_peer_is_down_without_ever_being_up():
    with knobs.override(PEER_PING_INTERVAL=0.5, PEER_MISS_BUDGET=2):
        health = PeerHealth("tcp://n1:7", dialed_at=0.0)
        assert health.assess(0.9) == UNKNOWN and health.assess(1.1) == DOWN


def test_a_redialed_link_keeps_what_was_known():
    health = PeerHealth("tcp://n1:7", dialed_at=0.0, last_pong=5.0, state=UP)
    fresh = health.redialed()
    assert fresh.last_pong == 5.0 and fresh.state == UP and fresh.dialed_at > 0.0
