"""The ``netbed`` pytest fixture: a factory of network-namespace beds (``tests/netbed.py``).

Import it into a conftest or a test module (``from conftest_netbed import netbed``); every
bed a test makes is torn down when the test ends, passed or failed, and a teardown that
leaves something behind fails the test instead of passing silently.
"""

from __future__ import annotations

import pytest

from netbed import NetBed, NetBedError


@pytest.fixture
def netbed():
    """Factory: ``netbed(nodes=2, rate=None, tmpfs_size="2g", *, require_netns=False)``.

    Returns a :class:`netbed.NetBed` that is up. With ``require_netns=True`` a bed that had
    to fall back to loopback skips the test, with the reason in the skip message.
    """
    made: list[NetBed] = []

    def make(nodes: int = 2, rate: str | None = None, tmpfs_size: str = "2g", *,
             require_netns: bool = False, **options) -> NetBed:
        bed = NetBed(nodes, rate, tmpfs_size, **options)
        made.append(bed)
        bed.up()
        if require_netns and bed.mode != "netns":
            pytest.skip(f"needs network namespaces; the bed runs in {bed.mode} mode: "
                        f"{bed.mode_reason}")
        return bed

    yield make
    problems = []
    for bed in reversed(made):
        try:
            bed.down()
        except NetBedError as exc:
            problems.append(str(exc))
    if problems:
        pytest.fail("netbed teardown left things behind: " + "; ".join(problems))
