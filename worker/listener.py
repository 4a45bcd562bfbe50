"""The worker's Unix socket: one owner at a time (flock), 0660 in a 0750 directory, stale files replaced."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

import grpc

SOCKET_MODE = 0o660
DIRECTORY_MODE = 0o750


class SocketInUse(RuntimeError):
    """Another live worker owns this socket path."""


class SocketOwnership:
    """Holds the lock file beside the socket for the life of the process."""

    def __init__(self, socket_path: str):
        self.socket_path = Path(socket_path)
        self.lock_path = self.socket_path.with_name(self.socket_path.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        directory = self.socket_path.parent
        if not directory.exists():
            directory.mkdir(parents=True, mode=DIRECTORY_MODE, exist_ok=True)
            os.chmod(directory, DIRECTORY_MODE)  # mkdir's mode is cut by the umask
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SocketInUse(
                    f"another cy-llm worker (pid {holder}) is serving {self.socket_path}; "
                    "stop it first or give this one another --socket") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        self._remove_stale_socket()

    def _remove_stale_socket(self) -> None:
        # We hold the lock, so whatever socket is there belongs to a worker that died.
        try:
            mode = os.lstat(self.socket_path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise SocketInUse(f"{self.socket_path} exists and is not a socket; refusing to replace it")
        os.unlink(self.socket_path)

    def bind(self, server: grpc.aio.Server) -> None:
        """Binds with a umask that makes the socket 0660 from the moment it exists."""
        previous = os.umask(0o777 & ~SOCKET_MODE)
        try:
            server.add_insecure_port(f"unix:{self.socket_path}")
        finally:
            os.umask(previous)
        os.chmod(self.socket_path, SOCKET_MODE)

    def release(self) -> None:
        """Removes the socket; the lock file stays (deleting it would race a starting worker)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
