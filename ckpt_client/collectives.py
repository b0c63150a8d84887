"""The few torch.distributed collectives the client uses, in one place.

Every agreement between ranks goes through here: whether every rank's save is done (one
small int all-reduce, on the device the group's backend needs: CPU tensors for gloo, the
current GPU for NCCL), sharing failure reasons so that every rank raises the same
:class:`~ckpt_client.errors.CheckpointException`, and the object collectives of DCP
planning and of the local-checkpoint key exchange. Without an initialized process group
each function answers for this process alone, so single-process use needs no special
case in the callers.
"""

from __future__ import annotations

from typing import Any

from ckpt_client.arrivals import MARKS, lost_ranks_failure
from ckpt_client.errors import CheckpointException


def initialized():
    """``torch.distributed`` when a default process group exists, else ``None``."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_and_world(group=None) -> tuple[int, int]:
    """This process's rank and the group's size (``(0, 1)`` without a group)."""
    dist = initialized()
    return (dist.get_rank(group), dist.get_world_size(group)) if dist else (0, 1)


def all_reduce_ints(values: list[int], op=None, group=None) -> list[int]:
    """All-reduce a few ints (default: sum) on the device the group's backend needs."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor(values, dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group)
    return tensor.tolist()


def all_gather(value: Any, group=None) -> list:
    """Every rank's ``value``, in rank order (``[value]`` without a group)."""
    dist = initialized()
    if dist is None:
        return [value]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def any_rank(flag: bool, group=None) -> bool:
    """Whether ``flag`` is true on some rank."""
    dist = initialized()
    if dist is None:
        return flag
    return bool(all_reduce_ints([1 if flag else 0], dist.ReduceOp.MAX, group)[0])


def every_rank(flag: bool, group=None) -> bool:
    """Whether ``flag`` is true on every rank."""
    dist = initialized()
    if dist is None:
        return flag
    return bool(all_reduce_ints([1 if flag else 0], dist.ReduceOp.MIN, group)[0])


def raise_if_any_failed(what: str, error: str | None, group=None) -> None:
    """Share every rank's error; raise the same CheckpointException on all ranks."""
    rank, _ = rank_and_world(group)
    failures = {r: e for r, e in all_gather((rank, error), group) if e}
    if failures:
        raise CheckpointException(what, failures)


def introduce() -> None:
    """Say in the group's store which process this rank is, so that the others can tell
    it lost from late if a completion check breaks (:mod:`ckpt_client.arrivals`)."""
    if initialized() is not None:
        MARKS.introduce(rank_and_world()[0])


def agree_on_completion(done: bool, error: str | None, no_dist: bool) -> tuple[bool, dict]:
    """Combine every rank's (done, error) with one small all-reduce.

    A collective broken by a lost rank (gloo's "Connection closed by peer") ends the
    save as failed, naming the ranks that never reached this check
    (:mod:`ckpt_client.arrivals`), instead of escaping as the backend's error.

    Returns
    -------
    (all_done, failures)
        ``failures`` maps rank -> reason, identical on every rank.
    """
    dist = None if no_dist else initialized()
    if dist is None:
        rank, _ = rank_and_world()
        return done, ({rank: error} if done and error else {})
    rank, world_size = rank_and_world()
    MARKS.entering(rank)
    try:
        not_done, failed = all_reduce_ints([0 if done else 1, 1 if error else 0])
        if not_done:
            return False, {}
        failures = {r: why for r, why in all_gather((rank, error)) if why} if failed else {}
    except RuntimeError as exc:  # gloo/NCCL: a peer is gone; the group cannot be used again
        failures = lost_ranks_failure(exc, rank, world_size)
    MARKS.agreed_done()
    return True, failures


class Group:
    """The process group a DCP save runs over, with its coordinator (group rank 0).

    Parameters
    ----------
    process_group : ProcessGroup or None
        ``None``: the default group (or none at all).
    """

    def __init__(self, process_group) -> None:
        dist = initialized()
        self.group = process_group
        self.distributed = dist is not None
        self.rank, self.size = rank_and_world(process_group)
        # A group of one needs no collective: gathering or scattering one's own value is
        # the value (and pickling a plan of a thousand items both ways is not free).
        self.distributed = self.distributed and self.size > 1
        self.coordinator_global = (dist.get_global_rank(process_group, 0)
                                   if dist is not None and process_group is not None else 0)
        self.is_coordinator = self.rank == 0

    def gather_to_coordinator(self, value) -> list | None:
        """Every rank's ``value`` on the coordinator (``None`` elsewhere)."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        out = [None] * self.size if self.is_coordinator else None
        dist.gather_object(value, out, dst=self.coordinator_global, group=self.group)
        return out

    def scatter_from_coordinator(self, values: list | None):
        """Each rank's entry of the coordinator's ``values``."""
        if not self.distributed:
            return values[0]
        import torch.distributed as dist

        out = [None]
        dist.scatter_object_list(out, values, src=self.coordinator_global, group=self.group)
        return out[0]

    def broadcast_from_coordinator(self, value):
        """The coordinator's ``value`` on every rank."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=self.coordinator_global, group=self.group)
        return box[0]

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank of the group."""
        return every_rank(flag, self.group) if self.distributed else flag
