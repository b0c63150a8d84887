"""A FUSE passthrough filesystem whose writes can be slowed, stalled or failed on command.

Real storage faults for tests: a directory (``backing``) is mounted again at ``mount``
through a FUSE server written in Python (``mfusepy`` over libfuse 3); every operation goes
to the backing directory, except that writes and fsyncs can be made to

- **stall**: the calling process blocks inside ``write()``/``fsync()`` (it sits in the
  kernel's ``request_wait_answer``; after SIGKILL it turns to state ``D`` and cannot exit
  until the server answers) until the stall is lifted -- the shape of a write stuck on a
  starved Lustre or NFS target;
- **slow down**: sleep ``delay_per_mib`` seconds per MiB written (a throttled target);
- **fail**: answer with an errno (``"EIO"``, ``"ENOSPC"``, ``"EROFS"``, ``"EDQUOT"``...).

Faults can be limited to some operations (``ops``: ``write``, ``fsync``, ``create``,
``rename``, ``read``...) and to paths containing a substring (``match``). The server runs in its own
process (so a stalled test process never stalls the server) and takes commands over a
Unix socket; each command answers with the server's state, including how many operations
a stall holds right now, so a test waits on the condition, never on a guess.

How to drive it from a test::

    from faultfs import FaultFS, fuse_unavailable

    needs_fuse = pytest.mark.skipif(bool(fuse_unavailable()), reason=fuse_unavailable())

    @needs_fuse
    def test_x(tmp_path):
        with FaultFS(tmp_path / "backing", tmp_path / "mnt") as fs:   # mounted, healthy
            ...                       # point the daemon's --root (or --stage-dir) at fs.mount
            fs.set(stall=True, ops=["write", "fsync"], match=".distcp")
            wait_for(lambda: fs.state()["blocked"] > 0, 30, "a write held by the stall")
            ...                       # the deadline fires, status shows the save stuck
            fs.set(stall=False)       # or fs.clear(): the held writes go on
            fs.set(error="ENOSPC", ops=["write"])   # every write fails with ENOSPC
            fs.set(delay_per_mib=0.5)               # slow, but progressing
        # on exit: faults cleared, held operations released, unmounted, server stopped
        # (a mount that a process still holds is detached and the holders named: an error)

``fs.kill_server()`` makes every operation fail at once with ``ENOTCONN`` (a crashed
storage server), which also frees writers killed while stalled. The backing directory
holds the bytes as written, so a test can check what reached "storage".

Needs ``/dev/fuse``, ``fusermount3`` (Debian's ``fuse3``, installed by ``.ci/run``) and the
``mfusepy`` package (the ``test`` extra); :func:`fuse_unavailable` says which is missing,
for the skip reason. Mounting needs root (``/dev/fuse`` is root-only on these machines).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any

#: Operations a fault can apply to.
FAULT_OPS = ("create", "write", "fsync", "flush", "rename", "mkdir", "unlink", "truncate", "read")
_MIB = 1 << 20


def fuse_unavailable() -> str:
    """Why a FUSE bed cannot run here (empty string when it can)."""
    if not os.path.exists("/dev/fuse"):
        return "FUSE fault bed: /dev/fuse is missing (no fuse kernel module in this machine)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "FUSE fault bed: /dev/fuse is not readable and writable by this user (run as root)"
    if shutil.which("fusermount3") is None:
        return "FUSE fault bed: fusermount3 is missing (apt-get install fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError, EnvironmentError) as exc:
        return f"FUSE fault bed: mfusepy (pip install mfusepy) cannot load libfuse: {exc}"
    return ""


class FaultFS:
    """A mounted fault filesystem, controlled from the test process.

    Parameters
    ----------
    backing : path
        Directory that holds the bytes (created if missing).
    mount : path
        Empty directory to mount at (created if missing).
    start_timeout : float
        Seconds the server may take to mount.
    """

    def __init__(self, backing, mount, start_timeout: float = 30.0) -> None:
        self.backing, self.mount = str(backing), str(mount)
        self.control = f"{self.mount.rstrip('/')}.control.sock"
        self.start_timeout = start_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "FaultFS":
        self.start()
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            self.stop()
        except RuntimeError as busy:
            if exc is None:
                raise
            exc.add_note(str(busy))  # the test's own failure comes first

    def start(self) -> None:
        """Start the server and wait until the mount answers."""
        reason = fuse_unavailable()
        if reason:
            raise RuntimeError(reason)
        os.makedirs(self.backing, exist_ok=True)
        os.makedirs(self.mount, exist_ok=True)
        self.log_path = f"{self.mount.rstrip('/')}.faultfs.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--backing", self.backing,
                 "--mount", self.mount, "--control", self.control],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while not (os.path.ismount(self.mount) and os.path.exists(self.control)):
            if self.process.poll() is not None:
                raise RuntimeError(f"faultfs server exited with {self.process.returncode}:\n"
                                   f"{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"faultfs did not mount {self.mount} in "
                                   f"{self.start_timeout:.0f}s:\n{self.log()}")
            time.sleep(0.02)  # polling for the mount to appear; no event to wait on

    def log(self) -> str:
        """The server's output."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _command(self, command: dict, timeout: float = 10.0) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(self.control)
            sock.sendall(json.dumps(command).encode() + b"\n")
            answer = json.loads(_read_line(sock))
        if "refused" in answer:
            raise ValueError(answer["refused"])
        return answer

    def set(self, *, stall: bool | None = None, error: str | None = None,
            delay_per_mib: float | None = None, ops: list[str] | None = None,
            match: str | None = None) -> dict:
        """Change the faults; unnamed settings keep their value. Returns the state.

        Parameters
        ----------
        stall : bool
            Hold matching operations until set back to False.
        error : str or None
            errno name matching operations fail with (``""`` for none).
        delay_per_mib : float
            Seconds matching writes sleep per MiB (0 for none).
        ops : list of str
            Operations the faults apply to (default ``["write", "fsync"]``).
        match : str
            Only paths containing this substring (``""``: every path); a rename matches
            by its new name, or else by its old one (a temporary renamed into place).
        """
        command: dict[str, Any] = {"op": "set"}
        for name, value in (("stall", stall), ("error", error), ("delay_per_mib", delay_per_mib),
                            ("ops", ops), ("match", match)):
            if value is not None:
                command[name] = value
        return self._command(command)

    def clear(self) -> dict:
        """Back to a healthy passthrough; held operations go on."""
        return self._command({"op": "clear"})

    def state(self) -> dict:
        """The current faults, ``blocked`` (operations a stall holds now, with their paths in
        ``blocked_paths``) and ``counts`` (operations seen, by name)."""
        return self._command({"op": "state"})

    def kill_server(self) -> None:
        """Kill the server: every pending and later operation fails with ENOTCONN."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        """Lift every fault, unmount and stop the server.

        Raises
        ------
        RuntimeError
            If something still held the mount (a file open on it, a working directory or
            a mapping in it: a process the test left running), naming each holder. The
            mount is detached lazily and the server killed first, so nothing is left
            mounted and a holder's next operation on it fails with ``ENOTCONN`` instead of
            hanging; the error says what the test leaked instead of a silent wait.
        """
        if self.process is not None and self.process.poll() is None:
            try:
                self.clear()
            except (OSError, ValueError):
                pass
        busy = None
        if os.path.ismount(self.mount):
            done = subprocess.run(["fusermount3", "-u", self.mount], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                busy = (done.stderr.strip(), holders_of(self.mount))
                subprocess.run(["fusermount3", "-u", "-z", self.mount], capture_output=True)
        if self.process is not None:
            try:  # unmounted, it exits; detached while held, it would wait for the holders
                self.process.wait(0 if busy else 10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if os.path.ismount(self.mount):  # the server died under a busy mount
            subprocess.run(["fusermount3", "-u", "-z", self.mount], capture_output=True)
        try:
            os.unlink(self.control)
        except FileNotFoundError:
            pass
        if busy is not None:
            why, holders = busy
            raise RuntimeError(
                f"faultfs: {self.mount} was still in use when the test stopped it "
                f"(fusermount3: {why or 'failed'}); held by: "
                f"{'; '.join(holders) or 'no process this user can see'}. It was detached "
                f"and its server killed: stop or reap those processes inside the test")


def holders_of(mount: str) -> list[str]:
    """What keeps ``mount`` busy: each process with a file, its working or root directory,
    or a mapping under it, as ``pid N (command): what -> path``."""
    inside = mount.rstrip("/")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        links = []
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            for name in ("cwd", "root"):
                links.append((name, os.readlink(f"/proc/{entry}/{name}")))
            for fd in os.listdir(f"/proc/{entry}/fd"):
                links.append((f"fd {fd}", os.readlink(f"/proc/{entry}/fd/{fd}")))
            with open(f"/proc/{entry}/maps") as f:
                links += [("mapping", line.split(None, 5)[5].strip()) for line in f
                          if len(line.split(None, 5)) == 6]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        held = sorted({f"{what} -> {path}" for what, path in links
                       if path == inside or path.startswith(inside + "/")})
        if held:
            found.append(f"pid {entry} ({command[:120]}): {', '.join(held)}")
    return found


def _read_line(sock: socket.socket) -> bytes:
    """One newline-terminated message (the control channel's framing)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


# ---------------------------------------------------------------------- the server process
class _Faults:
    """The server's fault settings and the operations a stall holds (one lock for both)."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.counts: dict[str, int] = {}
        self.held: dict[int, str] = {}
        self.clear()

    def clear(self) -> None:
        with self.changed:
            self.stall, self.error, self.delay_per_mib = False, "", 0.0
            self.ops, self.match = ["write", "fsync"], ""
            self.changed.notify_all()

    def update(self, command: dict) -> None:
        error = command.get("error")
        if error and not isinstance(getattr(errno, error, None), int):
            raise ValueError(f"{error!r} is not an errno name (try EIO or ENOSPC)")
        unknown = set(command.get("ops") or []) - set(FAULT_OPS)
        if unknown:
            raise ValueError(f"unknown operation(s) {sorted(unknown)}; known: {FAULT_OPS}")
        with self.changed:
            self.stall = bool(command.get("stall", self.stall))
            self.error = error if error is not None else self.error
            self.delay_per_mib = float(command.get("delay_per_mib", self.delay_per_mib))
            self.ops = list(command.get("ops", self.ops))
            self.match = str(command.get("match", self.match))
            self.changed.notify_all()

    def describe(self) -> dict:
        with self.changed:
            return {"stall": self.stall, "error": self.error,
                    "delay_per_mib": self.delay_per_mib, "ops": self.ops, "match": self.match,
                    "blocked": len(self.held), "blocked_paths": sorted(self.held.values()),
                    "counts": dict(self.counts)}

    def apply(self, op: str, path: str, nbytes: int = 0) -> None:
        """Called by every faultable operation before it runs: stall, sleep or fail."""
        from mfusepy import FuseOSError

        with self.changed:
            self.counts[op] = self.counts.get(op, 0) + 1
            if op not in self.ops or self.match not in path:
                return
            me = threading.get_ident()
            self.held[me] = path
            try:
                while self.stall:
                    self.changed.wait()
            finally:
                del self.held[me]
            error, delay = self.error, self.delay_per_mib
        if error:
            raise FuseOSError(getattr(errno, error))
        if delay and nbytes:
            time.sleep(delay * nbytes / _MIB)  # the injected slowness itself


def _operations(backing: str, faults: _Faults):
    from mfusepy import FuseOSError, Operations

    def real(path: str) -> str:
        return os.path.join(backing, path.lstrip("/"))

    def oserror(function):
        def wrapped(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except OSError as exc:
                if isinstance(exc, FuseOSError):
                    raise
                raise FuseOSError(exc.errno or errno.EIO) from None
        wrapped.__name__ = function.__name__
        return wrapped

    class Passthrough(Operations):
        use_ns = True

        @oserror
        def access(self, path, amode):
            if not os.access(real(path), amode):
                raise FuseOSError(errno.EACCES)
            return 0

        @oserror
        def getattr(self, path, fh=None):
            st = os.fstat(fh) if fh is not None else os.lstat(real(path))
            return {key: getattr(st, key) for key in (
                "st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns",
                "st_mtime_ns", "st_ctime_ns", "st_ino", "st_blocks")} | {
                "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns,
                "st_ctime": st.st_ctime_ns}

        @oserror
        def readdir(self, path, fh):
            return [".", ".."] + os.listdir(real(path))

        @oserror
        def readlink(self, path):
            return os.readlink(real(path))

        @oserror
        def mkdir(self, path, mode):
            faults.apply("mkdir", path)
            os.mkdir(real(path), mode)
            return 0

        @oserror
        def rmdir(self, path):
            os.rmdir(real(path))
            return 0

        @oserror
        def unlink(self, path):
            faults.apply("unlink", path)
            os.unlink(real(path))
            return 0

        @oserror
        def symlink(self, target, source):
            os.symlink(source, real(target))
            return 0

        @oserror
        def rename(self, old, new):
            faults.apply("rename", new if faults.match in new else old)
            os.rename(real(old), real(new))
            return 0

        @oserror
        def link(self, target, source):
            os.link(real(source), real(target))
            return 0

        @oserror
        def chmod(self, path, mode):
            os.chmod(real(path), mode)
            return 0

        @oserror
        def chown(self, path, uid, gid):
            os.chown(real(path), uid, gid)
            return 0

        @oserror
        def utimens(self, path, times=None):
            os.utime(real(path), ns=times)
            return 0

        @oserror
        def truncate(self, path, length, fh=None):
            faults.apply("truncate", path)
            os.truncate(real(path), length)
            return 0

        @oserror
        def statfs(self, path):
            st = os.statvfs(real(path))
            return {key: getattr(st, key) for key in (
                "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                "f_files", "f_flag", "f_frsize", "f_namemax")}

        @oserror
        def open(self, path, flags):
            return os.open(real(path), flags & ~os.O_NOFOLLOW)

        @oserror
        def create(self, path, mode, fi=None):
            faults.apply("create", path)
            return os.open(real(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)

        @oserror
        def read(self, path, size, offset, fh):
            faults.apply("read", path or "", size)
            return os.pread(fh, size, offset)

        @oserror
        def write(self, path, data, offset, fh):
            faults.apply("write", path or "", len(data))
            return os.pwrite(fh, data, offset)

        @oserror
        def flush(self, path, fh):
            faults.apply("flush", path or "")
            return 0

        @oserror
        def fsync(self, path, datasync, fh):
            faults.apply("fsync", path or "")
            if datasync:
                os.fdatasync(fh)
            else:
                os.fsync(fh)
            return 0

        @oserror
        def release(self, path, fh):
            os.close(fh)
            return 0

        @oserror
        def opendir(self, path):
            return os.open(real(path), os.O_RDONLY | os.O_DIRECTORY)

        @oserror
        def releasedir(self, path, fh):
            os.close(fh)
            return 0

        @oserror
        def fsyncdir(self, path, datasync, fh):
            faults.apply("fsync", path or "")
            os.fsync(fh)
            return 0

    return Passthrough()


def _serve_control(path: str, faults: _Faults) -> None:
    """Answer commands (one JSON line each) until the process ends."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    while True:
        conn, _ = server.accept()
        with conn:
            try:
                command = json.loads(_read_line(conn))
                if command.get("op") == "clear":
                    faults.clear()
                elif command.get("op") == "set":
                    faults.update(command)
                elif command.get("op") != "state":
                    raise ValueError(f"unknown command {command.get('op')!r}")
                answer = faults.describe()
            except (ValueError, TypeError) as exc:
                answer = {"refused": str(exc)}
            conn.sendall(json.dumps(answer).encode() + b"\n")


def main(argv: list[str] | None = None) -> None:
    """The server process: mount ``--backing`` at ``--mount`` and serve until unmounted."""
    parser = argparse.ArgumentParser(prog="faultfs")
    parser.add_argument("--backing", required=True)
    parser.add_argument("--mount", required=True)
    parser.add_argument("--control", required=True)
    args = parser.parse_args(argv)
    from mfusepy import FUSE

    faults = _Faults()
    threading.Thread(target=_serve_control, args=(args.control, faults), daemon=True).start()
    # Multithreaded: a stalled write holds one thread, lookups and other files go on.
    FUSE(_operations(os.path.abspath(args.backing), faults), args.mount, foreground=True,
         nothreads=False, default_permissions=True)


if __name__ == "__main__":
    main()
