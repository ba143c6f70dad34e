"""Who calls the gateway, and what that caller may see: the one place tenant isolation is decided.

A caller authenticates with a bearer token (`authorization: Bearer hst_...`, checked against the tokens file,
`hsched.security.tokens`) or with a verified client certificate whose URI SAN is
`spiffe://hsched.local/tenant/<tenant>` or `spiffe://hsched.local/admin/<name>`. Either gives a `Principal`:
a tenant (acts only as itself, sees only its own tasks) or an admin (sees and acts on every tenant's tasks,
and may submit for a tenant through the request's `tenant` field).

With authentication off (no tokens file and no client certificates: the local-development default) there is
no principal (None) and every rule below is today's behaviour: the request's `tenant` field is trusted.

Another tenant's task is answered exactly like a task that does not exist (NOT_FOUND, same message), so a
tenant cannot learn which task ids exist.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass

from hsched.security.pki import TRUST_DOMAIN
from hsched.security.tls import peer_identity
from hsched.security.tokens import NAME_RE, TokensFile

log = logging.getLogger("hsched.auth")

_SPIFFE = f"spiffe://{TRUST_DOMAIN}/"
TENANT, ADMIN = "tenant", "admin"


class Unauthenticated(Exception):
    """No usable credentials: the call is answered UNAUTHENTICATED with this message (it never repeats a
    token)."""


@dataclass(frozen=True)
class Principal:
    role: str  # TENANT or ADMIN
    tenant: str  # the tenant a TENANT acts as; an admin's own tenant or ""
    name: str  # the token's name or the certificate identity, for logs

    @property
    def admin(self) -> bool:
        return self.role == ADMIN


# -- the rules (None = authentication off: the request is trusted) ------------------------------------------------


def submit_tenant(principal: Principal | None, requested: str) -> str:
    """The tenant a Submit is recorded under (and its request_id scoped to): a tenant's own, whatever it sent."""
    return principal.tenant if principal is not None and not principal.admin else requested


def may_see(principal: Principal | None, task_tenant: str) -> bool:
    return principal is None or principal.admin or principal.tenant == task_tenant


def tenant_filter(principal: Principal | None, requested: str) -> str:
    """The tenant a List or Watch is restricted to ("" = every tenant): a tenant only ever its own."""
    return principal.tenant if principal is not None and not principal.admin else requested


# -- credentials -------------------------------------------------------------------------------------------------


def principal_of_identity(uri: str) -> Principal | None:
    """The client principal a certificate's SPIFFE URI names; None for anything else (a service identity,
    another trust domain, a malformed path)."""
    if not uri.startswith(_SPIFFE):
        return None
    kind, _, name = uri[len(_SPIFFE):].partition("/")
    if not NAME_RE.match(name) or kind not in (TENANT, ADMIN):
        return None
    return Principal(TENANT, name, uri) if kind == TENANT else Principal(ADMIN, "", uri)


def bearer_token(metadata) -> str | None:
    """The token of an `authorization: Bearer <token>` header; "" for a malformed header, None for none."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            value = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = value.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class GatewayAuth:
    """Authentication at the gateway: `tokens` (a TokensFile) and/or `certificates` (the gateway serves TLS
    and verifies the client certificates sent). With neither, `authenticate` returns None (auth off)."""

    def __init__(self, tokens: TokensFile | None = None, certificates: bool = False) -> None:
        self.tokens = tokens
        self.certificates = certificates
        self._logged_at = 0.0
        self._unlogged = 0

    @property
    def enabled(self) -> bool:
        return self.tokens is not None or self.certificates

    def authenticate(self, context) -> Principal | None:
        """The caller's principal; None when auth is off; Unauthenticated when auth is on and the call has no
        valid credentials. A presented token decides when there is a tokens file (a wrong one is refused even
        with a certificate)."""
        if not self.enabled:
            return None
        token = bearer_token(context.invocation_metadata())
        if token is not None and self.tokens is not None:
            return self._by_token(token, context)
        if self.certificates:
            # None for a certificate naming no or two identities (ambiguous: refused); never the common name
            identity = peer_identity(context)
            principal = principal_of_identity(identity) if identity else None
            if principal is not None:
                return principal
        if token is not None:
            self._refuse(context, "a bearer token, but this gateway has no tokens file", "this gateway does not "
                         "accept bearer tokens (no tokens file); use a tenant or admin client certificate")
        self._refuse(context, "no credentials", "this gateway requires a bearer token (metadata `authorization: "
                     "Bearer <token>`) or a tenant/admin client certificate")

    def _by_token(self, token: str, context) -> Principal:
        if not token:
            self._refuse(context, "a malformed authorization header", "malformed authorization metadata: "
                         "expected `Bearer <token>`")
        entry = self.tokens.table().match(token)
        if entry is None:
            self._refuse(context, "an unknown or revoked token", "invalid or revoked token")
        if entry.expired(dt.datetime.now(dt.UTC)):
            self._refuse(context, f"the expired token {entry.name!r}", "token expired")
        return Principal(entry.role, entry.tenant, entry.name)

    def _refuse(self, context, what: str, message: str):
        """Log the refusal (never the token; at most one line per 10 s, counting the rest) and raise."""
        now = time.monotonic()
        if now - self._logged_at >= 10.0:
            more = f" (and {self._unlogged} more refusals since the last line)" if self._unlogged else ""
            log.warning("unauthenticated call from %s: %s%s", context.peer(), what, more)
            self._logged_at, self._unlogged = now, 0
        else:
            self._unlogged += 1
        raise Unauthenticated(message)
