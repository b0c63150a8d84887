"""Every tunable of ckptd and ckpt_client, with its environment override, in one place.

What a knob is (and :func:`override`, the table for the docs) is :mod:`ckptd.knobs.knob`.

A knob is read when it is used (``knobs.PEER_TIMEOUT.get()``), never at import time, so a
test or an operator can change it without re-importing anything: set the environment
variable (for daemons, writers and ranks started later), or, inside one process, use
:func:`override`. Defaults of ``ckptd serve``'s options that the client's auto-start shares
(pool size, writers) live here too, so the CLI and the client cannot drift apart.

Shared by the daemon and the client (like :mod:`ckptd.protocol`); importable without torch
or zmq. Wire limits that both sides must agree on are not knobs: they are in
:mod:`ckptd.protocol`.
"""

from __future__ import annotations

from ckptd.knobs.knob import (Knob, all_knobs, define as _knob, markdown_table, override,
                              parse_bool, parse_choice, parse_size)

__all__ = [
    "Knob", "override", "all_knobs", "markdown_table", "parse_bool", "parse_choice",
    "parse_size", "POOL_SIZE", "POOL_DIR", "POOL_COLLAPSE", "POOL_FOLD_BUDGET", "WRITERS",
    "DRAIN_TIMEOUT", "STOP_LINGER", "WRITER_START_TIMEOUT", "SERVE_TICK",
    "UNCLAIMED_RESULT_SECONDS", "RECENT_REQUESTS", "RECENT_ERRORS", "TRACE_SAVES",
    "WRITER_NICE", "CHECKSUM_OVERLAP_MIN_BYTES", "WRITEBACK_EVERY_BYTES", "WRITE_MODE",
    "DIRECT_WRITE_THREADS", "DIRECT_CHUNK_BYTES", "DIRECT_IDLE_BATCH_BYTES",
    "DIRECT_BOUNCE_BYTES", "DIRECT_MIN_BYTES", "DIRECT_ALLOCATE_BYTES", "WRITE_AHEAD",
    "COPY_REPORTS", "COPY_REPORTS_MIN_CPUS", "COPY_REPORT_BYTES",
    "CHECKSUM", "CUDA_REGISTER_CHUNK_BYTES", "CUDA_PROFILE", "NUMA_PLACEMENT",
    "LEFTOVER_SWEEP_INTERVAL", "PEER_TIMEOUT",
    "PEER_PING_INTERVAL", "PEER_MISS_BUDGET", "REPLICATION_WINDOW", "PEER_IO_THREADS",
    "REPLICATOR_TICK", "PEER_LINKS", "PEER_IDLE_TIMEOUT", "METRICS_INTERVAL", "PEER_STREAMS",
    "PEER_ENCRYPTION", "PEER_HANDSHAKE_TIMEOUT", "PEER_RECEIVE_SLICE_BYTES",
    "PEER_RECEIVE_SLICE_WAIT", "PEER_BULK_PORT", "MEMORY_TIER", "AUTO_START", "AUTO_ROOTS",
    "AUTO_EXIT_WHEN_IDLE", "START_TIMEOUT", "HELLO_TIMEOUT", "CALL_TIMEOUT", "POLL_HOLD",
    "POLL_HOLD_MAX", "STAGE_TIMEOUT", "LOCAL_LOAD_TIMEOUT", "STALL_TIMEOUT", "STUCK_AFTER",
    "LOAD_READ_MODE", "LOAD_THREADS", "LOAD_READ_BYTES", "LOAD_COPY_BYTES", "FLUSH_PARALLELISM",
    "FLUSH_RETRY_START", "FLUSH_RETRY_CAP", "FLUSH_DEADLINE", "FLUSH_COMMIT_POLL",
    "FLUSH_CHUNK_BYTES", "STAGE_POLICY", "STAGE_BUDGET_FRACTION", "WRITER_PROGRESS_INTERVAL",
    "STAGING_DEADLINE", "SAVE_DEADLINE", "WAIT_MARGIN", "LATE_RANK_GRACE", "SENT_AHEAD_KINDS",
    "TORCH_JOIN_BYTES", "TORCH_HEADS_KEPT", "TORCH_BODIES_KEPT", "DCP_FAST_PLAN", "DCP_GUESS_PLAN",
    "DCP_GUESS_KINDS", "DCP_GUESS_COPY_WAIT", "DCP_KEEP_DESCRIPTIONS", "DCP_GUESS_CACHED",
    "DCP_STAGE_AHEAD",
]


