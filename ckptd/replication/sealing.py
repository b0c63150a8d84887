"""Keys and per-frame protection of the bulk path between two daemons.

Owns the cryptography of bulk connections, nothing of sockets or parts:

- **key agreement.** A daemon's CURVE key pair (:mod:`.transport`) is an X25519 key pair.
  The trainers hand every daemon the public keys of the job's daemons through their own
  process group; two daemons that each hold their own secret and the other's public key
  derive the same shared secret, which nobody else can. So only this job's daemons can
  open a bulk connection, and no secret ever travels (not even over the trainers' gloo);
- **connection keys.** HKDF-SHA256 over that secret, a random salt from each end, both
  public keys and the protection choice gives one key per direction; a fresh connection
  always has fresh keys, so the 12-byte nonce (a frame counter) never repeats under a key
  and a recorded connection cannot be replayed;
- **sealers**, one per protection choice (:data:`PROTECTIONS`): ``"aes-256-gcm"`` encrypts
  and authenticates each frame (the default); ``"none"`` sends the bytes in clear but still
  authenticates each frame with a GMAC tag (AES-GCM over an empty plaintext), so peers stay
  authenticated on the bulk path. Both from ``cryptography``, whose AEAD calls release the
  GIL: each connection thread seals on its own core.

Measured choice (``benchmarks/RESULTS_TRANSPORT.md``): AES-256-GCM costs about 0.15 CPU
s/GiB per end more than plain tcp, GMAC about 0.1; HMAC-SHA256 three times that, ZeroMQ
CURVE five times.
"""

from __future__ import annotations

import hmac
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from zmq.utils import z85

#: Protection choices of the bulk path, the default first.
PROTECTIONS = ("aes-256-gcm", "none")
#: Bytes of an AES-GCM tag (what each frame carries besides its bytes).
TAG_BYTES = 16
#: Bytes of each end's random salt.
SALT_BYTES = 32
KEY_BYTES = 32
_INFO = b"ckptd bulk v1"


class AuthenticationError(Exception):
    """A frame or a handshake proof did not verify: not sent by a holder of the key."""


def raw_key(z85_key: str | bytes) -> bytes:
    """The 32 raw bytes of a z85-encoded CURVE key."""
    key = z85_key.encode() if isinstance(z85_key, str) else bytes(z85_key)
    raw = z85.decode(key)
    if len(raw) != KEY_BYTES:
        raise ValueError(f"a CURVE key has {KEY_BYTES} bytes, not {len(raw)}")
    return raw


def shared_secret(own_secret: bytes, peer_public: bytes) -> bytes:
    """X25519 of this daemon's secret key and a peer's public key (raw bytes)."""
    private = X25519PrivateKey.from_private_bytes(own_secret)
    return private.exchange(X25519PublicKey.from_public_bytes(peer_public))


def connection_keys(secret: bytes, salts: bytes, client_public: bytes, server_public: bytes,
                    protection: str) -> tuple[bytes, bytes]:
    """The (client -> server, server -> client) keys of one connection."""
    okm = HKDF(algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=salts,
               info=_INFO + protection.encode() + client_public + server_public).derive(secret)
    return okm[:KEY_BYTES], okm[KEY_BYTES:]


def new_salt() -> bytes:
    """A fresh random salt for one end of a handshake."""
    return os.urandom(SALT_BYTES)


def _nonce(counter: int) -> bytes:
    return counter.to_bytes(12, "little")


class Sealer:
    """Seals (or opens) the frames of one direction of one connection, in order.

    Parameters
    ----------
    key : bytes
        That direction's key (:func:`connection_keys`).
    protection : str
        One of :data:`PROTECTIONS`.

    Notes
    -----
    Each call uses the next nonce, so the receiving side must open frames in the order
    they were sealed (a tcp connection keeps that order).
    """

    def __init__(self, key: bytes, protection: str) -> None:
        if protection not in PROTECTIONS:
            raise ValueError(f"unknown bulk protection {protection!r}; choose one of "
                             f"{', '.join(PROTECTIONS)}")
        self.encrypts = protection == "aes-256-gcm"
        self._aead = AESGCM(key)
        self._counter = 0

    def _next(self) -> bytes:
        self._counter += 1
        return _nonce(self._counter)

    def proof(self, transcript: bytes) -> bytes:
        """A tag over a handshake transcript: proves this end derived the key."""
        return self._aead.encrypt(self._next(), b"", transcript)

    def check_proof(self, transcript: bytes, proof: bytes) -> None:
        """Raise :class:`AuthenticationError` unless ``proof`` is :meth:`proof` of it."""
        if not hmac.compare_digest(self._aead.encrypt(self._next(), b"", transcript), proof):
            raise AuthenticationError("the other end could not prove it holds its key")

    def seal(self, header: bytes, payload, scratch: memoryview) -> list:
        """The buffers to send for one frame (header in clear, authenticated).

        ``aes-256-gcm``: the payload encrypted into ``scratch`` with the tag; ``none``:
        the payload itself (not copied) and a GMAC tag over header and payload.
        """
        nonce = self._next()
        if self.encrypts:
            sealed = scratch[:len(payload) + TAG_BYTES]
            self._aead.encrypt_into(nonce, payload, header, sealed)
            return [header, sealed]
        return [header, payload, self._gmac(nonce, header, payload)]

    def _gmac(self, nonce: bytes, header: bytes, payload) -> bytes:
        # GCM over the header as plaintext and the payload as associated data: the tag
        # covers both; only the tag travels.
        return self._aead.encrypt(nonce, header, payload)[-TAG_BYTES:]

    def body_size(self, length: int) -> int:
        """Bytes that follow a header whose payload has ``length`` bytes."""
        return length + TAG_BYTES

    def open(self, header: bytes, body: memoryview, into: memoryview) -> memoryview:
        """Check a frame's body and return its payload (plaintext written into ``into``).

        ``body`` is what followed the header (:meth:`body_size` bytes). With
        ``aes-256-gcm`` the plaintext is written to ``into`` only when it verifies;
        with ``none`` the payload is ``body`` itself, returned once its tag verifies.

        Raises
        ------
        AuthenticationError
            If the frame was not sealed with this connection's key, or was altered.
        """
        nonce = self._next()
        length = len(body) - TAG_BYTES
        if self.encrypts:
            plain = into[:length]
            try:
                self._aead.decrypt_into(nonce, body, header, plain)
            except InvalidTag:
                raise AuthenticationError("a bulk frame failed authentication") from None
            return plain
        payload = body[:length]
        if not hmac.compare_digest(self._gmac(nonce, header, payload), body[length:]):
            raise AuthenticationError("a bulk frame failed authentication")
        return payload
