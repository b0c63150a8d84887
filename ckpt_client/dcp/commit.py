"""Committing a DCP checkpoint: ``.metadata`` written last, by the coordinator, once.

Both DCP front-ends commit here: ``ckpt_client.dcp`` (``StorageWriter``, ``async_save``)
and the reference's ``FileSystemWriterAsync`` flow (:mod:`ckpt_client.megatron`).
:func:`commit_metadata` fills in the global metadata and has the daemon write
``.metadata`` (temporary name, fsync, rename), so a checkpoint is either complete or
invisible; :func:`commit_on_coordinator` is the step around it: gather every rank's
write results to the coordinator, commit there unless a rank failed, and tell every rank
the same outcome.
"""

from __future__ import annotations

import os
import pickle
from typing import Callable

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ckptd.protocol import CommitFile, MessageType
from ckpt_client.collectives import Group
from ckpt_client.dcp.files import METADATA_NAME
from ckpt_client.transport import waits
from ckpt_client.transport.connection import DaemonConnection


def metadata_bytes(metadata: Metadata, results: list, storage_meta: StorageMeta | None, *,
                   stock_files: bool = False) -> bytes:
    """The ``.metadata`` file: ``metadata`` completed with every rank's write results.

    Parameters
    ----------
    results : list of list of WriteResult
        Every rank's write results, in rank order.
    stock_files : bool
        The files are torch's own layout with no checksum records beside them: the
        checksums the daemon computed (each rank's ``results.file_checksums``) go into
        the metadata, as its ``ckptd_checksums`` attribute.
    """
    metadata.version = CURRENT_DCP_VERSION
    metadata.storage_data = {r.index: r.storage_data for rank_results in results
                             for r in rank_results}
    metadata.storage_meta = storage_meta
    if stock_files:
        metadata.ckptd_checksums = {name: value for rank_results in results
                                    for name, value in
                                    getattr(rank_results, "file_checksums", {}).items()}
    return pickle.dumps(metadata)


def commit_metadata(connection: DaemonConnection, directory: str, metadata: Metadata,
                    results: list, storage_meta: StorageMeta | None, *,
                    stock_files: bool = False) -> None:
    """Commit ``<directory>/.metadata`` (:func:`metadata_bytes`) through the daemon.

    The wait outlasts the daemon's own deadline for the commit
    (:func:`ckpt_client.transport.waits.commit_file`: a tiered daemon answers once every
    file the metadata names is durable at the target), so a rank never reports a commit
    failed that the daemon goes on to make.

    Raises
    ------
    DaemonRequestError, DaemonUnavailableError
        If the daemon could not write it.
    """
    data = metadata_bytes(metadata, results, storage_meta, stock_files=stock_files)
    connection.call(MessageType.COMMIT_FILE,
                    CommitFile(path=os.path.join(directory, METADATA_NAME),
                               stock_files=stock_files),
                    frames=[data], timeout=waits.commit_file(connection.deadlines,
                                                             connection.tiered))


def _failure_of(commit: Callable[[list], None], gathered: list) -> Exception | None:
    """``commit(gathered)``'s exception, or ``None``. Caught here, not in the caller: a
    traceback through the frame that keeps the errors would make a reference cycle
    (errors -> exception -> frame -> errors) holding what the commit reached."""
    try:
        commit(gathered)
    except Exception as exc:
        return exc
    return None


def commit_on_coordinator(group: Group, results, commit: Callable[[list], None], *,
                          cause: Callable[[int, BaseException], str],
                          rank_failures: Callable[[list], dict] | None = None,
                          ) -> tuple[dict[int, BaseException], dict[int, str]]:
    """Gather every rank's ``results`` to the coordinator, which runs ``commit(gathered)``
    unless a rank failed; every rank learns the same outcome (call on all ranks).

    Parameters
    ----------
    group : Group
        The ranks of the save and their coordinator.
    results
        This rank's write results (or its wrapped failure).
    commit : callable
        ``commit(gathered)`` on the coordinator: every rank's results, in group order.
    cause : callable
        ``cause(global_rank, exception)``: the text every rank reports for a failure.
    rank_failures : callable, optional
        ``rank_failures(gathered) -> {global rank: exception}``: ranks whose write failed
        (then nothing is committed).

    Returns
    -------
    (errors, causes)
        ``errors``: on the coordinator, global rank -> exception (empty elsewhere);
        ``causes``: on every rank, global rank -> text. Both empty: committed.
    """
    gathered = group.gather_to_coordinator(results)
    errors: dict[int, BaseException] = {}
    if group.is_coordinator:
        errors = dict(rank_failures(gathered)) if rank_failures is not None else {}
        if not errors:
            failure = _failure_of(commit, gathered)
            if failure is not None:  # every rank must learn that the commit failed
                errors[group.coordinator_global] = failure
    causes = group.broadcast_from_coordinator({rank: cause(rank, exc)
                                               for rank, exc in errors.items()})
    return errors, causes