# Each knob: name, default, parser, what it changes. Its variable is CKPTD_<name>.

# ---------------------------------------------------------------- the daemon (ckptd serve)
POOL_SIZE = _knob(
    "POOL_SIZE", "1G", str, "Staging pool size (serve's --pool-size default; auto-start's)")
# The pool must be memory that is never written back (tmpfs or hugetlbfs). On huge pages
# (a huge= tmpfs, or POOL_COLLAPSE) the writers' direct writes pin 512x fewer pages and
# reach the disk in full-size requests (here 10-25 % less daemon and writer CPU per GB).
POOL_DIR = _knob(
    "POOL_DIR", "/dev/shm", str,
    "Directory (tmpfs or hugetlbfs) the staging pool is made in (serve's --pool-dir default; "
    "auto-start's)")
POOL_COLLAPSE = _knob(
    "POOL_COLLAPSE", True, parse_bool,
    "Give a staging pool on a tmpfs without huge pages 2 MiB pages (MADV_COLLAPSE)")
# Folding happens at the daemon's start, before it answers anyone; where the kernel must
# compact memory first it took ~1.6 s a GiB here, so the worst case is bounded.
POOL_FOLD_BUDGET = _knob(
    "POOL_FOLD_BUDGET", 20.0, float,
    "Seconds a daemon's start may spend folding its pool into huge pages (the rest keeps "
    "4 KiB pages)")
WRITERS = _knob(
    "WRITERS", 2, int, "Writer processes (serve's --writers default)")
DRAIN_TIMEOUT = _knob(
    "DRAIN_TIMEOUT", 60.0, float, "Seconds SIGTERM lets in-flight saves finish (--drain-timeout)")
STOP_LINGER = _knob("STOP_LINGER", 1.0, float, "Seconds a stopping daemon's last answers (held "
                    "POLLs, parked STAGEs) get to reach trainers before its socket closes")
WRITER_START_TIMEOUT = _knob(
    "WRITER_START_TIMEOUT", 120.0, float, "Seconds writer processes may take to start")
SERVE_TICK = _knob(
    "SERVE_TICK", 0.25, float, "Seconds between the serve loop's housekeeping rounds")
UNCLAIMED_RESULT_SECONDS = _knob(
    "UNCLAIMED_RESULT_SECONDS", 3600.0, float, "Finished requests nobody polled are dropped after")
RECENT_REQUESTS = _knob(
    "RECENT_REQUESTS", 32, int, "Requests kept in the status document")
TRACE_SAVES = _knob(
    "TRACE_SAVES", 32, int, "Recent saves whose spans ckptd trace can show")
RECENT_ERRORS = _knob(
    "RECENT_ERRORS", 16, int, "Failures kept in the status document")
# Writers run at a lower CPU priority than the trainers: a save that is durable a bit
# later costs nothing, a training step slowed by serialization costs GPU time.
WRITER_NICE = _knob(
    "WRITER_NICE", 10, int, "nice value of writer processes")
WRITER_SCHED = _knob(
    "WRITER_SCHED", "batch", str, "CPU policy of writer processes: normal, batch or idle")
WRITER_IO_CLASS = _knob(
    "WRITER_IO_CLASS", "best-effort:7", str,
    "I/O class of writer processes: best-effort:N, idle or none")
CHECKSUM_OVERLAP_MIN_BYTES = _knob(
    "CHECKSUM_OVERLAP_MIN_BYTES", 1 << 20, int, "Chunks checksummed beside their write from")
WRITEBACK_EVERY_BYTES = _knob(
    "WRITEBACK_EVERY_BYTES", 64 << 20, int, "Start writeback (sync_file_range) every so many")
