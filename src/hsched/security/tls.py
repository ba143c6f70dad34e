"""gRPC TLS credentials from a TLS directory (`hsched.security.pki` layout), reloaded when the files change.

Server side: `server_credentials` uses grpc's dynamic certificate configuration, whose fetcher grpc calls
before every new connection's handshake; it re-reads ca.crt / <name>.crt / <name>.key when their stat
changed (a rename by `pki.rotate`, a Kubernetes secret update), so a rotated certificate is presented to new
connections without a restart; existing connections keep theirs.

Client side: `ReloadingChannel` holds a channel built from the files and, when they change (checked at most
once per `check_interval_s` on a call), builds a new channel for new calls. The old one is left open, not
closed on a timer: a long-lived stream on it (the gateway's batch streams) keeps working on its established
connection and moves to the new channel when it is next opened (a broken stream is reopened by its caller);
retired channels are closed with the ReloadingChannel, or the oldest once more than `keep_retired` pile up.

Client certificates at a server (`client_auth`): grpc Python exposes only two of the C core's modes —
`require_client_auth=True` (GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY) and False
(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE: the server never asks, so a client certificate is never sent).
"Request and verify if sent" is not reachable from Python (checked against grpcio 1.85: a client that holds
a certificate connects to a require_client_auth=False server with an empty auth context). So:
  require  -> a client certificate of the CA is required and verified (internal services; gateway opt-in)
  optional -> TLS without client certificates: clients authenticate with tokens (the gateway's default)
  none     -> the same as optional for the transport
A tenant/admin client-certificate identity therefore reaches the gateway only with `--client-auth require`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from hsched.security.files import files_fingerprint
from hsched.security.pki import PkiError, ca_paths, paths

log = logging.getLogger(__name__)

CLIENT_AUTH = ("optional", "require", "none")


@dataclass(frozen=True)
class TlsFiles:
    """The CA bundle and the `name` leaf of a TLS directory."""
    directory: Path
    name: str

    @classmethod
    def of(cls, directory: str | os.PathLike | None, name: str) -> TlsFiles | None:
        return cls(Path(directory), name) if directory else None

    @property
    def ca(self) -> Path:
        return ca_paths(self.directory)[0]

    @property
    def cert(self) -> Path:
        return paths(self.directory, self.name)[0]

    @property
    def key(self) -> Path:
        return paths(self.directory, self.name)[1]

    def fingerprint(self) -> tuple:
        """What changes when any of the three files is replaced (`files_fingerprint`)."""
        return files_fingerprint((self.ca, self.cert, self.key))

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(ca bundle, certificate chain, key) PEM; PkiError unless all exist, parse, and the key belongs to
        the certificate (a half-rotated pair is refused, not served)."""
        data = []
        for p in (self.ca, self.cert, self.key):
            try:
                data.append(Path(p).read_bytes())
            except FileNotFoundError:
                raise PkiError(f"{p}: no such file (create it with `hsched certs init --dir {self.directory}`)") \
                    from None
            except OSError as exc:
                raise PkiError(f"cannot read {p}: {exc.strerror}") from None
        ca, cert, key = data
        try:
            x509.load_pem_x509_certificates(ca)
            leaf = x509.load_pem_x509_certificate(cert)
            private = serialization.load_pem_private_key(key, password=None)
        except (ValueError, TypeError) as exc:
            raise PkiError(f"TLS files of {self.name!r} in {self.directory}: {exc}") from None
        if private.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) \
                != leaf.public_key().public_bytes(serialization.Encoding.DER,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo):
            raise PkiError(f"{self.key} does not belong to {self.cert}")
        return ca, cert, key


def _read_settled(files: TlsFiles, attempts: int = 20) -> tuple[tuple, tuple[bytes, bytes, bytes]]:
    """The files and their fingerprint, retried briefly while a rotation is half way (key written, cert not)."""
    for attempt in range(attempts):
        before = files.fingerprint()
        try:
            data = files.read()
        except PkiError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.05)
            continue
        if files.fingerprint() == before:
            return before, data
    raise PkiError(f"TLS files of {files.name!r} in {files.directory} kept changing while being read")


