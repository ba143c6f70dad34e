"""Errors the library raises; services map them to gRPC status codes."""

from __future__ import annotations


class ValidationError(ValueError):
    """Bad input. `field` is the dotted path of the offending field, `rule` what it must satisfy."""

    def __init__(self, field: str, rule: str, value: object = None) -> None:
        self.field = field
        self.rule = rule
        self.value = value
        shown = "" if value is None else f" (got {value!r})"
        super().__init__(f"{field}: {rule}{shown}")


class FleetError(ValidationError):
    """A fleet description that cannot be loaded; `field` is the YAML path (e.g. datacenters[2].prices.cpu)."""


class ResourceExhausted(RuntimeError):
    """A limit on what clients may hold open (Watch streams, a Watch's undelivered events) was reached; the
    message says which limit and what to do."""
