"""Client-side load balancing over replicas named by one gRPC target."""

from __future__ import annotations


def balanced(target: str, options=()) -> list:
    """`options` for a channel to `target`, with gRPC's round_robin policy when the target names several
    addresses ("ipv4:10.0.0.1:50051,10.0.0.2:50051"): replicas (gateways, selectors) behind one target, each
    new call or stream on the next ready one, one that goes away skipped (pick_first, gRPC's default, would
    send everything to the first address)."""
    return [*options, ("grpc.lb_policy_name", "round_robin")] if "," in target else list(options)
