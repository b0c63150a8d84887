"""Copying a blocking DCP save with the previous save's plan while this one is planned.

A training loop saves the same structure again and again, so the final plan of a group's
previous save is almost always the final plan of this one. A blocking save therefore
starts its copy into the daemon's pool at once, with that guess (with ``enable_cache``
the guess is the cached plan, and what overlaps the copy is the structure check that
confirms it, ``CKPTD_DCP_GUESS_CACHED``): each guessed item's
value is looked up in *this* state dict by the path recorded for it, and the connection's
background stager sends the STAGE and copies (``copy_`` releases the interpreter lock),
holding the copied bytes back from the writers. The save then plans exactly as before:
local plan, plan collectives, global plan; nothing is skipped. The copy is adopted only
when the plan made is the guessed one, item for item under the same file prefix, and
every item resolves to the very value that was copied (the same tensor object; for a
non-tensor leaf, the same bytes). Anything else drops the guess unwritten (the daemon
frees its extent; no byte of it reaches a writer) and stages the final plan the ordinary
way. Planning so overlaps the copy instead of adding to it.

A wrong guess costs a copy: the staging after it waits for the guessed copy to end. So
a kind of state dict is guessed only while its plan holds: after a save whose plan
differed from the remembered one, the next save copies after planning and re-arms the
guess if its plan repeats; a guess whose plan matched but whose values did not (a
planner that resolves items its own way) is never made again for that kind.

Owns the remembered plans (per process group, planner class and kind of state dict, the
torch format's sent-ahead kinds) with the item descriptions they were last staged with
(handed to a save staged after planning too, :func:`kept_descriptions`), and one save's
guessed copy until adopted or dropped.
Planning is :mod:`ckpt_client.dcp.planning`'s; staging is the writer's.
"""

from __future__ import annotations

import io
import logging
import math
import operator
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from ckptd import knobs
from ckpt_client.collectives import Group
from ckpt_client.dcp.plan_reuse import ReusablePlan, planner_allows_reuse
from ckpt_client.dcp.writer import DaemonStorageWriter
from ckpt_client.errors import CheckpointException, DaemonRequestError, DaemonUnavailableError
from ckpt_client.transport.connection import DaemonConnection
from ckpt_client.transport.daemon_save import abort_held
from ckpt_client.transport.flatten import describe, dtype_name
from ckpt_client.transport.handover import handover_for
from ckpt_client.transport.sent_ahead import SentAhead, dropped_on_error, kind_of

log = logging.getLogger(__name__)

#: Pickles non-tensor leaves as ``DefaultSavePlanner.transform_object`` does (stateless);
#: only planners that resolve items exactly so are guessed for.
_TRANSFORM = DefaultSavePlanner()
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


@dataclass
class _Remembered:
    plan: SavePlan            # the final plan of the kind's last save
    paths: ReusablePlan       # finds each item's value again, by its recorded path
    armed: bool               # the plan held (or was new): the next save guesses it
    buffers: list | None = None  # the plan's descriptions, kept while byte sizes repeat
    byte_items: list = field(default_factory=list)  # the indices of its byte items
    #: The last guessed copy began within ``DCP_GUESS_COPY_WAIT``: the next save waits
    #: that long for its copy to begin before it plans (else it plans at once).
    wait_for_copy: bool = True
    #: (connection weakref, buffers, request id): the last guessed save was staged with
    #: the very ``buffers`` as that request of that connection, whose layout the daemon
    #: keeps: the next guess's STAGE names it instead of sending them.
    staged_as: tuple | None = None
    #: The last lookup found device tensors (staged after planning): no STAGE goes ahead.
    on_device: bool = False
    #: The last save of the kind found ``buffers`` as they were (each byte item kept its
    #: size): only then does the next guess send its STAGE ahead with them, as a torch
    #: save's goes ahead only once its last two saves had one layout. A leaf whose size
    #: changes from save to save (a note alternating, a growing list) would otherwise
    #: have each STAGE ahead admitted by the daemon (its extent reserved, write-ahead
    #: jobs sent) only to be aborted.
    steady: bool = False


_remembered: dict = {}
#: Kinds whose guess matched the plan but not the values: never guessed again.
_never: set = set()


def _key(group: Group, planner: SavePlanner, state_dict) -> tuple:
    return (id(group.group), group.size, type(planner).__name__, kind_of(state_dict))


