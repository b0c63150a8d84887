"""Module paths shaped like the reference's, for code written against NVRx.

Replace the ``nvidia_resiliency_ext`` prefix of an import by ``ckpt_client.compat``::

    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
    from ckpt_client.compat.checkpointing.async_ckpt.core import AsyncCallsQueue

Every module below only re-exports ckpt_client's own names (all of them are importable
from ``ckpt_client`` too); it owns no behaviour. ``docs/migrating.md`` lists each name and
how it differs from the reference.
"""
