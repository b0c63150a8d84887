"""Bulk-transport candidates for replication between daemons (issue 12), one interface.

Owns the wire side of ``bench_transport.py``: how each candidate sets up one stream (a
connection), moves fixed-size chunks from a source buffer into a preallocated destination
buffer, and authenticates or encrypts them; and the keyed primitives timed without a
network. It must not time or report anything: the benchmark does.

Pattern: one small strategy class per candidate (:class:`Transport`: ``listen`` /
``accept`` / ``connect``, then per-stream ``send`` / ``recv`` of a list of chunks). Both ends
know the sizes, so nothing travels beside a chunk but its tag (or AEAD expansion).
Per-chunk tags and nonces bind the stream id and the chunk counter, so a chunk cannot be
replayed, reordered or moved to another stream under the same key.

Secrets (keys, the pinned certificate) are made once by the parent with :func:`secrets_for`
and handed to both ends, standing in for keys exchanged through the trainers' process group.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import os
import queue
import secrets as random_secrets
import socket
import ssl
import struct
import threading
from typing import Callable

MiB = 1 << 20
#: ZeroMQ settings as ckptd's replication uses them today (ckptd/replication.py):
#: frames queued per stream, and I/O threads per context (they run CURVE).
ZMQ_WINDOW = 16
ZMQ_IO_THREADS = 2
HANDSHAKE_TIMEOUT = 30.0


class AuthenticationFailed(Exception):
    """A chunk's tag did not verify: the bytes were not sent by a holder of the key."""


def recv_exact(sock, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (a socket or ssl socket), or raise at end of stream."""
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError(f"peer closed the stream after {got} of {size} bytes")
        got += n


def header16(stream: int, k: int) -> bytes:
    """What a tag binds besides the bytes: the stream id and the chunk counter."""
    return struct.pack("<QQ", stream, k)


def nonce12(stream: int, k: int) -> bytes:
    """A 96-bit AEAD nonce, unique per (stream, chunk) under one key."""
    return struct.pack("<IQ", stream, k)


class Transport:
    """One candidate: how a stream connects and how chunks cross it.

    Attributes
    ----------
    name : str
        As the report shows it.
    security : str
        ``"none"``, ``"authenticated"`` (keyed tag per chunk, bytes in clear) or
        ``"encrypted"`` (authenticated encryption).
    library : str
        The package that does the work (what an adopter would have to declare).
    """

    name = "?"
    security = "none"
    library = "socket (stdlib)"

    def available(self) -> str | None:
        """``None`` when usable here, else why not (e.g. a package is not installed)."""
        return None

    def env(self, secrets: dict) -> dict:
        """Environment a worker process needs (set before the process starts)."""
        return {}

    def load(self, secrets: dict) -> None:
        """Take the job's secrets (in each worker, before any stream)."""
        self.secrets = secrets

    # -- streams over tcp (ZeroMQ overrides these) ----------------------------------

    def listen(self, host: str):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        s.listen(1)
        return s

    def port(self, listener) -> int:
        return listener.getsockname()[1]

    def accept(self, listener):
        conn, _ = listener.accept()
        listener.close()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self.server_side(conn)

    def connect(self, host: str, port: int):
        conn = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT)
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self.client_side(conn)

    def server_side(self, conn):
        """Handshake on an accepted connection (receiving end); returns the stream."""
        return conn

    def client_side(self, conn):
        """Handshake on a new connection (sending end); returns the stream."""
        return conn

    def send(self, conn, stream: int, chunks: list[memoryview]) -> None:
        for chunk in chunks:
            conn.sendall(chunk)

    def recv(self, conn, stream: int, chunks: list[memoryview]) -> None:
        for chunk in chunks:
            recv_exact(conn, chunk)

    def end_recv(self, conn) -> None:
        """The receiving end has everything: tell the sender."""
        conn.sendall(b"k")

    def end_send(self, conn) -> None:
        """Wait until the receiver has everything. Closing earlier could also lose data:
        a socket closed with unread input (e.g. TLS session tickets) sends a reset, and a
        reset discards what the peer has not read yet."""
        recv_exact(conn, memoryview(bytearray(1)))

    def close(self, conn) -> None:
        conn.close()

    def finish(self) -> None:
        """After every stream of this process is closed (ZeroMQ flushes here)."""

    def describe(self, conn) -> str:
        """What was negotiated (e.g. the TLS cipher suite), for the report."""
        return ""