def _same_plan(plan: SavePlan, other: SavePlan) -> bool:
    if plan.storage_data != other.storage_data or len(plan.items) != len(other.items):
        return False
    # The short route hands out the very items of the previous save for the same inputs.
    return all(map(operator.is_, plan.items, other.items)) or plan.items == other.items


def _same_values(sources: list, guessed: list) -> bool:
    if all(map(operator.is_, sources, guessed)):
        return True
    for new, old in zip(sources, guessed):
        if new is not old and not (isinstance(new, io.BytesIO) and isinstance(old, io.BytesIO)
                                   and new.getbuffer() == old.getbuffer()):
            return False
    return True


def _plain_values(plan: SavePlan, paths: ReusablePlan, state_dict) -> bool:
    """Whether each of ``plan``'s items is a plain tensor or a non-tensor leaf (a DTensor
    item is its local shard, which a path does not lead to)."""
    for item in plan.items:
        value = state_dict
        for element in paths.paths[item.index.fqn]:
            value = value[element]
        if isinstance(value, torch.Tensor) and type(value) not in _PLAIN_TENSORS:
            return False
    return True


def _described(plan: SavePlan, sources: list) -> list:
    """The ``[dtype, shape, nbytes]`` of each of ``plan``'s items: a tensor's as the plan
    records it, a byte item's as ``sources`` has it.

    Never a tensor's as the value found at its path: the guess does not check that value
    (its dtype or shape may have changed since the plan was made), and the copy must go
    into views of the plan's layout. A changed value is then cast (or fails to copy)
    there, and the plan this save makes differs from the guessed one, so the copy is
    dropped; while the plans are equal, every value has the plan's dtype and shape.
    """
    buffers = []
    for item, source in zip(plan.items, sources):
        data = item.tensor_data
        if data is None:
            buffers.append(describe(source))
            continue
        dtype, shape = data.properties.dtype, list(data.chunk.sizes)
        buffers.append([dtype_name(dtype), shape, math.prod(shape) * dtype.itemsize])
    return buffers


def _host_buffers(sources: list) -> list | None:
    """``sources`` as CPU tensors (a byte item as a uint8 view of its bytes: the copy is
    then one batched call with no Python per item on the copying thread, which would
    queue behind this thread's planning for the interpreter lock); ``None`` if a source
    is a device tensor."""
    copied = []
    for source in sources:
        if type(source) is io.BytesIO:
            source = torch.frombuffer(source.getbuffer(), dtype=torch.uint8)
        elif source.is_cuda:
            return None
        copied.append(source)
    return copied


def _kept_descriptions(known: _Remembered, sources: list) -> list:
    """The descriptions of ``known.plan``'s items as ``sources`` (resolved for that plan)
    has them: the very list kept from the save before while each byte item keeps its
    size (a tensor's is the plan's: see :func:`_described`), so that the staging finds
    its layout and pool views without a compare; else made and kept anew (the kind is
    then not steady: :attr:`_Remembered.steady`)."""
    buffers = known.buffers
    known.steady = buffers is not None and all(
        buffers[i][2] == sources[i].getbuffer().nbytes for i in known.byte_items)
    if not known.steady:
        buffers = known.buffers = _described(known.plan, sources)
        known.byte_items = [i for i, source in enumerate(sources)
                            if type(source) is io.BytesIO]
    return buffers


def kept_descriptions(group: Group, planner: SavePlanner, state_dict, final_plan: SavePlan,
                      sources: list) -> list | None:
    """For a save staged after planning (zero-stall, or not guessed): the descriptions
    of ``final_plan``'s ``sources`` kept from the previous save of the kind when its
    plan was the same (:func:`_kept_descriptions`), else ``None`` (described by the
    staging)."""
    if not knobs.DCP_KEEP_DESCRIPTIONS.get() or type(state_dict) is not dict:
        return None
    known = _remembered.get(_key(group, planner, state_dict))
    if known is None or not _same_plan(final_plan, known.plan):
        return None
    return _kept_descriptions(known, sources)


