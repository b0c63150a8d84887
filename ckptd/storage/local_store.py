"""The node-local checkpoint store: part files of local checkpoints, own and replicas.

Owns the on-disk layout under the directory a trainer's ``LocalCheckpointManager`` names
(its ``root_local_ckpt_dir``, which must lie inside the daemon's ``--local-dir``)::

    <root_local_ckpt_dir>/<session_id>/iter_<0000042>/rank_<r>.part            a part
    <root_local_ckpt_dir>/<session_id>/iter_<0000042>/rank_<r>.part.ckptd-sum  its crc32
    <root_local_ckpt_dir>/<session_id>/iter_<0000042>/rank_<r>.part.ckptd-verified  a daemon verified it
    <root_local_ckpt_dir>/<session_id>/iter_<0000042>/.rank_<r>.part.<pid>.<token>.ckptd-tmp  dirty
    <root_local_ckpt_dir>/<session_id>/iter_<0000042>/committed (+ its .ckptd-sum) all ranks agreed
    <root_local_ckpt_dir>/<session_id>/iter_<0000042>/rank_<r>.part.corrupt-<time> set aside

One part per owner rank and iteration; a replica held for another rank has exactly the
name and bytes its owner's daemon wrote, so "own" and "replica" differ only in who asked
for it. A part is written under its dirty name, fsynced, checksummed, renamed clean and
the directory fsynced (see :mod:`ckptd.storage.durable`); the part format
(:func:`ckptd.protocol.encode_part_header`) loads without unpickling anything.

Space rule (from the reference guide): the directory must hold two parts per rank (the
clean, committed iteration and the dirty one being saved) times the replication factor
(its own part plus the replicas it keeps for clique mates). Older iterations are removed
only by :meth:`LocalStore.commit`, which the trainers call after *every* rank's save of a
newer iteration is durable (the finalize step of ``LocalCheckpointManager.save``).

Pattern: plain files and a small verification cache; no sockets, no threads of its own
(the replicator's thread and the serve loop both call it, so the mutable state is
guarded by a lock). It never decides *where* replicas go; ``ckptd.replication`` does.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass

from ckptd.checksum import (CORRUPT_MARKER, Checksum, ChecksumMismatchError, algorithm_named,
                            combine_pieces, sidecar_path, verify_file)
from ckptd.protocol import check_session_id
from ckptd.storage.directories import fsync_directory, make_directories
from ckptd.storage.durable import DurableFile, remove_written, write_small_file
from ckptd.storage.roots import AllowedRoots, PathRefusedError
from ckptd.storage.verified_notes import drop_note, note_vouches_for, write_note

log = logging.getLogger(__name__)

COMMITTED_MARKER = "committed"
_ITER_RE = re.compile(r"iter_(\d+)")
_PART_RE = re.compile(r"rank_(\d+)\.part")


class LocalStoreError(Exception):
    """A local-checkpoint request the store cannot serve (with a hint in the text)."""


@dataclass(frozen=True)
class LocalSession:
    """Where one session's parts live on this node.

    Parameters
    ----------
    session_id : str
        The ``LocalCheckpointManager``'s session id ('' for none).
    root : str
        Its ``root_local_ckpt_dir``, symlinks resolved.
    """

    session_id: str
    root: str

    @property
    def directory(self) -> str:
        """The directory holding this session's iterations."""
        return os.path.join(self.root, self.session_id) if self.session_id else self.root

    def iteration_dir(self, iteration: int) -> str:
        """The directory of one iteration."""
        return os.path.join(self.directory, f"iter_{iteration:07d}")

    def part_path(self, iteration: int, owner: int) -> str:
        """The part of rank ``owner`` for ``iteration`` (own or replica alike)."""
        return os.path.join(self.iteration_dir(iteration), f"rank_{owner}.part")