class PlainTcp(Transport):
    """socket.sendall / recv_into a preallocated buffer: the baseline."""

    name = "tcp"


# -- authenticated, not encrypted ------------------------------------------------------

class TaggedTcp(Transport):
    """tcp plus a keyed tag after each chunk; the receiver checks it before accepting."""

    security = "authenticated"
    tag_size = 32

    def tag(self, stream: int, k: int, chunk: memoryview) -> bytes:
        raise NotImplementedError

    def send(self, conn, stream, chunks):
        for k, chunk in enumerate(chunks):
            tag = self.tag(stream, k, chunk)
            conn.sendall(chunk)
            conn.sendall(tag)

    def recv(self, conn, stream, chunks):
        tag = memoryview(bytearray(self.tag_size))
        for k, chunk in enumerate(chunks):
            recv_exact(conn, chunk)
            recv_exact(conn, tag)
            if not hmac.compare_digest(self.tag(stream, k, chunk), tag):
                raise AuthenticationFailed(f"stream {stream} chunk {k}: bad tag")


class HmacSha256(TaggedTcp):
    name = "tcp + HMAC-SHA256"
    library = "hmac (stdlib, OpenSSL)"

    def tag(self, stream, k, chunk):
        mac = hmac.new(self.secrets["key32"], header16(stream, k), "sha256")
        mac.update(chunk)
        return mac.digest()


class KeyedBlake2b(TaggedTcp):
    name = "tcp + keyed BLAKE2b"
    library = "hashlib (stdlib)"

    def tag(self, stream, k, chunk):
        mac = hashlib.blake2b(header16(stream, k), key=self.secrets["key32"], digest_size=32)
        mac.update(chunk)
        return mac.digest()


class KeyedBlake3(TaggedTcp):
    name = "tcp + keyed BLAKE3"
    library = "blake3"

    def available(self):
        return _missing("blake3")

    def tag(self, stream, k, chunk):
        import blake3

        mac = blake3.blake3(header16(stream, k), key=self.secrets["key32"])
        mac.update(chunk)
        return mac.digest()


class Gmac(TaggedTcp):
    """AES-GCM with the chunk as associated data only: a GMAC tag (NIST SP 800-38D)."""

    name = "tcp + GMAC (AES-256-GCM tag only)"
    library = "cryptography"
    tag_size = 16

    def available(self):
        return _missing("cryptography")

    def load(self, secrets):
        super().load(secrets)
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.aead = AESGCM(secrets["key32"])

    def tag(self, stream, k, chunk):
        # The nonce carries stream and counter; the empty plaintext makes it a pure MAC.
        return self.aead.encrypt(nonce12(stream, k), b"", chunk)


# -- encrypted at the application level ------------------------------------------------

class AeadTcp(Transport):
    """Each chunk sealed with an AEAD from ``cryptography`` into a reused buffer."""

    security = "encrypted"
    library = "cryptography"
    algorithm = "AESGCM"
    key_name = "key32"

    def available(self):
        return _missing("cryptography")

    def load(self, secrets):
        super().load(secrets)
        from cryptography.hazmat.primitives.ciphers import aead

        self.aead = getattr(aead, self.algorithm)(secrets[self.key_name])

    def send(self, conn, stream, chunks):
        scratch = memoryview(bytearray(max(map(len, chunks)) + 16))
        for k, chunk in enumerate(chunks):
            sealed = scratch[:len(chunk) + 16]
            self.aead.encrypt_into(nonce12(stream, k), chunk, None, sealed)
            conn.sendall(sealed)

    def recv(self, conn, stream, chunks):
        scratch = memoryview(bytearray(max(map(len, chunks)) + 16))
        for k, chunk in enumerate(chunks):
            sealed = scratch[:len(chunk) + 16]
            recv_exact(conn, sealed)
            # Raises InvalidTag on a forged or damaged chunk; writes only when it verifies.
            self.aead.decrypt_into(nonce12(stream, k), sealed, None, chunk)


class Aes128Gcm(AeadTcp):
    name = "tcp + AES-128-GCM"
    key_name = "key16"


class Aes256Gcm(AeadTcp):
    name = "tcp + AES-256-GCM"


class ChaCha20Poly1305(AeadTcp):
    name = "tcp + ChaCha20-Poly1305"
    algorithm = "ChaCha20Poly1305"