class _CertificateFetcher:
    """grpc's certificate-configuration callback: None (keep the current one) unless the files changed."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self.seen, (ca, cert, key) = _read_settled(files)
        self.initial = grpc.ssl_server_certificate_configuration([(key, cert)], ca)
        self.reloads = 0
        self._warned: tuple | None = None  # the unusable files' fingerprint already logged (once, not per connection)

    def __call__(self) -> Any:
        try:
            return self._fetch()
        except Exception:  # called by grpc before a handshake: never fail it for a reload
            log.exception("TLS: reloading the %s certificate failed; keeping the current one", self.files.name)
            return None

    def _fetch(self) -> Any:
        fingerprint = self.files.fingerprint()
        if fingerprint == self.seen:
            return None
        try:
            ca, cert, key = self.files.read()
        except PkiError as exc:  # half-rotated or removed: keep serving the last good pair, retry next connection
            if self._warned != fingerprint:
                self._warned = fingerprint
                log.warning("TLS files changed but cannot be used (%s); keeping the current certificate", exc)
            return None
        self.seen = fingerprint
        self.reloads += 1
        log.info("TLS: %s certificate reloaded from %s", self.files.name, self.files.directory)
        return grpc.ssl_server_certificate_configuration([(key, cert)], ca)


def server_credentials(files: TlsFiles, client_auth: str = "require") -> grpc.ServerCredentials:
    """TLS server credentials presenting `files`' leaf, re-read on change (module docstring); with
    client_auth "require" every client must present a certificate signed by the CA bundle."""
    if client_auth not in CLIENT_AUTH:
        raise ValueError(f"client_auth {client_auth!r}: must be one of {', '.join(CLIENT_AUTH)}")
    fetcher = _CertificateFetcher(files)
    return grpc.dynamic_ssl_server_credentials(fetcher.initial, fetcher,
                                               require_client_authentication=client_auth == "require")


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Mutual-TLS client credentials from a TLS directory's leaf (read once: `ReloadingChannel` follows
    changes)."""
    _, (ca_pem, cert_pem, key_pem) = _read_settled(files)
    return grpc.ssl_channel_credentials(ca_pem, key_pem, cert_pem)


def peer_identity(context: Any) -> str | None:
    """The caller's SPIFFE ID (the spiffe:// URI SAN of its verified client certificate), or None."""
    auth = context.auth_context()
    ids = auth.get("peer_spiffe_id")  # grpc sets it when the leaf has exactly one spiffe:// URI SAN
    if ids:
        return ids[0].decode()
    uris = [u.decode() for u in auth.get("peer_uri", ()) if u.startswith(b"spiffe://")]
    return uris[0] if len(uris) == 1 else None


class ReloadingChannel:
    """A grpc.aio channel over TLS files that is rebuilt when they change (module docstring). Multicallables
    made from it (stubs) resolve the current channel on every call."""

    def __init__(self, files: TlsFiles, build: Callable[[grpc.ChannelCredentials], grpc.aio.Channel],
                 check_interval_s: float = 1.0, keep_retired: int = 4, close_grace_s: float = 60.0) -> None:
        self._files = files
        self._build = build
        self._check_interval_s = check_interval_s
        self._keep_retired = keep_retired
        self._close_grace_s = close_grace_s
        self._seen, (ca, cert, key) = _read_settled(files)
        self._channel = build(grpc.ssl_channel_credentials(ca, key, cert))
        self._generation = 0
        self._checked_at = time.monotonic()
        self._retired: list[grpc.aio.Channel] = []  # replaced channels, still open (module docstring)
        self._closing: list[asyncio.Task] = []

    @property
    def generation(self) -> int:
        """How many times the channel was rebuilt for changed files."""
        return self._generation

    def current(self) -> tuple[int, grpc.aio.Channel]:
        now = time.monotonic()
        if now - self._checked_at >= self._check_interval_s:
            self._checked_at = now
            self.reload_if_changed()
        return self._generation, self._channel

    def reload_if_changed(self) -> bool:
        if self._files.fingerprint() == self._seen:
            return False
        try:
            self._seen, (ca, cert, key) = _read_settled(self._files, attempts=1)
        except PkiError as exc:
            log.warning("TLS files changed but cannot be used yet (%s); keeping the current channel", exc)
            return False
        old = self._channel
        self._channel = self._build(grpc.ssl_channel_credentials(ca, key, cert))
        self._generation += 1
        log.info("TLS: %s client certificate reloaded from %s; new calls use a new channel",
                 self._files.name, self._files.directory)
        self._retired.append(old)
        if len(self._retired) > self._keep_retired:
            with contextlib.suppress(RuntimeError):  # no running loop: closed with the ReloadingChannel
                loop = asyncio.get_running_loop()
                self._closing.append(loop.create_task(self._retired.pop(0).close(grace=self._close_grace_s)))
        return True

    def unary_unary(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return _Reloading(self, "unary_unary", (method, request_serializer, response_deserializer, _registered_method))

    def unary_stream(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return _Reloading(self, "unary_stream", (method, request_serializer, response_deserializer, _registered_method))

    def stream_unary(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return _Reloading(self, "stream_unary", (method, request_serializer, response_deserializer, _registered_method))

    def stream_stream(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return _Reloading(self, "stream_stream", (method, request_serializer, response_deserializer,
                                                  _registered_method))

    async def close(self, grace: float | None = None) -> None:
        for old in self._retired:
            await old.close(grace)
        self._retired.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
        await self._channel.close(grace)

    async def __aenter__(self) -> ReloadingChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __getattr__(self, name: str) -> Any:  # get_state, channel_ready, wait_for_state_change
        return getattr(self._channel, name)


class _Reloading:
    """A multicallable bound to the ReloadingChannel's current channel at each call."""

    __slots__ = ("_args", "_generation", "_inner", "_kind", "_owner")

    def __init__(self, owner: ReloadingChannel, kind: str, args: tuple) -> None:
        self._owner, self._kind, self._args = owner, kind, args
        self._generation, self._inner = -1, None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        generation, channel = self._owner.current()
        if generation != self._generation:
            self._inner = getattr(channel, self._kind)(*self._args)
            self._generation = generation
        return self._inner(*args, **kwargs)
