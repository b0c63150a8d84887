"""Storage: turning staged bytes into durable files, and the node-local checkpoint store.

- ``durable``        the one way a file is written (exclusive hidden temporary, fsync,
                     checksum record, rename, directory fsync) and durable directories;
- ``roots``          which paths may be written (the allowed ``--root`` directories);
- ``jobs``           the writer channel's vocabulary: typed jobs and results;
- ``torch_format``   torch's file format (``torch.save``'s bytes) written without torch;
- ``torch_layout``   ckptd's torch files from a per-layout template (nothing serialized
                     per tensor when a save's structure did not change);
- ``writer_process`` a writer process (``python -m ckptd.storage.writer_process``):
                     maps the staging pool, serializes and writes one file per job;
- ``writer_pool``    the daemon side: starts writers, routes jobs, reaps the dead;
- ``local_store``    the layout of node-local checkpoint parts, own and replicas;
- ``late_close``     a dropped file's name removed at once, its data freed by a
                     background close (off the serve loop).

Writers run in their own processes; the rest runs in the daemon (serve loop and
replicator thread). Nothing here knows about ranks or requests.
"""
