"""Hand a tiered DCP save's commit to the coordinator's daemon at staging time.

With a daemon that stages on node-local disk (``ckptd serve --stage-dir``), a DCP save
reaches its target long after the call returned. So that the checkpoint is committed even
if every trainer dies meanwhile, the coordinator gives its daemon, right after every rank
staged, the commit it will need: the ``.metadata`` bytes and the names of every file they
reference. Offsets come from the daemon's prediction of where each item will land (in the
STAGE reply); the daemon checks its writers against it. The daemon writes ``.metadata``
at the target once every named file is durable there; the finalize step then only waits
for that outcome.

One small gather over the save's process group (every rank is inside ``async_save``
then, so it cannot interleave with the training's collectives). Zero-stall saves, whose
staging has not happened when the call returns, are committed at finalize instead.
"""

from __future__ import annotations

import dataclasses
import logging

from ckptd.protocol import Handover, MessageType
from ckpt_client.errors import DaemonRequestError, DaemonUnavailableError

log = logging.getLogger(__name__)


def hand_over(writer, saves, plan, metadata, group) -> bool:
    """Give the coordinator's daemon this save's commit (call on every rank of ``group``).

    Parameters
    ----------
    writer : ckpt_client.dcp.DaemonStorageWriter
        The save's writer (its path, connection, and how it builds ``.metadata``).
    saves : tuple
        This rank's staged saves (a refused one has no placements: nothing is handed over).
    plan : SavePlan
        This rank's final plan.
    metadata : Metadata or None
        The global metadata (on the coordinator).
    group : ckpt_client.collectives.Group

    Returns
    -------
    bool
        On the coordinator, whether its daemon took the commit; False elsewhere.
    """
    staged = all(getattr(save, "placements", None) is not None for save in saves)
    mine = None
    if staged:
        mine = (writer.write_results(saves, plan, predicted=True),
                [entry[0] for save in saves for entry in save.files])
    gathered = group.gather_to_coordinator(mine)
    if not group.is_coordinator:
        return False
    if any(entry is None for entry in gathered):
        log.info("not handing over the commit of %s: a rank did not stage (the finalize "
                 "reports why)", writer.path)
        return False
    data = writer.metadata_bytes(dataclasses.replace(metadata), [g[0] for g in gathered])
    files = [name for g in gathered for name in g[1]]
    try:
        writer.connection.call(MessageType.HANDOVER, Handover(path=writer.path, files=files),
                               frames=[data])
    except (DaemonRequestError, DaemonUnavailableError) as exc:
        # The finalize step's commit still commits it (or reports why not).
        log.warning("could not hand the commit of %s to the daemon: %s", writer.path, exc)
        return False
    return True
