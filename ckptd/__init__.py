"""ckptd: the per-node checkpoint daemon.

Module map (the tree follows the architecture):

- ``protocol``   the wire contract, shared with ``ckpt_client`` (with ``checksum``, the
                 only modules the client may import)
- ``server``     the serve loop and the life of each save request
- ``pool``       the shared-memory staging pool and its allocator
- ``cuda_staging`` opening trainers' CUDA IPC handles and copying device-to-host
- ``writers``    writer processes that make files durable
- ``ledger``     ranks, requests and the status document
- ``roots``      which paths may be written
- ``readiness``  ready line, ready file, sd_notify
- ``status``     the ``ckptd status`` client (must not import torch)
- ``cli``        the ``ckptd`` command
"""

__version__ = "0.1.0"