class LocalStore:
    """Sessions registered on this daemon and the parts they hold.

    Parameters
    ----------
    allowed : AllowedRoots
        Directories a session root may lie in (``--local-dir``).
    journal : WrittenDirectories, optional
        Where session directories are noted (temporaries there are swept after a crash).
    """

    def __init__(self, allowed: AllowedRoots, journal=None) -> None:
        self.allowed = allowed
        self.journal = journal
        self._sessions: dict[str, LocalSession] = {}
        self._verified: dict[str, tuple] = {}  # path -> (size, mtime_ns, ino, ok)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ sessions
    def register(self, session_id: str, root: str) -> LocalSession:
        """Register (or re-register) a session's root directory.

        Raises
        ------
        LocalStoreError
            If the session id is unsafe or the root lies outside ``--local-dir``.
        """
        try:
            check_session_id(session_id)
        except ValueError as exc:
            raise LocalStoreError(str(exc)) from None
        try:
            resolved = self.allowed.check(root)
        except PathRefusedError as exc:
            raise LocalStoreError(f"local checkpoint directory refused: {exc} (start ckptd "
                                  "with --local-dir covering it)") from None
        session = LocalSession(session_id, resolved)
        make_directories(session.directory)
        if self.journal is not None:
            self.journal.note(session.directory, recursive=True)
        with self._lock:
            previous = self._sessions.get(session_id)
            self._sessions[session_id] = session
        if previous != session:
            log.info("local session %r registered at %s", session_id, session.directory)
        return session

    def session(self, session_id: str) -> LocalSession:
        """The registered session ``session_id``.

        Raises
        ------
        LocalStoreError
            If no trainer registered it with this daemon.
        """
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise LocalStoreError(
                f"local session {session_id!r} is not registered with this daemon; create the "
                "LocalCheckpointManager on every rank (it registers the session) before saving; "
                "if this daemon restarted since, call find_latest() on all ranks to register again")
        return session

    def sessions(self) -> list[LocalSession]:
        """Every registered session."""
        with self._lock:
            return list(self._sessions.values())

    # ------------------------------------------------------------------ parts
    def iterations(self, session: LocalSession) -> list[int]:
        """Iterations with a directory in ``session``, ascending."""
        try:
            names = os.listdir(session.directory)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _ITER_RE.fullmatch(n)))

    def parts_of(self, session: LocalSession, iteration: int) -> list[int]:
        """Owner ranks with a clean part of ``iteration``, ascending."""
        try:
            names = os.listdir(session.iteration_dir(iteration))
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _PART_RE.fullmatch(n)))

    def is_committed(self, session: LocalSession, iteration: int) -> bool:
        """Whether every rank agreed this iteration's save succeeded (marker present)."""
        return os.path.exists(os.path.join(session.iteration_dir(iteration), COMMITTED_MARKER))

    def _file_identity_and_cache(self, path: str) -> tuple[tuple | None, tuple | None]:
        """The file's current ``(size, mtime_ns, inode)`` (None if absent) and its cached
        verification entry."""
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return None, None
        with self._lock:
            cached = self._verified.get(path)
        return (info.st_size, info.st_mtime_ns, info.st_ino), cached

    def verify(self, path: str, use_cache: bool = True) -> bool:
        """Whether ``path`` matches its checksum record (cached per size/mtime/inode).

        With ``use_cache``, a note that a daemon verified this very file (same device,
        inode, size, mtime and record: :mod:`ckptd.storage.verified_notes`) counts too:
        after a restart the parts are not read again. Bytes that rotted without the file
        changing are caught by the trainer's load, which checks every byte it reads.
        """
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return False
        key = (info.st_size, info.st_mtime_ns, info.st_ino)
        with self._lock:
            cached = self._verified.get(path)
        if use_cache and cached is not None and cached[:3] == key:
            return cached[3]
        if use_cache and note_vouches_for(path, info):
            ok = True
        else:
            try:
                verify_file(path)
                ok = True
            except (ChecksumMismatchError, OSError) as exc:
                log.warning("local part %s failed verification: %s", path, exc)
                ok = False
            (write_note if ok else drop_note)(path)
        with self._lock:
            self._verified[path] = (*key, ok)
        return ok

    def note_verified(self, path: str, ok: bool = True) -> None:
        """Record a verification done elsewhere (a part just written, received, or served),
        here and in a note for the next daemon (not fsynced: called on the serve loop)."""
        key, _ = self._file_identity_and_cache(path)
        if key is not None:
            with self._lock:
                self._verified[path] = (*key, ok)
            (write_note if ok else drop_note)(path)

    def cached_verification(self, path: str) -> bool | None:
        """The last verification result of ``path`` if still current, else ``None``."""
        key, cached = self._file_identity_and_cache(path)
        return cached[3] if key is not None and cached is not None and cached[:3] == key else None

    def verified_file_identity(self, path: str) -> list | None:
        """``[size, mtime_ns, inode]`` of ``path`` as it was verified intact (still
        current), else ``None``: a reader whose open file has this identity reads the
        very bytes that were verified."""
        return _verified_identity(*self._file_identity_and_cache(path))

    def inventory(self, session: LocalSession, verify: bool = True) -> list[dict]:
        """Every clean part held for ``session``: iteration, owner, size, verified, committed;
        with ``verify`` also its ``identity`` (see :meth:`verified_file_identity`).

        With ``verify=False`` (status), ``verified`` is the cached result or ``None``.
        """
        held = []
        for iteration in self.iterations(session):
            committed = self.is_committed(session, iteration)
            for owner in self.parts_of(session, iteration):
                path = session.part_path(iteration, owner)
                verified = self.verify(path) if verify else self.cached_verification(path)
                key, cached = self._file_identity_and_cache(path)
                if key is None:
                    continue
                held.append({"session": session.session_id, "iteration": iteration,
                             "owner": owner, "size": key[0], "verified": verified,
                             "committed": committed, "path": path})
                if verify:
                    held[-1]["identity"] = _verified_identity(key, cached)
        return held

    def begin_iteration(self, session: LocalSession, iteration: int) -> None:
        """A new save of ``iteration`` starts: it is not committed until all ranks agree."""
        marker = os.path.join(session.iteration_dir(iteration), COMMITTED_MARKER)
        if os.path.exists(marker):
            remove_written(marker)
            fsync_directory(session.iteration_dir(iteration))

    def commit(self, session: LocalSession, iteration: int) -> list[int]:
        """Mark ``iteration`` committed here, then remove every older iteration.

        Called after all ranks agreed that their saves of ``iteration`` are durable, so
        the older checkpoints are no longer the newest complete one anywhere.

        Returns
        -------
        list of int
            The older iterations, removed.
        """
        directory = session.iteration_dir(iteration)
        marker = os.path.join(directory, COMMITTED_MARKER)
        if self._marks(marker, iteration):
            # Another rank of this node committed it already and was answered: writing it
            # again would rename over a marker that rank was told is durable. Syncing the
            # directory still puts this answer, too, after a durable marker and record.
            fsync_directory(directory)
        else:
            write_small_file(marker, f"{iteration}\n".encode(), checksum=True)
        older = [old for old in self.iterations(session) if old < iteration]
        self.remove_iterations(session, older)
        return older

    @staticmethod
    def _marks(marker: str, iteration: int) -> bool:
        """Whether ``marker`` is an intact commit marker of ``iteration``."""
        try:
            verify_file(marker)
            with open(marker, "rb") as f:
                return f.read() == f"{iteration}\n".encode()
        except (ChecksumMismatchError, OSError):
            return False

    def remove_iterations(self, session: LocalSession, iterations: list[int]) -> None:
        """Remove whole iterations of ``session`` (older than a committed one)."""
        for old in iterations:
            shutil.rmtree(session.iteration_dir(old), ignore_errors=True)
        if iterations:
            fsync_directory(session.directory)
            log.info("session %r: removed iterations %s", session.session_id, iterations)

    def set_aside_if_corrupt(self, path: str) -> str | None:
        """Move a part that fails its checksum out of the way (kept, never loaded).

        Returns
        -------
        str or None
            Where the corrupted part now is, or ``None`` if ``path`` is absent or intact.
        """
        if not os.path.exists(path) or self.verify(path, use_cache=False):
            return None
        drop_note(path)
        aside = f"{path}{CORRUPT_MARKER}{time.strftime('%Y%m%dT%H%M%S')}"
        os.rename(path, aside)
        if os.path.exists(sidecar_path(path)):
            os.rename(sidecar_path(path), sidecar_path(aside))
        fsync_directory(os.path.dirname(path))
        with self._lock:
            self._verified.pop(path, None)
        log.warning("local part %s failed its checksum; moved aside to %s (kept for "
                    "inspection, never loaded); a verified copy is fetched from a peer",
                    path, aside)
        return aside


