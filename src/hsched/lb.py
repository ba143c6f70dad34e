"""Client-side load balancing over replicas named by one gRPC target."""

from __future__ import annotations


def addresses(target: str) -> list[str]:
    """The host:port addresses a target names: "ipv4:a:1,b:2" -> ["a:1", "b:2"]; a plain "host:port" -> itself."""
    if target.startswith(("ipv4:", "ipv6:")):
        target = target.partition(":")[2]
    return [a for a in target.split(",") if a]


def balanced(target: str, options=()) -> list:
    """`options` for a channel to `target`, with gRPC's round_robin policy when the target names several
    addresses ("ipv4:10.0.0.1:50051,10.0.0.2:50051"): replicas (gateways, selectors) behind one target, each
    new call or stream on the next ready one, one that goes away skipped (pick_first, gRPC's default, would
    send everything to the first address). Such a target's authority is its first address (gRPC would take the
    whole list, which no TLS certificate names): every replica serves the same certificate, verified against
    that host unless the options override the name (`grpc.ssl_target_name_override`)."""
    if "," not in target:
        return list(options)
    out = [*options, ("grpc.lb_policy_name", "round_robin")]
    if not any(name == "grpc.default_authority" for name, _ in out):
        out.append(("grpc.default_authority", addresses(target)[0]))
    return out
