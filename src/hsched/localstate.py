"""The running-stack files: how `hsched submit/get/list/...` find the stack that `hsched up` runs.

`hsched up` leaves one small JSON file per stack, keyed by its gateway address, in this user's private runtime
directory — `$XDG_RUNTIME_DIR/hsched`, else `<tmp>/hsched-<uid>` (tmp: $TMPDIR or /tmp) — created 0700 and
checked to be a real directory owned by this user (a directory someone else planted in /tmp is refused). Each
file is written 0600 under a fresh temporary name (O_CREAT|O_EXCL|O_NOFOLLOW) and renamed into place, and a
symlink at its name is refused, so nothing is ever written through a planted link; two stacks on two gateway
ports keep two files. A file holds addresses, the key prefix, the pid of its `hsched up` and *paths* (the
file with the embedded Redis' password, TLS CA, token file) — never a secret: `write_stack` refuses a Redis URL
with a password. Files of dead `hsched up` processes are removed when the directory is read.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from pathlib import Path

from hsched.lb import addresses
from hsched.security.files import write_private
from hsched.state.redis import url_with_password, url_without_password

__all__ = ["LocalStateError", "pick_stack", "read_stacks", "remove_stack", "runtime_dir", "stack_file",
           "stack_redis_url", "write_stack"]


class LocalStateError(RuntimeError):
    """The runtime directory or a stack file is unsafe or ambiguous; the message says what to do."""


def runtime_dir() -> Path:
    """This user's private directory for hsched's runtime files (created 0700; refused when not safe)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(xdg) / "hsched" if xdg and os.path.isdir(xdg) else \
        Path(tempfile.gettempdir()) / f"hsched-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise LocalStateError(f"{path} is not a directory (a symlink or a file): refusing to keep stack files "
                              "there; remove it, or set XDG_RUNTIME_DIR to a private directory")
    if st.st_uid != os.getuid():
        raise LocalStateError(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): refusing to use "
                              "it; remove it, or set XDG_RUNTIME_DIR to a private directory")
    if st.st_mode & 0o077:  # ours but readable by others (an older version, a umask): close it
        os.chmod(path, 0o700)
    return path


def stack_file(gateway: str) -> Path:
    """The file of the stack whose gateway listens on `gateway` (host:port)."""
    return runtime_dir() / f"stack-{re.sub(r'[^A-Za-z0-9.-]', '_', gateway)}.json"


def _start_time(pid: int) -> str | None:
    """The process' start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid, it tells a
    live `hsched up` from an unrelated process that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(info: dict) -> bool:
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process has that pid now
        return False
    started = info.get("pid_started")
    return started is None or _start_time(pid) in (None, started)


def write_stack(info: dict) -> Path:
    """Record a running stack (`info` needs `gateway`; `pid` defaults to this process). Returns the file."""
    info = {"pid": os.getpid(), **info}
    info.setdefault("pid_started", _start_time(info["pid"]))
    url = info.get("redis_url")
    if url and url_without_password(url) != url:
        raise ValueError("write_stack: redis_url carries a password; record the URL without it and the path of "
                         "the password file (redis_password_file)")
    path = stack_file(str(info["gateway"]))
    if path.is_symlink():
        raise LocalStateError(f"{path} is a symlink: refusing to write the stack file through it (remove it)")
    return write_private(path, json.dumps(info))


def _read(path: Path) -> dict | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # gone, or a symlink (ELOOP)
        return None
    with os.fdopen(fd) as f:
        try:
            info = json.load(f)
        except ValueError:
            return None
    return info if isinstance(info, dict) and isinstance(info.get("gateway"), str) else None


def read_stacks() -> list[dict]:
    """The stacks whose `hsched up` is alive, by gateway address; stale, broken or planted files are removed."""
    out = []
    for path in sorted(runtime_dir().glob("stack-*.json")):
        info = _read(path)
        if info is None or not _alive(info):
            path.unlink(missing_ok=True)
            continue
        out.append(info)
    return out


def pick_stack(gateway: str | None = None) -> dict:
    """The stack to talk to: the one on `gateway` when given — its whole target, or any one of its gateways'
    addresses ({} if no live stack is recorded there — the address alone is enough), else the only live one ({} when none); several live ones and no `gateway` is an
    error listing them."""
    live = read_stacks()
    if gateway:
        return next((s for s in live if gateway == s["gateway"] or gateway in addresses(s["gateway"])), {})
    if len(live) > 1:
        choices = ", ".join(f"{s['gateway']} (hsched up pid {s.get('pid')})" for s in live)
        raise LocalStateError(f"{len(live)} stacks are running: {choices}; choose one with --gateway or "
                              "HSCHED_GATEWAY")
    return live[0] if live else {}


def remove_stack(gateway: str, pid: int | None = None) -> None:
    """Remove the file of the stack on `gateway` if it is this process' (`pid`) record."""
    path = stack_file(gateway)
    info = _read(path)
    if info is not None and info.get("pid") == (os.getpid() if pid is None else pid):
        path.unlink(missing_ok=True)


def stack_redis_url(info: dict) -> str | None:
    """The Redis URL of a recorded stack, with the password read from its (0600) password file if it has one."""
    url = info.get("redis_url")
    if not url:
        return None
    password_file = info.get("redis_password_file")
    if not password_file:
        return url
    try:
        with open(password_file) as f:
            return url_with_password(url, f.read().strip())
    except OSError as exc:
        raise LocalStateError(f"cannot read the stack's Redis password file {password_file}: {exc.strerror}") \
            from None