class PipelinedAes256Gcm(AeadTcp):
    """AES-256-GCM with the crypto on a helper thread per stream: the sender seals chunk
    k+1 while chunk k is on the wire, the receiver opens chunk k while k+1 arrives. It
    works because ``cryptography`` releases the GIL during ``encrypt_into`` /
    ``decrypt_into`` (see the primitives section)."""

    name = "tcp + AES-256-GCM, pipelined"
    depth = 3  # sealed chunks in flight per stream: 3 x (chunk + 16) bytes of buffers

    def send(self, conn, stream, chunks):
        size = max(map(len, chunks)) + 16
        free, ready = queue.Queue(), queue.Queue()
        for _ in range(self.depth):
            free.put(memoryview(bytearray(size)))

        def seal():
            try:
                for k, chunk in enumerate(chunks):
                    sealed = free.get()[:len(chunk) + 16]
                    self.aead.encrypt_into(nonce12(stream, k), chunk, None, sealed)
                    ready.put(sealed)
                ready.put(None)
            except BaseException as exc:  # handed to the sending thread, which raises it
                ready.put(exc)

        helper = threading.Thread(target=seal, daemon=True)
        helper.start()
        while (sealed := ready.get()) is not None:
            if isinstance(sealed, BaseException):
                raise sealed
            conn.sendall(sealed)
            free.put(memoryview(sealed.obj))
        helper.join()

    def recv(self, conn, stream, chunks):
        size = max(map(len, chunks)) + 16
        free, full = queue.Queue(), queue.Queue()
        for _ in range(self.depth):
            free.put(memoryview(bytearray(size)))
        failure: list = []

        def open_chunks():
            while (item := full.get()) is not None:
                k, sealed = item
                try:
                    if not failure:
                        self.aead.decrypt_into(nonce12(stream, k), sealed, None, chunks[k])
                except BaseException as exc:  # keep recycling buffers so recv never blocks
                    failure.append(exc)
                free.put(memoryview(sealed.obj))

        helper = threading.Thread(target=open_chunks, daemon=True)
        helper.start()
        try:
            for k, chunk in enumerate(chunks):
                sealed = free.get()[:len(chunk) + 16]
                recv_exact(conn, sealed)
                full.put((k, sealed))
        finally:
            full.put(None)
            helper.join()
        if failure:
            raise failure[0]


class Aegis128l(Transport):
    """AEGIS-128L from libsodium via PyNaCl's public bindings (they take and return bytes,
    so each chunk is copied in and out besides the encryption)."""

    name = "tcp + AEGIS-128L (PyNaCl)"
    security = "encrypted"
    library = "PyNaCl"

    def available(self):
        if _missing("nacl"):
            return _missing("nacl")
        import nacl.bindings as nb

        return None if hasattr(nb, "crypto_aead_aegis128l_encrypt") else \
            "this PyNaCl's libsodium has no AEGIS-128L"

    def send(self, conn, stream, chunks):
        import nacl.bindings as nb

        key = self.secrets["key16"]
        for k, chunk in enumerate(chunks):
            conn.sendall(nb.crypto_aead_aegis128l_encrypt(bytes(chunk), None, header16(stream, k), key))

    def recv(self, conn, stream, chunks):
        import nacl.bindings as nb

        key, extra = self.secrets["key16"], nb.crypto_aead_aegis128l_ABYTES
        scratch = memoryview(bytearray(max(map(len, chunks)) + extra))
        for k, chunk in enumerate(chunks):
            sealed = scratch[:len(chunk) + extra]
            recv_exact(conn, sealed)
            chunk[:] = nb.crypto_aead_aegis128l_decrypt(bytes(sealed), None, header16(stream, k), key)