class PartReceiver:
    """Receives one part in pieces that may arrive out of order (several connections).

    Each piece is written at its offset under the part's dirty name and checksummed as
    it arrives (by the thread that received it), with ``O_DIRECT`` where the filesystem
    takes it (:mod:`ckptd.storage.direct_pieces`); once every byte is there,
    :meth:`finish` folds the pieces' crc32 into the part's, checks it, and makes the
    part durable under its clean name (fsync, checksum record, rename). The bytes are
    written once and never read back.

    Parameters
    ----------
    path : str
        The clean name the part gets when :meth:`finish` succeeds.
    size : int
        Bytes the part has.
    algorithm : str
        Of the pieces' checksums and of the part's record (the holder's, when it serves).
    """

    def __init__(self, path: str, size: int, algorithm: str = "crc32") -> None:
        self.path = path
        self.size = size
        self.algorithm = algorithm_named(algorithm)
        # O_DIRECT where the filesystem takes it: a replica is not read back soon, and
        # through the page cache it cost its receiver several times the CPU of receiving it
        self._file = DurableFile(path, algorithm=algorithm, direct=True, pieces_of=size)
        self._pieces: dict[int, tuple[int, int]] = {}  # offset -> (length, crc32)
        self._lock = threading.Condition()
        self._writing = 0     # pieces being written now (the file stays open meanwhile)
        self._closed = False
        self.received = 0

    @property
    def complete(self) -> bool:
        """Whether every byte arrived."""
        return self.received >= self.size

    def write(self, offset: int, data) -> bool:
        """Write and checksum one piece (thread-safe); ``False`` for a piece that arrived
        before (sent again after a reconnection: same bytes, not counted twice).

        Raises
        ------
        ValueError
            If the piece lies outside the part.
        OSError
            If writing fails (e.g. ENOSPC).
        """
        length = len(data)
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"a piece at bytes {offset}..{offset + length} lies outside "
                             f"the {self.size}-byte part {self.path}")
        with self._lock:
            if self._closed:
                raise OSError(f"{self.path}: the transfer was abandoned")
            if offset in self._pieces:
                return False
            self._writing += 1
        try:
            crc = self.algorithm.update(data, 0)
            self._file.write_at(offset, data)
        finally:
            with self._lock:
                self._writing -= 1
                self._lock.notify_all()
        with self._lock:
            if offset in self._pieces:
                return False
            self._pieces[offset] = (length, crc)
            self.received += length
        return True

    def finish(self, expected_crc: int | None = None) -> Checksum:
        """Make the complete part durable under its clean name.

        Raises
        ------
        ChecksumMismatchError
            If the pieces do not form the part, or their crc32 is not ``expected_crc``
            (a holder's copy that differs from what it recorded); the dirty file is
            removed.
        """
        with self._lock:
            self._closed = True
            self._lock.wait_for(lambda: self._writing == 0)
            pieces = [(offset, length, crc) for offset, (length, crc) in self._pieces.items()]
        try:
            checksum = combine_pieces(pieces, self.algorithm.name)
        except ValueError as exc:
            self.discard()
            raise ChecksumMismatchError(f"{self.path}: the pieces received do not form the "
                                        f"part ({exc}); the copy is discarded") from None
        if checksum.size != self.size or (expected_crc is not None
                                          and checksum.value != expected_crc):
            self.discard()
            raise ChecksumMismatchError(
                f"{self.path}: received {checksum.size} bytes with {checksum.algorithm} "
                f"{checksum.value:08x}, the holder recorded {self.size} bytes with "
                f"{(expected_crc or 0):08x}; the copy is corrupted and discarded")
        return self._file.commit(checksum=checksum)

    def discard(self) -> None:
        """Drop the dirty file (a transfer that failed or was cancelled); waits for pieces
        being written by other threads, so their descriptor is never reused under them."""
        with self._lock:
            self._closed = True
            self._lock.wait_for(lambda: self._writing == 0)
        self._file.discard()


def _verified_identity(key: tuple | None, cached: tuple | None) -> list | None:
    """A file's identity ``key`` if its cached verification (``cached``) found it intact
    and is still current, else ``None``."""
    return list(key) if key is not None and cached == (*key, True) else None
