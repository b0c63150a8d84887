"""Local checkpoints: each rank's part on its own node, replicated to peers by the daemons.

The names and semantics mirror the reference's local checkpointing
(``LocalCheckpointManager``, ``BasicTensorAwareStateDict``, ``CliqueReplicationStrategy``)
so training scripts can switch. What differs is *who* moves the bytes: ``save`` only
stages this rank's tensors with its node's ckptd (one copy into shared memory); the
daemon writes the part and, at the same time, streams it to the daemons of the rank's
clique mates over several authenticated (by default AES-256-GCM encrypted) tcp
connections. Training goes on meanwhile, and the daemon keeps the latest committed part
in memory for a trainer restarted on the node.

Collectives (all over the trainers' default process group, so every rank must call
``save``, ``find_latest`` and ``load`` together, as in the reference):

- the key exchange, on first use and whenever a daemon restarted: each rank asks its
  daemon for (peer and bulk addresses, CURVE public key), the table is all-gathered, and
  each rank hands it to its daemon together with the cliques; daemons accept no other
  keys, on either path (:mod:`ckpt_client.local.session`);
- completion of a save: one all-reduce agrees every rank's part is durable, then each
  rank's daemon marks the iteration committed and drops older ones;
- ``find_latest``: each node's inventory (parts held, own or replica, verified against
  their checksums) is all-gathered; the newest committed iteration whose every part is
  somewhere wins. ``load`` then takes the part from the daemon's memory, this node's disk,
  or has the daemon fetch it from the holders first (:mod:`ckpt_client.local.loader`).

Part files hold a msgpack header and raw tensor bytes (no pickle); only a
``TensorAwareStateDict`` subclass other than the basic one is stored pickled, as the
reference stores it (see :mod:`ckpt_client.local.tensor_aware`).
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial
from pathlib import Path


from ckptd import protocol
from ckpt_client.transport import waits
from ckptd.protocol import LocalCommit, LocalInventory, MessageType, SaveFormat
from ckpt_client.collectives import all_gather, rank_and_world
from ckpt_client.queue import spans
from ckpt_client.errors import CheckpointException, DaemonRequestError, DaemonUnavailableError
from ckpt_client.local.cliques import CliqueReplicationStrategy
from ckpt_client.local.latest import Latest, choose_latest
from ckpt_client.local.loader import PartLoader
from ckpt_client.local.save_report import save_report
from ckpt_client.local.session import SessionRegistration
from ckpt_client.local.tensor_aware import (BasicTensorAwareStateDict, TensorAwareStateDict,
                                            part_state_dict, restore_from_part)
from ckpt_client.queue.calls_queue import AsyncCallsQueue
from ckpt_client.queue.request import AsyncRequest
from ckpt_client.transport.connection import DaemonConnection, connect
from ckpt_client.transport.daemon_save import RefusedSave
from ckpt_client.transport.flatten import buffers_of, flatten_state_dict
from ckpt_client.transport.handover import stage

log = logging.getLogger(__name__)

#: The trainer's span of a save call in ``ckptd trace`` (staging, or with a blocking save
#: the whole save up to its commit).
BLOCKED_SPAN = "blocked in LocalCheckpointManager.save"

#: ``(iteration, rank, session_id)``: which part ``load`` returned.
CkptID = tuple[int, int, str]


class LocalCheckpointManager:
    """Save, find and load node-local checkpoints through this node's ckptd.

    Parameters
    ----------
    root_local_ckpt_dir : str or os.PathLike
        Node-local directory for this job's parts; must lie inside the daemon's
        ``--local-dir``. It must hold two parts per rank (clean + dirty) times the
        replication factor (own part plus the replicas kept for clique mates).
    session_id : str
        Keeps several jobs or runs apart under one root ('' for none).
    repl_strategy : CliqueReplicationStrategy, optional
        Replicate each part to the nodes of its clique mates (``None``: no replicas).
        Load with the same strategy and world size as the save.
    socket : str, optional
        Daemon socket (see :func:`ckpt_client.connect`).
    failure_policy : str
        For synchronous saves: ``"raise"`` (default) or ``"warn"`` (a failed save is
        logged on every rank, kept in :attr:`failed_calls`, not committed, and training
        goes on). Asynchronous saves follow the policy of the queue they are scheduled on.

    Notes
    -----
    All ranks must call ``save``, ``find_latest`` and ``load`` together.

    Attributes
    ----------
    last_save_report : dict or None
        After a save finalized: ``iteration``, ``copies`` (the daemons holding a durable
        copy of this rank's part: its own node's first, then each peer's),
        ``wanted_copies`` (the replication factor), ``replicated_to`` (the peers among
        them), ``failed`` (address -> reason) and ``reduced_redundancy``.
    last_load_report : dict or None
        After ``load``: ``source`` (``"daemon_memory"``: the node's daemon still held the
        part in its staging pool; ``"local_disk"``; or ``"peer"``: fetched from another
        node), ``holder`` (the peer's address when the bytes came from a peer, else
        ``None``), ``bytes`` and ``seconds`` of the load, ``iteration``, ``tried`` (holders
        that failed first, with the reason) and ``moved_aside`` (where a corrupted own part
        was set aside, or ``None``).
    """

    def __init__(self, root_local_ckpt_dir: str | os.PathLike, session_id: str = "",
                 repl_strategy: CliqueReplicationStrategy | None = None,
                 socket: str | None = None, *, failure_policy: str = "raise") -> None:
        protocol.check_session_id(session_id)
        self._queue = AsyncCallsQueue(failure_policy=failure_policy)  # for synchronous saves
        self.root = os.path.abspath(os.fspath(root_local_ckpt_dir))
        self.session_id = session_id
        self.repl_strategy = repl_strategy
        self._socket = socket
        self._session = SessionRegistration(session_id, self.root, repl_strategy)
        self._latest: int | None = None
        self._found = Latest()
        self.last_save_report: dict | None = None
        self.last_load_report: dict | None = None

    @property
    def failed_calls(self) -> list:
        """``(call_idx, CheckpointException)`` of synchronous saves that failed under
        ``failure_policy="warn"``."""
        return self._queue.failed_calls

    @property
    def local_ckpt_dir(self) -> Path:
        """This session's directory: the daemon keeps the parts in ``iter_<N>/`` below it."""
        return Path(self.root, self.session_id)

    # ------------------------------------------------------------------ session
    def _connection(self) -> DaemonConnection:
        return connect(self._socket)

    def _ensure_session(self, agree: bool = True) -> DaemonConnection:
        connection, registered = self._session.ensure(self._connection, agree)
        if registered:
            self._latest = None
        return connection

    # ------------------------------------------------------------------ save
    def save(self, ta_state_dict: TensorAwareStateDict, iteration: int,
             is_async: bool = False) -> AsyncRequest | None:
        """Save this rank's part of ``iteration`` (call on all ranks together).

        Returns once the tensors are staged with the daemon (changing them afterwards
        does not change the checkpoint). The daemon writes the part locally and streams
        it to the clique mates' nodes in parallel.

        Parameters
        ----------
        ta_state_dict : TensorAwareStateDict
            The state to save: a ``BasicTensorAwareStateDict`` is stored as plain values
            and raw tensors; any other subclass as the reference stores it (see
            :mod:`ckpt_client.local.tensor_aware`).
        iteration : int
            Training iteration (>= 0); ``find_latest`` returns the highest complete one.
        is_async : bool
            ``False``: block until every rank's part is durable (and replicated, or the
            peer given up on), then commit. ``True``: return an :class:`AsyncRequest` to
            schedule on an :class:`AsyncCallsQueue`; its finalize step commits.

        Returns
        -------
        AsyncRequest or None

        Raises
        ------
        CheckpointException
            On every rank, if any rank's save failed or its daemon refused it (sync
            saves; async ones raise from the queue's finalize).
        """
        if not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"iteration must be a non-negative int, not {iteration!r}")
        started = time.time()
        rank, _ = rank_and_world()
        skeleton, tensors, layout, _ = flatten_state_dict(part_state_dict(ta_state_dict))
        # Version 2 layout: the file mirrors the staging extent, so the daemon writes it and
        # loads read it with O_DIRECT, every tensor in place (writable: torch.frombuffer)
        header = bytearray(protocol.encode_part_header(
            skeleton, buffers_of(layout), rank, iteration, self.session_id))
        try:
            connection = self._ensure_session(agree=False)
            daemon_save = stage(connection, SaveFormat.LOCAL, self.root, [header, *tensors],
                                session=self.session_id, iteration=iteration)
        except (DaemonRequestError, DaemonUnavailableError) as exc:
            log.error("rank %d: local save of iteration %d refused: %s", rank, iteration, exc)
            daemon_save = RefusedSave(rank, str(exc))
        request = AsyncRequest(daemon_saves=(daemon_save,),
                               finalize_fns=[partial(self._finalize_save, iteration, daemon_save)])
        if is_async:
            spans.note((daemon_save,), BLOCKED_SPAN, started, time.time())
            return request
        queue = self._queue
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        # A blocking save holds the trainer until its finalize ended, which is after the
        # queue sent the save's other spans: this one goes on its own.
        if hasattr(daemon_save, "spans"):
            daemon_save.spans[:] = []
        spans.note((daemon_save,), BLOCKED_SPAN, started, time.time())
        spans.report((daemon_save,))
        return None

    def _finalize_save(self, iteration: int, daemon_save) -> None:
        """Every rank's part is durable: report replication, commit on this node."""
        own = self._session.address_of(daemon_save.connection.rank) or "this node"
        self.last_save_report = save_report(iteration, daemon_save.last.replication or {}, own)
        if self.last_save_report["reduced_redundancy"]:
            log.warning("rank %d: iteration %d saved with reduced redundancy: %s",
                        daemon_save.connection.rank, iteration,
                        self.last_save_report["failed"] or "clique mates share this node")
        try:
            self._connection().call(MessageType.LOCAL_COMMIT,
                                    LocalCommit(session=self.session_id, iteration=iteration))
        except (DaemonUnavailableError, DaemonRequestError) as exc:
            # The part is durable and the other nodes' commit marks stand for it.
            log.warning("rank %d: could not mark iteration %d committed on this node: %s",
                        daemon_save.connection.rank, iteration, exc)
        self._latest = None

    # ------------------------------------------------------------------ find / load
    def find_latest(self) -> int:
        """The highest iteration whose parts of every rank exist, verified, on some node.

        Collective. Only committed iterations count (every rank's save of it succeeded).

        Returns
        -------
        int
            The iteration, or -1 when there is none.

        Raises
        ------
        CheckpointException
            On every rank, if some rank's daemon could not list its parts.
        """
        connection = self._ensure_session()
        rank, world_size = rank_and_world()
        inventory, error = None, None
        try:
            inventory = connection.call(MessageType.LOCAL_INVENTORY,
                                        LocalInventory(session=self.session_id),
                                        timeout=waits.local_load(connection.deadlines))
        except (DaemonUnavailableError, DaemonRequestError) as exc:
            error = f"rank {rank}: listing local parts failed: {exc}"
        gathered = all_gather((rank, inventory, error))
        failures = {r: e for r, _, e in gathered if e}
        if failures:
            raise CheckpointException("find_latest failed", failures)
        self._found = choose_latest(gathered, inventory, world_size, self._session.order_holders)
        missing = self._found.missing_text()
        if missing:
            log.warning("rank %d: %s; the latest complete one is %s", rank, missing,
                        self._found.iteration)
        self._latest = self._found.iteration
        log.info("rank %d: latest complete local checkpoint: %d", rank, self._latest)
        return self._latest

    def load(self) -> tuple[TensorAwareStateDict, CkptID]:
        """Load this rank's part of the latest complete iteration (call on all ranks).

        The part comes from the daemon's memory when it still keeps it (a trainer
        restarted on a node whose daemon lived on), else from this node's disk (read once,
        with O_DIRECT where the filesystem allows, checksummed in the same pass), else the
        daemon fetches it from a holder. A part missing on this node, or one that fails
        its checksum (it is moved aside, never deleted, with a warning naming it), is
        fetched from the holders (clique mates first); a replica failing its checksum is
        never used.

        Returns
        -------
        (TensorAwareStateDict, (iteration, rank, session_id))
            A ``BasicTensorAwareStateDict`` (tensors on the CPU; ``model.load_state_dict``
            copies them into place), or the saved subclass, its tensors restored to their
            devices.

        Raises
        ------
        FileNotFoundError
            If no complete local checkpoint exists (naming the ranks whose parts every node
            lost, if a newer iteration was committed).
        DaemonRequestError
            If the part is missing here and no holder could provide a verified copy (the
            message names the rank, iteration and the holders tried).
        """
        if self._latest is None:
            self.find_latest()
        rank, _ = rank_and_world()
        if self._latest < 0:
            missing = self._found.missing_text()
            raise FileNotFoundError(f"rank {rank}: no complete local checkpoint of session "
                                    f"{self.session_id!r} under {self.root} on any node"
                                    f"{'; ' + missing if missing else ''}")
        iteration, started = self._latest, time.monotonic()
        report = {"iteration": iteration, "source": "local_disk", "holder": None, "tried": [],
                  "moved_aside": None, "bytes": 0, "seconds": 0.0}
        loader = PartLoader(self.session_id, self._connection, self._session.address_of(rank))
        state_dict, header, path = loader.load(rank, self._found, report)
        if header.get("owner") != rank or header.get("iteration") != iteration:
            raise ValueError(f"rank {header.get('owner')}'s part of iteration "
                             f"{header.get('iteration')} was found, not rank {rank}'s of "
                             f"{iteration} ({path or 'daemon memory'})")
        report["seconds"] = time.monotonic() - started
        self.last_load_report = report
        restored = restore_from_part(state_dict)
        if restored is None:
            restored = BasicTensorAwareStateDict(state_dict)
        return restored, (iteration, rank, self.session_id)