# O_DIRECT from the staging pool: no copy into the page cache (the writers' largest CPU
# cost when buffered) and no page cache filled with bytes nobody reads back. "buffered" is
# the page-cache path (before O_DIRECT; also what filesystems that refuse it get, their
# pages dropped after the fsync).
WRITE_MODE = _knob(
    "WRITE_MODE", "direct", str,
    "How writers write checkpoint files: direct (O_DIRECT where the filesystem allows) or buffered")
DIRECT_WRITE_THREADS = _knob(
    "DIRECT_WRITE_THREADS", 2, int, "Threads per writer issuing (and checksumming) direct writes")
DIRECT_CHUNK_BYTES = _knob(
    "DIRECT_CHUNK_BYTES", 32 << 20, parse_size, "Bytes per direct write call")
# A batch of a file's pieces goes to the disk when it holds a chunk, or earlier, from this
# size, when none of the file's writes is in flight: the disk would otherwise wait while
# the writer gathers the first chunk of a file (a few ms of Python per file, more for DCP's
# per-item archives) or a run of small records.
DIRECT_IDLE_BATCH_BYTES = _knob(
    "DIRECT_IDLE_BATCH_BYTES", 1 << 20, parse_size,
    "Bytes from which a direct write goes out early when none of the file's writes is in flight")
DIRECT_BOUNCE_BYTES = _knob(
    "DIRECT_BOUNCE_BYTES", 2 << 20, parse_size,
    "Aligned bounce buffer for headers, padding, small tensors and unaligned tails")
DIRECT_MIN_BYTES = _knob(
    "DIRECT_MIN_BYTES", 64 << 10, parse_size,
    "Tensors written straight from the pool from this size (smaller ones via the bounce buffer)")
# A direct write past a file's end holds the inode lock alone until the disk answers; into
# space allocated ahead, the writer's threads write side by side. One chunk ahead is enough
# for that, and no more: space allocated ahead is taken from every other file being written
# to the same filesystem until the file is cut to size (256 MiB ahead filled a small node
# tmpfs with two ranks' parts and replicas, and the others failed with ENOSPC).
DIRECT_ALLOCATE_BYTES = _knob(
    "DIRECT_ALLOCATE_BYTES", 8 << 20, parse_size,
    "Space allocated ahead of a file's direct writes, per step (0: none)")
WRITE_AHEAD = _knob(
    "WRITE_AHEAD", True, parse_bool,
    "Send a save's writer jobs when its staging begins: its files are made ready (created, "
    "allocated) while the trainer copies, and written once it is staged")
# The trainer tells its daemon how far its copy into the pool got every this many bytes,
# and the writers of the files made ready write up to there while it copies the rest:
# the disk starts with the copy instead of after it (a GiB copy lasts ~70 ms here, a
# tenth of writing it). Each report is one message (~30 us of the trainer's time); a
# save smaller than two steps sends none. The writes beside a copy take memory bandwidth
# and CPU from it: on two shared cores a blocking 1 GiB save took 1.15-1.40x the memcpy
# bound with reports, 1.00-1.03x without, and a training step beside a zero-stall save
# 1.54-1.64x a normal one against 1.42-1.49x. So by default ("auto") only a background
# copy (a zero-stall save's, which no call waits for) reports, and only where the trainer
# may run on at least COPY_REPORTS_MIN_CPUS.
COPY_REPORTS = _knob(
    "COPY_REPORTS", "auto",
    lambda text: parse_choice(text, ("auto", "off", "background", "always")),
    "Which copies into the pool report their progress so the writers start while they copy: "
    "off, background (zero-stall saves' copies), always (blocking calls' too), or auto "
    "(background where the trainer may run on 4 CPUs or more)")
COPY_REPORTS_MIN_CPUS = _knob(
    "COPY_REPORTS_MIN_CPUS", 4, int,
    "CKPTD_COPY_REPORTS=auto reports a background copy where the trainer may run on at "
    "least this many CPUs (on fewer, the writers' threads take them from the training step)")
COPY_REPORT_BYTES = _knob(
    "COPY_REPORT_BYTES", 64 << 20, parse_size,
    "Step of the copy reports (CKPTD_COPY_REPORTS): the trainer reports its copy into the "
    "pool every this many bytes (0: no reports)")
