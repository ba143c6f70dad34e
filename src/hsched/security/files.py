"""Private files written atomically: the one writer of keys, certificates, the tokens file and its admin token,
the running-stack files and the redis/sentinel config files (which hold passwords)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_private(path: str | os.PathLike, data: bytes | str, mode: int = 0o600, *,
                  follow_dir: bool = True) -> Path:
    """Atomically replace `path` with `data`, mode `mode` whatever the umask: a new temporary file beside it
    (O_EXCL|O_NOFOLLOW: never written through a planted link), fsync, renamed over the name (a symbolic link
    there is replaced, never followed), then the directory fsynced — all relative to one open handle of the
    directory. `follow_dir=False` also refuses a directory that is itself a symbolic link (ELOOP).
    OSError as raised; the temporary file never outlives a failure."""
    path = Path(path)
    name = path.name
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | (0 if follow_dir else os.O_NOFOLLOW))
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(fd, mode)
                f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


def files_fingerprint(paths) -> tuple:
    """What changes when any of `paths` is replaced: (inode, mtime, size) each, None for one that cannot be read.
    stat follows symlinks: Kubernetes mounts secrets as links into a ..data directory swapped on update, and
    pki writes by rename (a new inode)."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)
