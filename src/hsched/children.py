"""Child processes that do not outlive the process that started them.

`hsched up` (hsched.stack.Stack) starts redis-server, the services and Prometheus in sessions of their own (a
Ctrl-C at the terminal reaches the supervisor, which stops them in order). A supervisor that is killed with
SIGKILL (or by the OOM killer) runs no cleanup, so those children used to live on: a whole stack serving its
ports, spending CPU and holding its Redis with no one to stop it. On Linux each child is now started through
util-linux's `setpriv --pdeathsig TERM`, which asks the kernel for SIGTERM when the parent dies and then execs
the command (same pid): the services stop as on a `kill` (graceful, hsched.runtime) and redis-server shuts down
as on SIGTERM (its AOF flushed). Without setpriv (not Linux, or an util-linux older than 2.33) commands run
as they are. Compose and Kubernetes start the services themselves and are not concerned.

Not `preexec_fn` + prctl: it makes subprocess fork() instead of vfork(), and gRPC's fork handlers abort the
forked copy of a process that has gRPC channels (the supervisor probes health over gRPC).

The kernel's "parent" is the thread that started the child: a child spawned from a thread that ends is sent
SIGTERM then. The stack spawns from its caller's thread and from its supervisor thread, which lives until the
stack has stopped its children.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys


@functools.cache
def _setpriv() -> str | None:
    """setpriv's path if it takes --pdeathsig here (checked once by running it), else None."""
    path = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    if path is None:
        return None
    try:
        done = subprocess.run([path, "--pdeathsig", "TERM", "--", sys.executable, "-c", ""],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if done.returncode == 0 else None


def dying_with_parent(argv: list[str]) -> list[str]:
    """`argv` run so that it is sent SIGTERM when this process (the thread starting it) dies, where possible."""
    path = _setpriv()
    return [path, "--pdeathsig", "TERM", "--", *argv] if path else list(argv)
