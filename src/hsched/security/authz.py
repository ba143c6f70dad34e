"""Which service identities may call which method of a service that requires client certificates (selector,
placer, thermal; the gateway with `--client-auth require`).

The caller's identity is the SPIFFE ID of its client certificate (`hsched.security.tls.peer_identity`); the
handshake already refused callers without a certificate of the CA, so this table only decides *which* of
the CA's identities may call a method. A method missing from the table is refused (default deny).
Enforced for every handler at registration (`hsched.rpc.start_server` -> `rpc.checked(..., authorize=...)`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from hsched.security.pki import TRUST_DOMAIN
from hsched.security.tls import peer_identity
from hsched.v1 import gateway_pb2

ANY = "*"  # any identity the CA signed (the handshake checked the signature)

# principal names: a service role, or "admin" for any spiffe://hsched.local/admin/<name>
POLICY: dict[str, frozenset[str]] = {
    "/hsched.v1.Placer/Place": frozenset({"gateway"}),
    "/hsched.v1.Placer/PlaceBatch": frozenset({"gateway"}),
    "/hsched.v1.Placer/Release": frozenset({"gateway"}),
    "/hsched.v1.Placer/ReleaseBatch": frozenset({"gateway"}),
    "/hsched.v1.Placer/GetState": frozenset({"gateway", "selector", "supervisor", "admin"}),
    "/hsched.v1.Placer/SetSchedulable": frozenset({"gateway", "admin"}),
    "/hsched.v1.Thermal/Predict": frozenset({"placer", "gateway"}),
    "/hsched.v1.Thermal/GetState": frozenset({"placer", "gateway", "selector", "admin"}),
    "/hsched.v1.Selector/SelectDataCenter": frozenset({"gateway"}),
    "/hsched.v1.Selector/SelectDataCenters": frozenset({"gateway"}),
    # the gateway's clients are tenants and operators, authenticated by the gateway itself (tokens, or the
    # certificate's identity): with `--client-auth require` the handshake needs a CA certificate, nothing more here
    **{f"/hsched.v1.Gateway/{m.name}": frozenset({ANY})
       for m in gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].methods},
    "/grpc.health.v1.Health/Check": frozenset({ANY}),
    "/grpc.health.v1.Health/Watch": frozenset({ANY}),
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": frozenset({"admin", "supervisor"}),
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": frozenset({"admin", "supervisor"}),
}

_SERVICE = f"spiffe://{TRUST_DOMAIN}/service/"
_ADMIN = f"spiffe://{TRUST_DOMAIN}/admin/"


def principal(identity: str | None) -> str | None:
    """The table's name for a SPIFFE ID: the role of a service identity, "admin" for an admin identity,
    None for anything else (tenants, other trust domains, no identity)."""
    if not identity:
        return None
    if identity.startswith(_SERVICE):
        return identity[len(_SERVICE):] or None
    if identity.startswith(_ADMIN) and len(identity) > len(_ADMIN):
        return "admin"
    return None


def _admits(rule: frozenset[str], identity: str | None) -> bool:
    return ANY in rule or principal(identity) in rule


def allowed(method: str, identity: str | None) -> bool:
    """Whether `identity` may call `method`: the decision every guard makes (a method not in POLICY: no)."""
    return _admits(POLICY.get(method, frozenset()), identity)


Guard = Callable[[grpc.aio.ServicerContext], Awaitable[None]]


def guard_for(method: str) -> Guard | None:
    """The check run before `method`'s handler (aborts PERMISSION_DENIED naming the identity and the
    method), or None when any CA-signed identity may call it."""
    rule = POLICY.get(method, frozenset())
    if ANY in rule:
        return None

    async def guard(context: grpc.aio.ServicerContext) -> None:
        identity = peer_identity(context)
        if not _admits(rule, identity):
            who = identity or "a caller without a service identity"
            may = ", ".join(sorted(rule)) or "nobody (not in hsched.security.authz.POLICY)"
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{who} may not call {method} (allowed: {may})")

    return guard