class SecretStream(Transport):
    """libsodium's secretstream (XChaCha20-Poly1305, nonces kept by the stream state) via
    PyNaCl; a 24-byte header goes first on each connection."""

    name = "tcp + XChaCha20-Poly1305 secretstream (PyNaCl)"
    security = "encrypted"
    library = "PyNaCl"

    def available(self):
        return _missing("nacl")

    def client_side(self, conn):
        import nacl.bindings as nb

        state = nb.crypto_secretstream_xchacha20poly1305_state()
        conn.sendall(nb.crypto_secretstream_xchacha20poly1305_init_push(state,
                                                                        self.secrets["key32"]))
        return _WithState(conn, state)

    def server_side(self, conn):
        import nacl.bindings as nb

        header = memoryview(bytearray(nb.crypto_secretstream_xchacha20poly1305_HEADERBYTES))
        recv_exact(conn, header)
        state = nb.crypto_secretstream_xchacha20poly1305_state()
        nb.crypto_secretstream_xchacha20poly1305_init_pull(state, bytes(header),
                                                           self.secrets["key32"])
        return _WithState(conn, state)

    def send(self, conn, stream, chunks):
        import nacl.bindings as nb

        for k, chunk in enumerate(chunks):
            last = k == len(chunks) - 1
            tag = (nb.crypto_secretstream_xchacha20poly1305_TAG_FINAL if last
                   else nb.crypto_secretstream_xchacha20poly1305_TAG_MESSAGE)
            conn.sendall(nb.crypto_secretstream_xchacha20poly1305_push(conn.state, bytes(chunk),
                                                                       None, tag))

    def recv(self, conn, stream, chunks):
        import nacl.bindings as nb

        extra = nb.crypto_secretstream_xchacha20poly1305_ABYTES
        scratch = memoryview(bytearray(max(map(len, chunks)) + extra))
        for chunk in chunks:
            sealed = scratch[:len(chunk) + extra]
            recv_exact(conn, sealed)
            message, _tag = nb.crypto_secretstream_xchacha20poly1305_pull(conn.state,
                                                                         bytes(sealed), None)
            chunk[:] = message


class _WithState:
    """A socket and the per-connection state of a stream cipher."""

    def __init__(self, sock, state):
        self.sock, self.state = sock, state

    def __getattr__(self, name):
        return getattr(self.sock, name)


# -- TLS 1.3 -----------------------------------------------------------------------------

class Tls13(Transport):
    """TLS 1.3 from Python's ``ssl``: mutual authentication with one self-signed job
    certificate that each end trusts alone (pinned; the fingerprint is checked too).

    Python 3.11's ``ssl`` has neither TLS 1.3 PSK nor a way to choose TLS 1.3 cipher
    suites, so the suite is set with an OpenSSL configuration file (``OPENSSL_CONF``) in
    the worker's environment, and the negotiated suite is checked.
    """

    security = "encrypted"
    library = "ssl (stdlib, OpenSSL)"
    suite = "TLS_AES_256_GCM_SHA384"

    def env(self, secrets):
        return {"OPENSSL_CONF": secrets["openssl_conf"][self.suite]}

    def load(self, secrets):
        super().load(secrets)
        cert, key = secrets["cert_path"], secrets["key_path"]
        self.server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        for ctx in (self.server_ctx, self.client_ctx):
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            ctx.load_cert_chain(cert, key)
            ctx.load_verify_locations(cert)  # the only trusted certificate
            ctx.verify_mode = ssl.CERT_REQUIRED
        self.client_ctx.check_hostname = False  # pinned certificate, not a name
        self.server_ctx.num_tickets = 0  # no session resumption between daemons

    def _check(self, tls) -> None:
        fingerprint = hashlib.sha256(tls.getpeercert(binary_form=True)).hexdigest()
        if fingerprint != self.secrets["cert_sha256"]:
            raise AuthenticationFailed(f"peer certificate {fingerprint[:16]}... is not the job's")
        if tls.cipher()[0] != self.suite:
            raise RuntimeError(f"negotiated {tls.cipher()[0]}, wanted {self.suite}")

    def server_side(self, conn):
        tls = self.server_ctx.wrap_socket(conn, server_side=True)
        self._check(tls)
        return tls

    def client_side(self, conn):
        tls = self.client_ctx.wrap_socket(conn)
        self._check(tls)
        return tls

    def describe(self, conn):
        return f"{conn.version()} {conn.cipher()[0]}"


class Tls13Aes128(Tls13):
    name = "TLS 1.3 AES-128-GCM (ssl)"
    suite = "TLS_AES_128_GCM_SHA256"


class Tls13Aes256(Tls13):
    name = "TLS 1.3 AES-256-GCM (ssl)"
    suite = "TLS_AES_256_GCM_SHA384"


class Tls13ChaCha(Tls13):
    name = "TLS 1.3 CHACHA20-POLY1305 (ssl)"
    suite = "TLS_CHACHA20_POLY1305_SHA256"


# -- ZeroMQ --------------------------------------------------------------------------------