# Torch-format files are written from templates kept per writer process: the archive's
# head per skeleton (a job saves a few kinds of state dict) and its body per layout (each
# holds a page of padding per tensor, a few MiB). Small tensors between large ones are
# joined into one write of up to TORCH_JOIN_BYTES: a copy of a few KiB is cheaper than a
# write call.
TORCH_JOIN_BYTES = _knob(
    "TORCH_JOIN_BYTES", 1 << 20, parse_size,
    "Small tensors of a torch-format file joined into one write of up to this many bytes")
TORCH_HEADS_KEPT = _knob(
    "TORCH_HEADS_KEPT", 8, int, "Torch-format file heads (one per skeleton) a writer keeps")
TORCH_BODIES_KEPT = _knob(
    "TORCH_BODIES_KEPT", 4, int, "Torch-format file bodies (one per layout) a writer keeps")
CHECKSUM = _knob(
    "CHECKSUM", "crc32c", str,
    "Algorithm of new checksum records: crc32c (the CPU's CRC instruction) or crc32 (zlib)")
CUDA_REGISTER_CHUNK_BYTES = _knob(
    "CUDA_REGISTER_CHUNK_BYTES", 64 << 30, int, "Bytes page-locked per cudaHostRegister call")
# Diagnostics for a GPU lease: the device worker's own time, which no trainer-side profile
# sees (it runs in the daemon, on its own thread).
CUDA_PROFILE = _knob(
    "CUDA_PROFILE", "", str,
    "If set, a path: each CUDA device worker profiles its staging (cProfile) and writes "
    "the top functions to <path>.<device> when the daemon stops")
NUMA_PLACEMENT = _knob(
    "NUMA_PLACEMENT", True, parse_bool,
    "Cut the staging pool into one region per NUMA node; stage near each GPU or rank")
# A write or fsync that makes no progress for this long is not slow storage but a hung one
# (a starved Lustre OST, a dead NFS server): its save fails on every rank, naming the file.
# Generous, because a slow save that succeeds is worth far more than a failed one.
STALL_TIMEOUT = _knob(
    "STALL_TIMEOUT", 600.0, float,
    "Seconds a file write or fsync may make no progress before its save fails (--stall-timeout)")
WRITER_PROGRESS_INTERVAL = _knob(
    "WRITER_PROGRESS_INTERVAL", 0.5, float,
    "Seconds between two progress reports of a writer within one phase of a file")
# Whole phases, generous: a staging copy of a node's share takes seconds, a save minutes.
STAGING_DEADLINE = _knob(
    "STAGING_DEADLINE", 600.0, float,
    "Seconds a save's staging (the copies into the pool) may take before the save fails")
SAVE_DEADLINE = _knob(
    "SAVE_DEADLINE", 7200.0, float, "Seconds a whole save may take, request to durable")
# Status flags a save as stuck long before its deadline, so an operator sees it coming.
STUCK_AFTER = _knob(
    "STUCK_AFTER", 60.0, float, "Seconds without progress before status flags a save as stuck")
LEFTOVER_SWEEP_INTERVAL = _knob(
    "LEFTOVER_SWEEP_INTERVAL", 5.0, float,
    "Seconds between sweeps of leftovers of dead daemons that were still exiting at start")
METRICS_INTERVAL = _knob(
    "METRICS_INTERVAL", 2.0, float, "Seconds between two renders of the Prometheus metrics")

# ---------------------------------------------------------------- replication between daemons
PEER_TIMEOUT = _knob(
    "PEER_TIMEOUT", 30.0, float, "Seconds a part stream may go without progress")
PEER_PING_INTERVAL = _knob(
    "PEER_PING_INTERVAL", 1.0, float, "Seconds between heartbeats to each peer")
PEER_MISS_BUDGET = _knob(
    "PEER_MISS_BUDGET", 3, int, "Heartbeats a peer may miss before it is reported down")
