"""Writing a benchmark's report: the Markdown table and the raw figures beside it."""

from __future__ import annotations

import json
import os


def write_report(out: str | None, text: str, report: dict) -> None:
    """Write ``text`` to ``out`` and ``report`` as JSON next to it (same name, ``.json``)."""
    if not out:
        return
    with open(out, "w") as f:
        f.write(text)
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(report, f, indent=1)
