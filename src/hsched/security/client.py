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
    tls_ca_source: str = "tls_ca"  # where tls_ca came from, as its errors name it: --tls-ca, HSCHED_TLS_CA, ...

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the token as `authorization: Bearer <token>` (none without a token)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The TLS credentials, each file read and parsed first: a file that is not what it should be (no PEM
        certificate, a key where the CA belongs, a key that is not the certificate's) is a ValidationError naming
        its source and path, never gRPC's handshake failure (UNAVAILABLE after a dozen lines of C-core log)."""
        ca = _pem(self.tls_ca, self.tls_ca_source, "certificate") if self.tls_ca else None
        cert = _pem(self.tls_cert, "HSCHED_TLS_CERT", "certificate") if self.tls_cert else None
        key = _pem(self.tls_key, "HSCHED_TLS_KEY", "key") if self.tls_key else None
        if cert is not None and key is not None:
            _check_pair(self.tls_cert, cert, self.tls_key, key)
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

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
    gateway (its admin token must not travel to another server). ValidationError naming the source if unusable.

    HSCHED_TOKEN or HSCHED_TOKEN_FILE set but empty gives no token and takes none from the running stack (an
    environment cleared on purpose, or `HSCHED_TOKEN=$(cat lost.token)`: never quietly the stack's admin token;
    the gateway then answers UNAUTHENTICATED). A client certificate of the user's own (HSCHED_TLS_CERT) is who
    they mean to be: the stack's admin token is then not added either (an explicit token still is)."""
    stack = stack or {}
    cleared = any(name in env and not env[name].strip() for name in ("HSCHED_TOKEN", "HSCHED_TOKEN_FILE"))
    cert, key = env.get("HSCHED_TLS_CERT") or None, env.get("HSCHED_TLS_KEY") or None
    if bool(cert) != bool(key):
        raise ValidationError("HSCHED_TLS_CERT" if key else "HSCHED_TLS_KEY",
                              "a client certificate needs both HSCHED_TLS_CERT and HSCHED_TLS_KEY")
    if token_file:
        token = _token_from(token_file, "--token-file")
    elif env.get("HSCHED_TOKEN"):
        token = env["HSCHED_TOKEN"].strip()
        if any(c.isspace() for c in token) or not token.isprintable():
            raise ValidationError("HSCHED_TOKEN", "must hold one token (hst_...) and nothing else")
    elif env.get("HSCHED_TOKEN_FILE"):
        token = _token_from(env["HSCHED_TOKEN_FILE"], "HSCHED_TOKEN_FILE")
    elif stack.get("token_file") and not cert and not cleared:
        token = _token_from(stack["token_file"], "the running stack's token_file")
    else:
        token = None
    if tls_ca:
        ca, source = tls_ca, "--tls-ca"
    elif env.get("HSCHED_TLS_CA"):
        ca, source = env["HSCHED_TLS_CA"], "HSCHED_TLS_CA"
    else:
        ca, source = stack.get("tls_ca") or None, "the running stack's tls_ca"
    return ClientCredentials(token, ca, cert, key, source)


def _token_from(path: str, source: str) -> str:
    try:
        return read_token_file(path)
    except ValidationError as exc:
        raise ValidationError(source, exc.rule.replace("the token file", f"the token file {path}")) from None


def _read(path: str, source: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValidationError(source, f"cannot read {path} ({exc.strerror or exc})") from None


def _pem(path: str, source: str, kind: str) -> bytes:
    """The file's bytes once they parse as PEM certificates (kind "certificate": one or more) or one unencrypted
    PEM private key (kind "key"); ValidationError naming `source` and the file otherwise."""
    from cryptography import x509
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    data = _read(path, source)
    if kind == "certificate":
        try:
            x509.load_pem_x509_certificates(data)
        except ValueError:
            what = " (it holds a private key)" if b"PRIVATE KEY-----" in data else ""
            raise ValidationError(source, f"{path} is not a PEM certificate file{what}: it must hold one or more "
                                  "-----BEGIN CERTIFICATE----- blocks") from None
        return data
    try:
        serialization.load_pem_private_key(data, password=None)
    except TypeError:  # encrypted
        raise ValidationError(source, f"{path} is an encrypted private key: it must be an unencrypted PEM private "
                              "key") from None
    except (ValueError, UnsupportedAlgorithm):
        what = " (it holds a certificate)" if b"BEGIN CERTIFICATE" in data else ""
        raise ValidationError(source, f"{path} is not a PEM private key{what}: it must hold one -----BEGIN ... "
                              "PRIVATE KEY----- block") from None
    return data


def _check_pair(cert_path: str, cert_pem: bytes, key_path: str, key_pem: bytes) -> None:
    """The key must be the private key of the chain's first (leaf) certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificates(cert_pem)[0]
    key = serialization.load_pem_private_key(key_pem, password=None)
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        raise ValidationError("HSCHED_TLS_KEY", f"{key_path} is not the private key of the certificate "
                              f"{cert_path} (HSCHED_TLS_CERT): give the key that belongs to it")