def remember(group: Group, planner: SavePlanner, state_dict, final_plan: SavePlan,
             reused: ReusablePlan | None) -> None:
    """``final_plan`` is what this save of ``state_dict`` was written with: the next save
    of its kind may be copied with it while it plans.

    ``reused``: the cached plan's paths when ``enable_cache`` reused the local plan (the
    planner was then not set up).
    """
    if not knobs.DCP_GUESS_PLAN.get() or type(state_dict) is not dict \
            or not planner_allows_reuse(planner):
        return
    key = _key(group, planner, state_dict)
    if key in _never:
        return
    known = _remembered.get(key)
    if known is not None and _same_plan(final_plan, known.plan):
        known.armed = True
        if reused is not None:  # the cache's own paths: see GuessedCopy.sources_for
            known.paths = reused
        return
    mappings = getattr(planner, "mappings", None) if reused is None else None
    if reused is None and not isinstance(mappings, dict):
        _remembered.pop(key, None)
        return
    try:
        paths = reused or ReusablePlan(None, final_plan, state_dict, mappings)
        guessable = _plain_values(final_plan, paths, state_dict)
    except (KeyError, IndexError, TypeError):  # a key DCP's mappings cannot lead back to
        guessable = False
    if not guessable:
        _remembered.pop(key, None)
        return
    _remembered.pop(key, None)
    _remembered[key] = _Remembered(final_plan, paths, armed=known is None)
    while len(_remembered) > max(1, knobs.DCP_GUESS_KINDS.get()):
        _remembered.pop(next(iter(_remembered)))


class _NoGuess(Exception):
    """This save is not copied with its kind's remembered plan (the message says why)."""


def _look_up(known: _Remembered, state_dict) -> tuple[list, list]:
    """The values of ``known.plan``'s items in ``state_dict``, and those values as host
    buffers to copy.

    Raises
    ------
    _NoGuess
        The state dict no longer has the plan's items (the guess is disarmed: the save
        plans first), or holds device tensors (they stage by their own route, the
        daemon copying them from IPC handles with producer events, after planning).
    """
    try:
        sources = known.paths.sources(known.plan, state_dict, _TRANSFORM)
        copied = _host_buffers(sources)
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        known.armed = False
        raise _NoGuess(f"the state dict no longer has the guessed plan's items ({exc!r})") \
            from None
    known.on_device = copied is None
    if copied is None:
        raise _NoGuess("the state dict holds device tensors")
    return sources, copied


def _send_ahead(writer: DaemonStorageWriter, connection: DaemonConnection,
                known: _Remembered) -> SentAhead | None:
    """The STAGE of a copy with ``known``'s plan and descriptions, sent before its items
    are looked up (the daemon answers meanwhile), naming the layout of the last guessed
    save of the kind when it was staged with these very descriptions; ``None`` when
    there is nothing steady to send it with (a first guess, descriptions the last save
    made anew, a save streamed in several requests) or a zero-stall save of the
    connection is still on its way (saves reach the daemon in the order they were
    made)."""
    buffers = known.buffers
    if not knobs.DCP_STAGE_AHEAD.get() or not known.steady or known.on_device:
        return None
    if not handover_for(connection).idle():
        return None
    body = writer.whole_stage(known.plan, buffers, connection)
    if body is None:
        return None
    staged = known.staged_as
    named = staged is not None and staged[0]() is connection and staged[1] is buffers
    # Dropped without waiting for the reply: the save goes on to plan meanwhile.
    return SentAhead.send_body(connection, body, staged[2] if named else None,
                               wait_on_drop=False)