# Part bytes travel on plain tcp connections of their own (never behind heartbeats),
# several per peer: one connection thread seals while another waits on the wire, and a
# fast NIC needs a core per stream for AES-GCM (benchmarks/RESULTS_TRANSPORT.md).
PEER_STREAMS = _knob(
    "PEER_STREAMS", 4, int, "Bulk tcp connections per peer daemon")
# Per connection: enough to keep the wire busy while the receiver writes a chunk (4 MiB
# each), few enough that a broken connection has little to resend.
REPLICATION_WINDOW = _knob(
    "REPLICATION_WINDOW", 4, int, "Part chunks in flight without acknowledgement, per connection")
# Measured (RESULTS_TRANSPORT.md): AES-256-GCM costs ~0.15 CPU s/GiB per end over plain
# tcp; "none" still authenticates every chunk (GMAC) for ~0.1.
PEER_ENCRYPTION = _knob(
    "PEER_ENCRYPTION", "aes-256-gcm", str,
    "Bulk bytes between daemons: aes-256-gcm or none (authenticated only; --peer-encryption)")
PEER_HANDSHAKE_TIMEOUT = _knob(
    "PEER_HANDSHAKE_TIMEOUT", 10.0, float, "Seconds to connect and authenticate a bulk connection")
PEER_BULK_PORT = _knob(
    "PEER_BULK_PORT", 0, int, "tcp port of the bulk listener (0: any free port, advertised)")
# On a paced link segments arrive a few at a time, and waking the receiving thread for
# each (a context switch and a return to Python every ~100 KiB at 2 Gbit) cost a receiving
# daemon about a sixth more CPU per GB than on an unlimited link.
PEER_RECEIVE_SLICE_BYTES = _knob(
    "PEER_RECEIVE_SLICE_BYTES", 256 << 10, parse_size,
    "Bytes a blocked receive of a replication chunk waits for before it wakes "
    "(SO_RCVLOWAT); 0: wake for any byte")
PEER_RECEIVE_SLICE_WAIT = _knob(
    "PEER_RECEIVE_SLICE_WAIT", 0.05, float,
    "Seconds a receive waits for a whole slice before it takes bytes as they come")
# Control messages only (heartbeats, fetch requests): one I/O thread is plenty, two let
# CURVE of a busy peer not delay another's.
PEER_IO_THREADS = _knob(
    "PEER_IO_THREADS", 2, int, "ZeroMQ I/O threads of the peer context (control messages)")
REPLICATOR_TICK = _knob(
    "REPLICATOR_TICK", 0.1, float, "Seconds between the replicator's timer checks")
# Replication only ever talks to a clique of 2-3 daemons, so a daemon keeps links (and
# heartbeats) to its clique mates only and its cost does not grow with the job; "all"
# is the former all-to-all mesh, kept so benchmarks can put both side by side.
PEER_LINKS = _knob(
    "PEER_LINKS", "clique", lambda text: parse_choice(text, ("clique", "all")),
    "Peers a daemon keeps dialed and heartbeats: clique (its clique mates) or all (the job)")
# A link to a daemon outside the clique (a fetch from a far holder after a re-shaped
# restart) is dialed on demand; closed after this long unused, it costs nothing idle.
PEER_IDLE_TIMEOUT = _knob(
    "PEER_IDLE_TIMEOUT", 30.0, float,
    "Seconds an on-demand link to a daemon outside the clique may stay unused")

# The latest committed local part of each rank stays in the staging pool until a newer
# one is committed or a save needs the space: a restarted trainer loads it from memory.
MEMORY_TIER = _knob(
    "MEMORY_TIER", True, parse_bool, "Keep the latest committed local parts in the staging pool")

# ---------------------------------------------------------------- tiers (--stage-dir)
# (A flush copy without progress for STALL_TIMEOUT is abandoned and retried on a fresh
# temporary name, not failed: only the flush deadline or a fail-fast errno fail it.)
FLUSH_PARALLELISM = _knob(
    "FLUSH_PARALLELISM", 4, int, "Files copied to the target at once (tiered saves)")
# Shared storage that fails usually fails for minutes (a server restarting, a target
# rebalancing): start the backoff slowly enough not to hammer it, cap it so a target that
# comes back is used within minutes.
FLUSH_RETRY_START = _knob(
    "FLUSH_RETRY_START", 10.0, float, "Seconds before the first retry of a failed flush copy")
