"""Errors the library raises; services map them to gRPC status codes."""

from __future__ import annotations

MAX_ECHO = 64  # characters of a bad value an error message repeats: a huge value must not become a huge error


def shown(value: object) -> str:
    """`value` as an error message repeats it: its repr, cut to MAX_ECHO characters."""
    text = repr(value)
    return text if len(text) <= MAX_ECHO else f"{text[:MAX_ECHO]}... ({len(text)} characters)"


class ValidationError(ValueError):
    """Bad input. `field` is the dotted path of the offending field, `rule` what it must satisfy. The message
    repeats at most MAX_ECHO characters of the value (it travels in gRPC trailers and is logged)."""

    def __init__(self, field: str, rule: str, value: object = None) -> None:
        self.field = field
        self.rule = rule
        self.value = value
        got = "" if value is None else f" (got {shown(value)})"
        super().__init__(f"{field[:2 * MAX_ECHO]}: {rule}{got}")


class FleetError(ValidationError):
    """A fleet description that cannot be loaded; `field` is the YAML path (e.g. datacenters[2].prices.cpu)."""


class ResourceExhausted(RuntimeError):
    """A limit on what clients may hold open (Watch streams, a Watch's undelivered events) was reached; the
    message says which limit and what to do."""
