"""Handing tensors to the daemon: describe, reserve, copy (or export CUDA handles), confirm.

A state dict becomes a msgpack *skeleton* (its structure with tensors replaced by
references) plus a list of buffers. CPU tensors are copied by this process into the
extent the daemon reserved in the shared staging pool; when every tensor is on a GPU and
the daemon has CUDA, the daemon copies them itself from CUDA IPC handles. Either way
:func:`stage` returns only once the bytes are in the pool (the STAGED point), so the
caller may change its tensors right after. Nothing is pickled and nothing aliases a live
tensor.
"""

from __future__ import annotations

import io
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd import knobs, protocol
from ckptd.protocol import ErrorCode, MessageType, Phase, TensorRef
from ckpt_client.connection import DaemonConnection
from ckpt_client.errors import DaemonUnavailableError, DaemonRequestError

log = logging.getLogger(__name__)


def dtype_name(dtype: torch.dtype) -> str:
    """The protocol's name for a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in protocol.BUFFER_DTYPES:
        raise TypeError(f"tensors of dtype {dtype} cannot be checkpointed through ckptd")
    return name


def plain_tensor(value: torch.Tensor, where: str) -> torch.Tensor:
    """The tensor to stage for ``value``: detached, dense; subclasses are refused."""
    if value.is_quantized or value.layout != torch.strided:
        raise TypeError(f"{where}: {value.layout} / quantized tensors are not supported; "
                        "convert them (e.g. .dequantize() or .to_dense()) before saving")
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"{where}: tensor subclass {type(value).__name__} is not supported; "
                        "save its plain local tensor instead")
    return value.detach()


def flatten_state_dict(state_dict: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Split a state dict into its msgpack skeleton and its tensors.

    Raises
    ------
    TypeError
        For values other than tensors, dicts, lists, tuples, str, bytes, int, float,
        bool and None (naming the key where it was found).
    """
    tensors: list[torch.Tensor] = []

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(plain_tensor(value, where))
            return TensorRef(len(tensors) - 1)
        if isinstance(value, dict):
            return {k: walk(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return tuple(items) if isinstance(value, tuple) else items
        if value is None or isinstance(value, (str, bytes, int, float, bool)):
            return value
        raise TypeError(f"state_dict{where} is a {type(value).__name__}, which ckptd cannot "
                        "store without pickling; store it as a tensor or a plain value")

    skeleton = walk(state_dict, "")
    return protocol.pack_value(skeleton), tensors


def describe(source: torch.Tensor | io.BytesIO | bytes) -> list:
    """The ``[dtype, shape, nbytes]`` entry for one buffer."""
    if isinstance(source, torch.Tensor):
        return [dtype_name(source.dtype), list(source.shape), source.numel() * source.element_size()]
    data = source.getbuffer() if isinstance(source, io.BytesIO) else memoryview(source)
    return ["bytes", [data.nbytes], data.nbytes]


def copy_into_pool(pool: torch.Tensor, base: int, offsets: list[int], sources: list) -> None:
    """Copy each source into the pool at ``base + offset`` (CPU or CUDA sources)."""
    for offset, source in zip(offsets, sources):
        start = base + offset
        if isinstance(source, torch.Tensor):
            nbytes = source.numel() * source.element_size()
            if nbytes:
                pool[start:start + nbytes].view(source.dtype).view(source.shape).copy_(source)
        else:
            data = source.getbuffer() if isinstance(source, io.BytesIO) else memoryview(source)
            if data.nbytes:
                with warnings.catch_warnings():
                    # torch warns that read-only buffers (bytes) could be written through
                    # the tensor; this one is only read, as the source of the copy.
                    warnings.simplefilter("ignore", UserWarning)
                    source_bytes = torch.frombuffer(data, dtype=torch.uint8)
                pool[start:start + data.nbytes].copy_(source_bytes)


@dataclass
class DaemonSave:
    """One save of this rank that the daemon has staged and is writing.

    Attributes
    ----------
    request_id : int
    path : str
    """

    connection: DaemonConnection
    request_id: int
    path: str
    files: list = field(default_factory=list)
    last: dict = field(default_factory=dict)

    def poll(self) -> dict:
        """Ask the daemon for this request's phase.

        The request belongs to the daemon incarnation that accepted it (the connection
        names it in every call): if that daemon died or was restarted, or does not know
        the request, the save reads as failed ("lost"), never as somebody else's result.
        """
        if self.last.get("phase") in Phase.FINISHED:
            return self.last
        try:
            reply = self.connection.call(MessageType.POLL, {"request_ids": [self.request_id]})
            self.last = reply["requests"][self.request_id]
        except (DaemonUnavailableError, DaemonRequestError) as exc:
            if isinstance(exc, DaemonRequestError) and exc.code != ErrorCode.DAEMON_RESTARTED:
                raise
            self.last = {"phase": "unknown", "error": str(exc)}
        if self.last.get("phase") == "unknown":
            self.last = {"phase": Phase.FAILED, "error": (
                f"rank {self.connection.rank}: save of {self.path} lost: the ckptd daemon that "
                f"accepted it (pid {self.connection.daemon_pid}) no longer has it: "
                f"{self.last.get('error')}; save again")}
        return self.last

    @property
    def rank(self) -> int:
        """The rank that made the save."""
        return self.connection.rank

    @property
    def finished(self) -> bool:
        """Whether the daemon is done with it (successfully or not)."""
        return self.poll().get("phase") in Phase.FINISHED

    @property
    def error(self) -> str | None:
        """Why it failed, or ``None`` if it succeeded (only meaningful when finished)."""
        state = self.last
        if state.get("phase") == Phase.DONE:
            return None
        return state.get("error") or f"save of {self.path} ended {state.get('phase')}"

    def forget(self, delete_files: bool) -> None:
        """Tell the daemon the outcome was consumed (and drop files of a failed save)."""
        try:
            self.connection.call(MessageType.FORGET, {"request_ids": [self.request_id],
                                                      "delete_files": delete_files}, timeout=5.0)
        except (DaemonUnavailableError, DaemonRequestError):
            pass  # a daemon that is gone keeps nothing to forget

    def abort(self) -> None:
        """Drop the request at the daemon (in-flight writes are discarded).

        Returns at once: a write already under way finishes, and the daemon removes its
        file; a later save of the same path is written only after that (the writer pool
        keeps one job per path in flight), so it can never be overwritten or removed.
        """
        try:
            self.connection.call(MessageType.ABORT, {"request_ids": [self.request_id]}, timeout=5.0)
        except (DaemonUnavailableError, DaemonRequestError):
            pass
        self.forget(delete_files=True)


class RefusedSave:
    """Stands in for a save the daemon refused (or could not take), so the refusal reaches
    every rank through the queue's agreement: raising on one rank alone would leave the
    others waiting in the completion collective."""

    finished = True

    def __init__(self, rank: int, error: str) -> None:
        self.rank = rank
        self.error = error if error.startswith(f"rank {rank}: ") else f"rank {rank}: {error}"
        self.last = {"phase": Phase.FAILED, "error": self.error}

    def forget(self, delete_files: bool) -> None:
        """Nothing was staged: nothing to forget."""

    def abort(self) -> None:
        """Nothing was staged: nothing to abort."""


def stage(connection: DaemonConnection, fmt: str, path: str, sources: list,
          skeleton: bytes = b"", files: list | None = None,
          extra: dict | None = None, allow_cuda_ipc: bool = True) -> DaemonSave:
    """Hand ``sources`` to the daemon and return once they are staged.

    Parameters
    ----------
    fmt : str
        :class:`ckptd.protocol.SaveFormat` value.
    path : str
        Destination (file for torch saves, directory for DCP).
    sources : list
        Tensors (CPU or CUDA) and byte buffers, in the order the daemon lays them out.
    skeleton, files
        Format-specific: the torch state-dict skeleton; DCP ``[name, [indices]]``.
    extra : dict, optional
        More format-specific request fields (local checkpoints: session, iteration).
    allow_cuda_ipc : bool
        ``False``: copy CUDA tensors into the pool here even when the daemon could open
        CUDA IPC handles (the reference's CPU shared-memory mode).

    Raises
    ------
    DaemonRequestError
        If the daemon refuses (path outside the roots, pool too small, ...).
    DaemonUnavailableError
        If the daemon is gone.
    """
    buffers = [describe(s) for s in sources]
    body = {"format": fmt, "path": os.path.abspath(path), "buffers": buffers,
            "skeleton": skeleton, "files": files or [], **(extra or {})}
    from ckpt_client.cuda_export import export_for_daemon

    exported = export_for_daemon(connection, sources) if allow_cuda_ipc else None
    if exported is not None:
        body["transport"] = "cuda"
        body["cuda"] = exported
        reply = connection.call(MessageType.STAGE, body, timeout=knobs.STAGE_TIMEOUT.get())
        return DaemonSave(connection, reply["request_id"], body["path"], body["files"])
    reply = connection.call(MessageType.STAGE, body, timeout=knobs.STAGE_TIMEOUT.get())
    save = DaemonSave(connection, reply["request_id"], body["path"], body["files"])
    offsets, _ = protocol.layout_extent([b[2] for b in buffers])
    try:
        copy_into_pool(connection.pool, reply["offset"], offsets, sources)
        if any(isinstance(s, torch.Tensor) and s.is_cuda for s in sources):
            torch.cuda.synchronize()
    except BaseException:
        save.abort()
        raise
    connection.call(MessageType.STAGED, {"request_id": save.request_id}, timeout=knobs.CALL_TIMEOUT.get())
    return save