class Zmq(Transport):
    """ZeroMQ PUSH -> PULL per stream, 4 MiB zero-copy frames, ``recv_into`` the destination;
    window and I/O threads as ckptd's replication has them today."""

    name = "ZeroMQ"
    library = "pyzmq"
    curve = False

    def available(self):
        return _missing("zmq")

    def load(self, secrets):
        super().load(secrets)
        self._ctx = None
        self._auth = None
        self._lock = threading.Lock()

    def context(self):
        import zmq

        with self._lock:
            if self._ctx is None:
                self._ctx = zmq.Context(io_threads=ZMQ_IO_THREADS)
        return self._ctx

    def listen(self, host):
        import zmq

        ctx = self.context()
        pull = ctx.socket(zmq.PULL)
        pull.rcvhwm = ZMQ_WINDOW
        if self.curve:
            self._start_authenticator(ctx)
            pull.curve_server = True
            pull.curve_publickey = self.secrets["curve_server_public"].encode()
            pull.curve_secretkey = self.secrets["curve_server_secret"].encode()
        pull.bind(f"tcp://{host}:*")
        return pull

    def _start_authenticator(self, ctx):
        # As ckptd: a ZAP authenticator admits only the job's client keys.
        from zmq.auth.thread import ThreadAuthenticator

        with self._lock:
            if self._auth is not None:
                return
            allowed = self.secrets["curve_client_public"].encode()

            class Allowed:
                def callback(self, domain, key):  # key: z85, as pyzmq passes it
                    return key == allowed

            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=Allowed())

    def port(self, listener):
        import zmq

        return int(listener.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])

    def accept(self, listener):
        return listener  # the peer's connection attaches to the bound socket

    def connect(self, host, port):
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        push = self.context().socket(zmq.PUSH)
        push.sndhwm = ZMQ_WINDOW
        push.linger = -1  # deliver everything queued before the context ends
        if self.curve:
            push.curve_serverkey = self.secrets["curve_server_public"].encode()
            push.curve_publickey = self.secrets["curve_client_public"].encode()
            push.curve_secretkey = self.secrets["curve_client_secret"].encode()
        monitor = push.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                          | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        push.connect(f"tcp://{host}:{port}")
        try:
            if not monitor.poll(HANDSHAKE_TIMEOUT * 1000):
                raise TimeoutError(f"no ZMTP handshake with {host}:{port}")
            event = recv_monitor_message(monitor)["event"]
            if event != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                raise ConnectionError(f"handshake with {host}:{port} failed: {event}")
        finally:
            push.disable_monitor()
            monitor.close()
        return push

    def send(self, conn, stream, chunks):
        for chunk in chunks:
            conn.send(chunk, copy=False)

    def recv(self, conn, stream, chunks):
        for k, chunk in enumerate(chunks):
            n = conn.recv_into(chunk)
            if n != len(chunk):
                raise ConnectionError(f"stream {stream} frame {k}: {n} bytes, not {len(chunk)}")

    def end_recv(self, conn):
        pass  # PUSH/PULL is one way; linger=-1 and term() deliver everything

    def end_send(self, conn):
        pass

    def close(self, conn):
        conn.close()

    def finish(self):
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.term()


class ZmqCurve(Zmq):
    name = "ZeroMQ CURVE"
    security = "encrypted"
    curve = True


#: Every candidate, in the order the report lists them.
TRANSPORTS: list[type[Transport]] = [
    PlainTcp, HmacSha256, KeyedBlake2b, KeyedBlake3, Gmac,
    Aes128Gcm, Aes256Gcm, PipelinedAes256Gcm, ChaCha20Poly1305, Aegis128l, SecretStream,
    Tls13Aes128, Tls13Aes256, Tls13ChaCha, Zmq, ZmqCurve,
]


def transport(name: str) -> Transport:
    """The candidate called ``name``."""
    for cls in TRANSPORTS:
        if cls.name == name:
            return cls()
    raise KeyError(name)


# -- secrets -----------------------------------------------------------------------------

_OPENSSL_CONF = """openssl_conf = default_conf
[default_conf]
ssl_conf = ssl_sect
[ssl_sect]
system_default = system_default_sect
[system_default_sect]
MinProtocol = TLSv1.3
Ciphersuites = {suite}
"""


