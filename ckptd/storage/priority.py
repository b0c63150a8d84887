"""How writer processes yield the node to the trainers: CPU niceness, scheduling policy,
and I/O priority.

A checkpoint that is durable a little later costs nothing; a training step slowed by a
writer costs every GPU of the job. So writers run niced, under ``SCHED_BATCH`` (no
wake-up preemption of the trainer's threads) or ``SCHED_IDLE`` (CPU only when nothing
else wants it), and in the lowest best-effort I/O class (or the idle class). Each
setting is best effort: a kernel or container that refuses one logs it and the writer
runs at the priority it has.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

#: ``ioprio_set`` syscall numbers per architecture (no libc wrapper exists).
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_SHIFT = 13
_IO_CLASSES = {"realtime": 1, "best-effort": 2, "idle": 3}
_POLICIES = {"normal": "SCHED_OTHER", "batch": "SCHED_BATCH", "idle": "SCHED_IDLE"}


def parse_io_class(text: str) -> tuple[int, int] | None:
    """``"best-effort:7"`` -> (class, level); ``"idle"`` -> (3, 0); ``"none"`` -> None.

    Raises
    ------
    ValueError
        For an unknown class or a level outside 0-7.
    """
    if text in ("", "none"):
        return None
    name, _, level = text.partition(":")
    if name not in _IO_CLASSES:
        raise ValueError(f"unknown I/O class {name!r}: use one of {sorted(_IO_CLASSES)} or none")
    number = int(level or 0)
    if not 0 <= number <= 7:
        raise ValueError(f"I/O priority level {number} is outside 0-7")
    return _IO_CLASSES[name], number


def set_io_priority(io_class: int, level: int) -> bool:
    """``ioprio_set`` for this process; False (and a log line) where refused."""
    number = _IOPRIO_SET.get(platform.machine())
    if number is None:
        log.info("no ioprio_set on %s: writers keep their I/O priority", platform.machine())
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    value = (io_class << _IOPRIO_CLASS_SHIFT) | level
    if libc.syscall(number, _IOPRIO_WHO_PROCESS, 0, value) != 0:
        log.warning("ioprio_set(class %d, level %d) failed (errno %d): writers keep their "
                    "I/O priority", io_class, level, ctypes.get_errno())
        return False
    return True


def set_cpu_policy(policy: str) -> bool:
    """``sched_setscheduler`` to ``policy`` (normal, batch, idle); False where refused."""
    if policy not in _POLICIES:
        raise ValueError(f"unknown scheduling policy {policy!r}: use one of {sorted(_POLICIES)}")
    constant = getattr(os, _POLICIES[policy], None)
    if constant is None:
        return False
    try:
        os.sched_setscheduler(0, constant, os.sched_param(0))
    except OSError as exc:
        log.warning("sched_setscheduler(%s) failed (%s): writers keep their policy", policy, exc)
        return False
    return True


def check(policy: str, io_class: str) -> None:
    """Refuse unknown settings before any writer starts.

    Raises
    ------
    ValueError
        Naming the knob (``CKPTD_WRITER_SCHED`` / ``CKPTD_WRITER_IO_CLASS``) and the choices.
    """
    if policy not in _POLICIES:
        raise ValueError(f"CKPTD_WRITER_SCHED={policy!r} is not one of {sorted(_POLICIES)}")
    try:
        parse_io_class(io_class)
    except ValueError as exc:
        raise ValueError(f"CKPTD_WRITER_IO_CLASS={io_class!r}: {exc}") from None


def yield_to_trainers(nice: int, policy: str, io_class: str) -> None:
    """Apply the writer's niceness, CPU policy and I/O class (each best effort)."""
    if nice:
        os.nice(nice)
    set_cpu_policy(policy)
    parsed = parse_io_class(io_class)
    if parsed is not None:
        set_io_priority(*parsed)
