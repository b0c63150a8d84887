"""Bulk-path cryptography: CURVE keys agree as X25519, frames open only under their key."""

import pytest
import zmq
from zmq.utils import z85

from ckptd.replication.sealing import (PROTECTIONS, TAG_BYTES, AuthenticationError, Sealer,
                                       connection_keys, raw_key, shared_secret)


def curve_pair():
    public, secret = zmq.curve_keypair()
    return raw_key(public), raw_key(secret)


def test_two_daemons_derive_the_same_secret_from_their_curve_keys_and_nobody_else_does():
    (pa, sa), (pb, sb), (_, sc) = curve_pair(), curve_pair(), curve_pair()
    assert shared_secret(sa, pb) == shared_secret(sb, pa)
    assert shared_secret(sc, pb) != shared_secret(sa, pb)  # a stranger claiming nothing
    assert raw_key(z85.encode(pa)) == pa and len(pa) == 32


def test_each_connection_and_direction_has_its_own_keys():
    secret = b"s" * 32
    one = connection_keys(secret, b"1" * 64, b"c" * 32, b"s" * 32, "aes-256-gcm")
    other = connection_keys(secret, b"2" * 64, b"c" * 32, b"s" * 32, "aes-256-gcm")
    assert one[0] != one[1] and set(one).isdisjoint(other)
    assert connection_keys(secret, b"1" * 64, b"c" * 32, b"s" * 32, "none") != one


@pytest.mark.parametrize("protection", PROTECTIONS)
def test_a_sealed_frame_opens_in_order_and_any_change_is_refused(protection):
    key = b"k" * 32
    header, payload = b"H" * 32, bytes(range(200))
    sender, receiver = Sealer(key, protection), Sealer(key, protection)
    scratch, into = memoryview(bytearray(300)), memoryview(bytearray(300))
    body = b"".join(bytes(b) for b in sender.seal(header, payload, scratch)[1:])
    assert len(body) == receiver.body_size(len(payload)) == len(payload) + TAG_BYTES
    assert (payload in body) == (protection == "none"), "encrypted only with aes-256-gcm"
    assert bytes(receiver.open(header, memoryview(body), into)) == payload
    for tampered_header, tampered_body in ((b"X" + header[1:], body),
                                           (header, bytes([body[0] ^ 1]) + body[1:])):
        sender_again, receiver_again = Sealer(key, protection), Sealer(key, protection)
        sealed = b"".join(bytes(b) for b in sender_again.seal(header, payload, scratch)[1:])
        assert sealed == body
        with pytest.raises(AuthenticationError):
            receiver_again.open(tampered_header, memoryview(tampered_body), into)
    replayed = Sealer(key, protection)
    replayed.open(header, memoryview(body), into)
    with pytest.raises(AuthenticationError):  # the same frame again: the nonce moved on
        replayed.open(header, memoryview(body), into)
    with pytest.raises(AuthenticationError):
        Sealer(b"o" * 32, protection).open(header, memoryview(body), into)
