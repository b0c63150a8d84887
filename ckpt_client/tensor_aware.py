"""``ckpt_client.tensor_aware``: where ``TensorAwareStateDict`` was first published.

Kept so code that imports it from here keeps working; the interface lives in
:mod:`ckpt_client.local.tensor_aware`. Owns no behaviour.
"""

from ckpt_client.local.tensor_aware import (NestedTensorAwareStateDict, TensorAwareStateDict,
                                            TensorPlaceholder)

__all__ = ["NestedTensorAwareStateDict", "TensorAwareStateDict", "TensorPlaceholder"]