FLUSH_RETRY_CAP = _knob(
    "FLUSH_RETRY_CAP", 600.0, float, "Longest wait between two retries of a flush copy")
FLUSH_DEADLINE = _knob(
    "FLUSH_DEADLINE", 4 * 3600.0, float,
    "Seconds a tiered save may take to reach its target before it fails")
FLUSH_COMMIT_POLL = _knob(
    "FLUSH_COMMIT_POLL", 1.0, float,
    "Seconds between checks that a DCP commit's files (from every node) reached the target")
FLUSH_CHUNK_BYTES = _knob(
    "FLUSH_CHUNK_BYTES", 8 << 20, int, "Bytes per read/write of a flush copy")
STAGE_POLICY = _knob(
    "STAGE_POLICY", "wait", str,
    "A save that does not fit the stage budget: wait (for flushes to free it) or refuse "
    "(--stage-policy)")
STAGE_BUDGET_FRACTION = _knob(
    "STAGE_BUDGET_FRACTION", 0.9, float,
    "Default --stage-budget: this fraction of the stage filesystem's free space at start")

# ---------------------------------------------------------------- the client (ckpt_client)
AUTO_START = _knob(
    "AUTO_START", None, parse_bool, "Start a daemon when none answers (unset: if no socket set)")
AUTO_EXIT_WHEN_IDLE = _knob(
    "AUTO_EXIT_WHEN_IDLE", 120.0, float, "Seconds without trainers before auto-started ones exit")
START_TIMEOUT = _knob(
    "START_TIMEOUT", 120.0, float, "Seconds an auto-started daemon may take to become ready")
HELLO_TIMEOUT = _knob(
    "HELLO_TIMEOUT", 5.0, float, "Seconds to wait for the daemon's hello")
CALL_TIMEOUT = _knob("CALL_TIMEOUT", 60.0, float, "Seconds to wait for an ordinary reply")
POLL_HOLD = _knob("POLL_HOLD", 5.0, float, "Seconds a trainer blocked on a save asks the daemon "
                  "to hold each POLL until the save changes phase (at most half "
                  "CKPTD_CALL_TIMEOUT; 0: poll every 10 ms)")
POLL_HOLD_MAX = _knob("POLL_HOLD_MAX", 30.0, float, "Longest the daemon holds a POLL that "
                      "waits for a save to change phase (0: it answers every POLL at once)")
# A torch save's STAGE goes out before its state dict is walked, with the layout the last
# saves of its kind (top-level keys) had; a trainer saves a handful of kinds (model,
# optimizer, scheduler, ...) through one connection.
SENT_AHEAD_KINDS = _knob("SENT_AHEAD_KINDS", 8, int, "Kinds of torch state dicts per "
                         "connection whose layout is kept to send STAGE ahead (0: none); "
                         "the daemon keeps the layouts of as many last torch saves, and "
                         "apart as many last DCP saves', per connection for such a STAGE "
                         "to name")
DCP_FAST_PLAN = _knob("DCP_FAST_PLAN", True, parse_bool, "DCP saves with the default planner "
                      "plan the short way; 0: DCP's own planning (enable_cache still reuses plans)")
# A blocking DCP save starts copying with the previous save's final plan while it plans,
# and keeps the copy only if the plan it makes is the same (else it stages afresh).
DCP_GUESS_PLAN = _knob("DCP_GUESS_PLAN", True, parse_bool, "A blocking DCP save without "
                       "enable_cache copies with the previous save's plan while it plans "
                       "(kept only if the plan is the same); 0: it copies after planning")
# A trainer saves a handful of kinds of DCP state dicts (top-level keys) per process group.
DCP_GUESS_KINDS = _knob("DCP_GUESS_KINDS", 8, int, "Kinds of DCP state dicts per process "
                        "whose last final plan is kept to guess the next save's copy with")