def secrets_for(workdir: str) -> dict:
    """The job's secrets: symmetric keys, a self-signed certificate, CURVE key pairs.

    Files (certificate, key, OpenSSL configurations) go into ``workdir``.
    """
    out: dict = {"key32": random_secrets.token_bytes(32).hex(),
                 "key16": random_secrets.token_bytes(16).hex()}
    if not _missing("cryptography"):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ckptd-bench-job")])
        now = dt.datetime.now(dt.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        out["cert_path"] = os.path.join(workdir, "job-cert.pem")
        out["key_path"] = os.path.join(workdir, "job-key.pem")
        with open(out["cert_path"], "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        with open(os.open(out["key_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        out["cert_sha256"] = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
    out["openssl_conf"] = {}
    for cls in TRANSPORTS:
        if issubclass(cls, Tls13):
            path = os.path.join(workdir, f"openssl-{cls.suite}.cnf")
            with open(path, "w") as f:
                f.write(_OPENSSL_CONF.format(suite=cls.suite))
            out["openssl_conf"][cls.suite] = path
    if not _missing("zmq"):
        import zmq

        for who in ("server", "client"):
            public, secret = zmq.curve_keypair()
            out[f"curve_{who}_public"], out[f"curve_{who}_secret"] = public.decode(), secret.decode()
    return out


def decode_secrets(secrets: dict) -> dict:
    """Secrets as :func:`secrets_for` wrote them (JSON-safe) with the keys as bytes."""
    return {**secrets, "key32": bytes.fromhex(secrets["key32"]),
            "key16": bytes.fromhex(secrets["key16"])}


# -- primitives without a network (does the work release the GIL?) ----------------------

def primitive(name: str, secrets: dict, chunk_bytes: int) -> Callable[[memoryview, int], object]:
    """``fn(chunk, k)`` doing what the sending end of candidate ``name`` does to one chunk
    (tag or seal into a reused buffer), for timing without a network."""
    key32, key16 = secrets["key32"], secrets["key16"]
    scratch = memoryview(bytearray(chunk_bytes + 32))
    if name == "memcpy":
        return lambda chunk, k: scratch.__setitem__(slice(0, len(chunk)), chunk)
    if name == "HMAC-SHA256":
        return lambda chunk, k: hmac.new(key32, chunk, "sha256").digest()
    if name == "keyed BLAKE2b":
        return lambda chunk, k: hashlib.blake2b(chunk, key=key32, digest_size=32).digest()
    if name == "keyed BLAKE3":
        import blake3

        return lambda chunk, k: blake3.blake3(chunk, key=key32).digest()
    if name in ("GMAC (AES-256-GCM)", "AES-128-GCM", "AES-256-GCM", "ChaCha20-Poly1305"):
        from cryptography.hazmat.primitives.ciphers import aead

        if name == "GMAC (AES-256-GCM)":
            gcm = aead.AESGCM(key32)
            return lambda chunk, k: gcm.encrypt(nonce12(0, k), b"", chunk)
        cipher = (aead.AESGCM(key16) if name == "AES-128-GCM" else aead.AESGCM(key32)
                  if name == "AES-256-GCM" else aead.ChaCha20Poly1305(key32))
        return lambda chunk, k: cipher.encrypt_into(nonce12(0, k), chunk, None,
                                                    scratch[:len(chunk) + 16])
    if name == "AEGIS-128L (PyNaCl)":
        import nacl.bindings as nb

        return lambda chunk, k: nb.crypto_aead_aegis128l_encrypt(bytes(chunk), None,
                                                                 header16(0, k), key16)
    if name == "XChaCha20-Poly1305 secretstream (PyNaCl)":
        import nacl.bindings as nb

        state = nb.crypto_secretstream_xchacha20poly1305_state()
        nb.crypto_secretstream_xchacha20poly1305_init_push(state, key32)
        return lambda chunk, k: nb.crypto_secretstream_xchacha20poly1305_push(state, bytes(chunk))
    raise KeyError(name)


#: Primitive name -> the package it needs (None: the standard library).
PRIMITIVES = {
    "memcpy": None, "HMAC-SHA256": None, "keyed BLAKE2b": None, "keyed BLAKE3": "blake3",
    "GMAC (AES-256-GCM)": "cryptography", "AES-128-GCM": "cryptography",
    "AES-256-GCM": "cryptography", "ChaCha20-Poly1305": "cryptography",
    "AEGIS-128L (PyNaCl)": "nacl", "XChaCha20-Poly1305 secretstream (PyNaCl)": "nacl",
}


def _missing(module: str) -> str | None:
    import importlib.util

    return None if importlib.util.find_spec(module) else f"{module} is not installed"
