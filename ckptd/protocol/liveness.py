"""Whether the process at the other end is still alive.

The daemon watches its trainers and the client watches its daemon the same way: a pid
that names no process, or a zombie, is dead. Owns that one test; it must not signal or
wait on any process.
"""

from __future__ import annotations

__all__ = ["process_alive"]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (how each side watches the other)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
