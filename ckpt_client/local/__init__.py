"""Local checkpoints: each rank's part on its own node, replicated to peers by the daemons.

What users call: :class:`LocalCheckpointManager`, :class:`BasicTensorAwareStateDict`,
:class:`CliqueReplicationStrategy`. The modules:

- :mod:`~ckpt_client.local.manager` — ``LocalCheckpointManager``: save, find the latest, load
- :mod:`~ckpt_client.local.cliques` — which ranks keep a copy of which rank's part
- :mod:`~ckpt_client.local.tensor_aware` — the ``TensorAwareStateDict`` interface, and how
  one becomes a part and back
- :mod:`~ckpt_client.local.session` — the key exchange that registers a session with
  every rank's daemon
- :mod:`~ckpt_client.local.latest` — which iteration is complete, and who holds its parts
- :mod:`~ckpt_client.local.loader` — where this rank's part comes from (memory, disk, peer)
- :mod:`~ckpt_client.local.part_file` — reading a part file (or the daemon's memory copy),
  checked in the same pass
- :mod:`~ckpt_client.local.part_io` — the reads behind it (O_DIRECT or buffered, memory-tier
  copies in cache-sized pieces)
"""

from ckpt_client.local.cliques import CliqueReplicationStrategy
from ckpt_client.local.manager import CkptID, LocalCheckpointManager
from ckpt_client.local.tensor_aware import BasicTensorAwareStateDict

__all__ = ["BasicTensorAwareStateDict", "CkptID", "CliqueReplicationStrategy",
           "LocalCheckpointManager"]