# Waiting lets the copying thread run its few milliseconds of Python (the STAGE's reply, the
# pool views) before the planning competes with it for the interpreter lock. A save whose
# copy did not begin within it (its STAGE waited for pool space) has the next save of its
# kind plan at once instead, until a copy begins that soon again.
DCP_GUESS_COPY_WAIT = _knob("DCP_GUESS_COPY_WAIT", 0.05, float, "Seconds a blocking DCP save "
                            "waits for its guessed copy to begin before it plans")
# A guessed copy's STAGE goes out before its items are looked up, naming the previous
# guessed save's layout (the daemon keeps it), so the daemon's answer overlaps the lookups.
DCP_STAGE_AHEAD = _knob("DCP_STAGE_AHEAD", True, parse_bool, "A blocking DCP save's guessed "
                        "copy sends its STAGE, naming the last such save's layout, before it "
                        "looks its items up")
# A DCP save whose plan and byte-item sizes are the previous save's stages with the very
# description list of that save: its file grouping, extent layout and pool views are then
# found by identity instead of a pass over every item.
DCP_KEEP_DESCRIPTIONS = _knob("DCP_KEEP_DESCRIPTIONS", True, parse_bool, "A DCP save of an "
                              "unchanged plan reuses the previous save's item descriptions, "
                              "file grouping and pool views; 0: made afresh every save")
# A cached save's plan is known before the structure check that confirms it: its copy can
# start first, the check overlapping it (kept only if the structure holds).
DCP_GUESS_CACHED = _knob("DCP_GUESS_CACHED", True, parse_bool, "A blocking DCP save with "
                         "enable_cache copies with the cached plan while it checks the "
                         "structure; 0: it copies after the check")
# These two are deadlines the daemon enforces; the trainer waits a margin longer.
STAGE_TIMEOUT = _knob(
    "STAGE_TIMEOUT", 600.0, float,
    "Seconds a save may wait for staging space (back-pressure) before the daemon refuses it")
LOCAL_LOAD_TIMEOUT = _knob(
    "LOCAL_LOAD_TIMEOUT", 600.0, float,
    "Seconds a daemon's fetch of a local part (and a trainer's wait for an inventory) may take")
# A trainer's wait for the daemon is the daemon's own deadline for the same thing plus one
# unanswered call, two housekeeping ticks and this: the daemon decides a save's fate, the
# trainer's limit only ends the wait on a daemon that is dead or silent.
WAIT_MARGIN = _knob(
    "WAIT_MARGIN", 30.0, float,
    "Seconds a trainer waits beyond the daemon's own deadline for the same thing")
# Once a save's completion collective has broken, a rank that never reached it and is not
# known to be dead may only be late (stopped, swapping): it is given this long to arrive
# before it is named. Bounded well below the process group's own timeout (30 min for
# gloo) because a node lost whole leaves no rank behind to report its processes gone, and
# the job cannot go on with a broken group anyway: the operator needs the name now.
LATE_RANK_GRACE = _knob(
    "LATE_RANK_GRACE", 120.0, float,
    "Seconds a broken completion check waits for a rank not known to be dead before naming it")
# Loads of local parts: read with O_DIRECT straight into the tensors' memory (no copy out
# of the page cache, no cache filled with a checkpoint read once), in large reads on a few
# threads, each piece checksummed by the thread that read or copied it while it is hot.
LOAD_READ_MODE = _knob(
    "LOAD_READ_MODE", "direct", str,
    "How loads read local parts: direct (O_DIRECT where the filesystem allows) or buffered")
LOAD_THREADS = _knob(
    "LOAD_THREADS", 4, int, "Threads a load reads or copies (and checksums) a part with "
    "(at most the CPUs this process may use)")
LOAD_READ_BYTES = _knob(
    "LOAD_READ_BYTES", 8 << 20, parse_size, "Bytes per read call of a load from disk")
LOAD_COPY_BYTES = _knob(
    "LOAD_COPY_BYTES", 1 << 20, parse_size,
    "Bytes a load from the memory tier copies before checksumming them (cache-sized)")
# Named CKPTD_ROOTS since the first release.
AUTO_ROOTS = _knob(
    "AUTO_ROOTS", "/", str, "':'-separated roots an auto-started daemon allows", "CKPTD_ROOTS")
