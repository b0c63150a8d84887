"""Local checkpoints: each rank's part on its own node, replicated to peers by the daemons.

What users call: :class:`LocalCheckpointManager`, :class:`BasicTensorAwareStateDict`,
:class:`CliqueReplicationStrategy`.
"""

from ckpt_client.local.manager import (BasicTensorAwareStateDict, CkptID,
                                       CliqueReplicationStrategy, LocalCheckpointManager)

__all__ = ["BasicTensorAwareStateDict", "CkptID", "CliqueReplicationStrategy",
           "LocalCheckpointManager"]
