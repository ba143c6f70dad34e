"""The credentials a client of the gateway (the CLI, a replay) sends: a bearer token and TLS settings.

The token never comes from a command-line value (it would show in `ps`): it is read from the environment
(HSCHED_TOKEN) or from a file (--token-file, HSCHED_TOKEN_FILE, or the `token_file` path the running-stack file
names). TLS: --tls-ca / HSCHED_TLS_CA verifies the gateway; HSCHED_TLS_CERT + HSCHED_TLS_KEY add a client
certificate (a tenant or admin identity).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from hsched.domain.errors import ValidationError
from hsched.lb import balanced
from hsched.security.tokens import read_token_file


@dataclass(frozen=True)
class ClientCredentials:
    token: str | None = None
    tls_ca: str | None = None  # PEM bundle that verifies the gateway (None with a client cert: system roots)
    tls_cert: str | None = None
    tls_key: str | None = None

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the token as `authorization: Bearer <token>` (none without a token)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel_credentials(self) -> grpc.ChannelCredentials:
        def read(path: str, what: str) -> bytes:
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as exc:
                raise ValidationError(what, f"cannot read {path} ({exc.strerror or exc})") from None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.tls_ca, "tls_ca") if self.tls_ca else None,
            private_key=read(self.tls_key, "HSCHED_TLS_KEY") if self.tls_key else None,
            certificate_chain=read(self.tls_cert, "HSCHED_TLS_CERT") if self.tls_cert else None)

    def channel(self, target: str, options=None) -> grpc.Channel:
        options = balanced(target, options or ())
        if self.tls:
            return grpc.secure_channel(target, self.channel_credentials(), options=options)
        return grpc.insecure_channel(target, options=options)

    def aio_channel(self, target: str, options=None) -> grpc.aio.Channel:
        options = balanced(target, options or ())
        if self.tls:
            return grpc.aio.secure_channel(target, self.channel_credentials(), options=options)
        return grpc.aio.insecure_channel(target, options=options)


def client_credentials(token_file: str | None = None, tls_ca: str | None = None, stack: Mapping | None = None,
                       env: Mapping[str, str] = os.environ) -> ClientCredentials:
    """The credentials to send, first found wins: token from `token_file` (--token-file), HSCHED_TOKEN,
    HSCHED_TOKEN_FILE, then the running stack's `token_file`; CA from `tls_ca` (--tls-ca), HSCHED_TLS_CA, then
    the stack's `tls_ca`. `stack` is the running-stack record, passed only when the call goes to that stack's
    gateway (its admin token must not travel to another server). ValidationError naming the source if unusable."""
    stack = stack or {}
    if token_file:
        token = _token_from(token_file, "--token-file")
    elif env.get("HSCHED_TOKEN"):
        token = env["HSCHED_TOKEN"].strip()
        if any(c.isspace() for c in token) or not token.isprintable():
            raise ValidationError("HSCHED_TOKEN", "must hold one token (hst_...) and nothing else")
    elif env.get("HSCHED_TOKEN_FILE"):
        token = _token_from(env["HSCHED_TOKEN_FILE"], "HSCHED_TOKEN_FILE")
    elif stack.get("token_file"):
        token = _token_from(stack["token_file"], "the running stack's token_file")
    else:
        token = None
    cert, key = env.get("HSCHED_TLS_CERT") or None, env.get("HSCHED_TLS_KEY") or None
    if bool(cert) != bool(key):
        raise ValidationError("HSCHED_TLS_CERT" if key else "HSCHED_TLS_KEY",
                              "a client certificate needs both HSCHED_TLS_CERT and HSCHED_TLS_KEY")
    ca = tls_ca or env.get("HSCHED_TLS_CA") or stack.get("tls_ca") or None
    return ClientCredentials(token, ca, cert, key)


def _token_from(path: str, source: str) -> str:
    try:
        return read_token_file(path)
    except ValidationError as exc:
        raise ValidationError(source, exc.rule.replace("the token file", f"the token file {path}")) from None