class GuessedCopy:
    """One blocking save's copy made with the remembered plan, until adopted or dropped."""

    def __init__(self, key: tuple, known: _Remembered, sources: list, saves: tuple,
                 release: threading.Event, sent_at: float) -> None:
        self.key = key
        self.known = known
        self.sources = sources
        self.saves = saves
        self.release = release
        self.sent_at = sent_at  # monotonic time the save was handed to the stager
        self.staged_as: tuple | None = None  # (connection weakref, the buffers staged)

    @classmethod
    def start(cls, state_dict, writer: DaemonStorageWriter, planner: SavePlanner,
              group: Group) -> "GuessedCopy | None":
        """Start copying ``state_dict`` with its kind's remembered plan; ``None`` if there
        is none to guess with (or the daemon refused: the ordinary staging meets it)."""
        if not knobs.DCP_GUESS_PLAN.get() or type(state_dict) is not dict \
                or not planner_allows_reuse(planner):
            return None
        key = _key(group, planner, state_dict)
        known = _remembered.get(key)
        if known is None or not known.armed:
            return None
        plan = known.plan
        try:
            connection = writer.connection
        except DaemonUnavailableError:
            return None  # the ordinary staging meets it, after the planning collectives
        ahead = _send_ahead(writer, connection, known)  # answered while items are looked up
        with dropped_on_error(ahead):
            try:
                sources, copied = _look_up(known, state_dict)
            except _NoGuess as exc:
                log.debug("no guessed copy: %s", exc)
                if ahead is not None:
                    ahead.drop(f"not copied with the previous save's plan: {exc}")
                return None
            buffers = _kept_descriptions(known, sources)
        release, sent_at = threading.Event(), time.monotonic()
        try:
            saves = writer.stage(plan, _TRANSFORM, zero_stall=True, sources=copied,
                                 hold=release, buffers=buffers, caller_waits=True,
                                 on_cpu=True, ahead=ahead)
        except (DaemonRequestError, DaemonUnavailableError, ValueError) as exc:
            log.debug("no guessed copy: %s", exc)  # the ordinary staging meets it again
            return None
        copy = cls(key, known, sources, saves, release, sent_at)
        copy.staged_as = (weakref.ref(connection), buffers)
        if known.wait_for_copy:
            try:
                saves[0].copy_began.wait(knobs.DCP_GUESS_COPY_WAIT.get())
            except BaseException as exc:  # an interrupt: the held copy must not stay held
                copy.drop(f"interrupted before planning ({type(exc).__name__})")
                raise
        return copy

    def sources_for(self, final_plan: SavePlan, reused: ReusablePlan | None) -> list | None:
        """The values this copy was made of, as ``final_plan``'s sources, when they are
        what resolving it would find again: a cached save whose reused plan is the very
        plan guessed and whose paths are the very paths the guess looked its values up
        by, in the same state dict during the same call (and whose planner resolves as
        the default one does). ``None``: resolve them (and :meth:`adopt` compares)."""
        if reused is None or reused is not self.known.paths or final_plan is not self.known.plan:
            return None
        return self.sources

    def adopt(self, final_plan: SavePlan, sources: list) -> tuple | None:
        """The guessed saves, staged, if they copied exactly ``final_plan``'s ``sources``;
        else ``None`` (dropped unwritten: the caller stages the final plan)."""
        if not _same_plan(final_plan, self.known.plan):
            self.known.armed = False
            return self._drop("the plan differs from the previous save's")
        if not _same_values(sources, self.sources):
            _never.add(self.key)
            _remembered.pop(self.key, None)
            return self._drop("the plan's items resolve to other values than those the "
                              "previous save's paths led to")
        # What was staged is described by the guessed plan (_described), which is now the
        # final plan: each item's dtype and shape are those the final plan records.
        self.release.set()
        try:
            for save in self.saves:
                save.wait_staged()
        except CheckpointException as exc:
            # staged again, to fail exactly as a direct save does
            return self._drop(f"the guessed copy failed ({exc})")
        self._note_copy_start()
        if len(self.saves) == 1 and self.staged_as is not None:
            self.known.staged_as = (*self.staged_as, self.saves[0].request_id)
        return self.saves

    def drop(self, reason: str) -> None:
        """The save failed (its planning, or its staging after the guess): abort the
        guessed saves before any byte reaches a writer. The next save of the kind copies
        after planning, and re-arms the guess if its plan is the remembered one."""
        self.known.armed = False
        return self._drop(reason)

    def disarm(self) -> None:
        """The save failed after its guessed copy was adopted or dropped (the daemon
        refused the staging that followed): the next save of the kind copies after
        planning, as after any failed save."""
        self.known.armed = False

    def _drop(self, reason: str) -> None:
        log.debug("a DCP save's guessed copy dropped: %s", reason)
        self._note_copy_start()
        abort_held(self.saves, self.release,
                   f"copied with the previous save's plan, dropped: {reason}")
        return None

    def _note_copy_start(self) -> None:
        """Whether the next guess of this kind waits for its copy to begin: only if this
        one's STAGE was answered within the wait. One that waited for pool space (earlier
        saves still writing) would have kept the save from planning the whole wait."""
        accepted = self.saves[0].accepted_at
        self.known.wait_for_copy = accepted is not None and \
            accepted - self.sent_at <= knobs.DCP_GUESS_COPY_WAIT.get()
