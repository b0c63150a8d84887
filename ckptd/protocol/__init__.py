"""The wire contract between ``ckpt_client`` and ``ckptd``: the only daemon package both import.

One concern a module, the way jupyter_client keeps framing, endpoints and channels apart:

- :mod:`~ckptd.protocol.names` — schema version, message types, phases, formats, error codes
- :mod:`~ckptd.protocol.errors` — :class:`ProtocolError`, the request failures, error bodies
- :mod:`~ckptd.protocol.framing` — header + raw frames, msgpack extension types, size limits
- :mod:`~ckptd.protocol.body` — typed bodies (:class:`Body`, :func:`check`, :class:`Empty`)
- :mod:`~ckptd.protocol.messages` — the client channel's request bodies
- :mod:`~ckptd.protocol.replies` — the client channel's reply bodies, and which answers which
- :mod:`~ckptd.protocol.layout` — where tensors sit in a staging extent
- :mod:`~ckptd.protocol.part` — the local-checkpoint part file header
- :mod:`~ckptd.protocol.rules` — session ids, replica holder order, loopback addresses
- :mod:`~ckptd.protocol.ipc` — CUDA IPC reference counters
- :mod:`~ckptd.protocol.discovery` — socket path, ready file, endpoint
- :mod:`~ckptd.protocol.liveness` — whether the process at the other end is alive
- :mod:`~ckptd.protocol.channel` — the request channel (DEALER, replies matched to requests)

This face re-exports the names of those modules: ``from ckptd import protocol;
protocol.X`` and ``from ckptd.protocol import X`` work for all of them, and ``__all__``
is the contract ``ckpt_client`` may use. Modules here import each other, never this
face. The package must stay importable without torch.
"""

from ckptd.protocol.body import *  # noqa: F401,F403
from ckptd.protocol.channel import *  # noqa: F401,F403
from ckptd.protocol.discovery import *  # noqa: F401,F403
from ckptd.protocol.errors import *  # noqa: F401,F403
from ckptd.protocol.framing import *  # noqa: F401,F403
from ckptd.protocol.ipc import *  # noqa: F401,F403
from ckptd.protocol.layout import *  # noqa: F401,F403
from ckptd.protocol.liveness import *  # noqa: F401,F403
from ckptd.protocol.messages import *  # noqa: F401,F403
from ckptd.protocol.names import *  # noqa: F401,F403
from ckptd.protocol.part import *  # noqa: F401,F403
from ckptd.protocol.replies import *  # noqa: F401,F403
from ckptd.protocol.rules import *  # noqa: F401,F403

__all__ = [
    # framing and errors
    "SCHEMA_VERSION", "MessageType", "Phase", "SaveFormat", "ErrorCode", "BUFFER_DTYPES",
    "STOCK_FILES",
    "ProtocolError", "TensorRef", "Message", "encode", "decode", "error_body",
    "pack_value", "packed_tensor_ref", "unpack_value", "fill_skeleton",
    # typed bodies of the client channel
    "Body", "Hello", "Stage", "Staged", "Copied", "Poll", "Forget", "Abort", "CommitFile",
    "LocalSession", "LocalInventory", "LocalFetch", "LocalCommit", "Handover", "Empty",
    "Trace", "TraceSpans",
    # typed reply bodies of the client channel, and which request each answers
    "DaemonDeadlines", "HelloReply", "StageReply", "StagedReply", "WrittenFile", "RequestState",
    "PollReply", "ForgetReply", "AbortReply", "CommitFileReply", "HandoverReply", "PingReply",
    "PeerInfoReply", "LocalSessionReply", "HeldPart", "LocalInventoryReply", "LocalFetchReply",
    "LocalCommitReply", "TraceSpansReply", "REPLIES", "reply_type_for",
    # staging layout and local parts
    "align_up", "layout_extent", "tensor_alignment", "encode_part_header", "decode_part_header",
    "read_part_header", "part_version", "part_layout", "PART_MAGIC", "PART_MAGIC_V2",
    "PART_FRAME_BYTES",
    # shared rules
    "check_session_id", "holder_order", "process_alive", "is_loopback_address",
    "ipc_export_id", "release_ipc_counters",
    # endpoint discovery and the request channel
    "SOCKET_ENV", "default_runtime_dir", "resolve_socket_path", "ready_file_for", "ready_pid",
    "wait_until_ready", "endpoint_for", "socket_is_live", "ensure_private_dir",
    "Channel", "ReplyTimeout", "ErrorReply",
]
