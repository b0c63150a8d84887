"""What both benchmark scripts share around a run: stopping the daemon under test, and
writing the report (the Markdown table and the raw figures beside it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess


def write_report(out: str | None, text: str, report: dict) -> None:
    """Write ``text`` to ``out`` and ``report`` as JSON next to it (same name, ``.json``)."""
    if not out:
        return
    with open(out, "w") as f:
        f.write(text)
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(report, f, indent=1)


def publish(out: str | None, text: str, report: dict) -> None:
    """Print the Markdown report and write it (and its JSON) to ``out`` when given."""
    print("\n" + text)
    write_report(out, text, report)


def stop_daemon(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM a daemon (it drains its writes), SIGKILL it if it outlives ``timeout``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
