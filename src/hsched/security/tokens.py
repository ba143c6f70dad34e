"""Bearer tokens of the gateway's clients, kept as SHA-256 hashes in a YAML tokens file.

A token is `hst_` + 32 random bytes (URL-safe base64). Only its SHA-256 hash is stored, so the file reveals no
credential; the token itself is shown once, when `hsched tokens create` makes it. The file:

    version: 1
    tokens:
      - name: alice-ci            # unique; what `tokens revoke` and the gateway's log lines name
        tenant: alice             # the tenant every call with this token acts as (a DNS-1123 label)
        role: tenant              # tenant | admin (admin: sees and acts on every tenant's tasks)
        sha256: 3f5a...           # hex SHA-256 of the token
        expires: 2027-01-01T00:00:00Z   # optional (ISO 8601; without a zone: UTC)

`load_tokens` validates it whole and names the offending field (`tokens[2].role: ...`); `TokensFile` is what
the gateway holds: it re-reads the file when it changes (revocation without a restart) and keeps the last
good table when an edit is broken, less any token whose hash the broken file no longer holds (a revocation
sticks). Writes (`create_token`, `revoke_token`) replace the file atomically, 0600.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

import yaml

from hsched import yamlfile
from hsched.domain.errors import ValidationError
from hsched.domain.task import NAME_RE  # a token's tenant and name follow TaskSpec.tenant's rule
from hsched.security.files import write_private

log = logging.getLogger(__name__)


TOKEN_PREFIX = "hst_"
TOKEN_BYTES = 32
ROLES = ("tenant", "admin")
VERSION = 1
_HEX_RE = re.compile(r"^[0-9a-f]{64}\Z")
_ENTRY_KEYS = ("name", "tenant", "role", "sha256", "expires")
_NAME_RULE = "must be a DNS-1123 label: lowercase alphanumerics, '-', '.', '_', 1-63 characters, starting and " \
             "ending alphanumeric"


class TokensFileError(ValidationError):
    """A tokens file that cannot be used; `field` is its YAML path (tokens[2].sha256). The message never
    repeats a `sha256` value: someone may have pasted the token itself there."""


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_BYTES)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class TokenEntry:
    name: str
    tenant: str  # "" only for an admin without a tenant of its own
    role: str
    sha256: str
    expires: dt.datetime | None = None  # aware, UTC

    def expired(self, now: dt.datetime) -> bool:
        return self.expires is not None and now >= self.expires

    def to_yaml(self) -> dict:
        out = {"name": self.name, "tenant": self.tenant, "role": self.role, "sha256": self.sha256}
        if not self.tenant:
            del out["tenant"]
        if self.expires is not None:
            out["expires"] = self.expires.strftime("%Y-%m-%dT%H:%M:%SZ")
        return out


def _expires(field: str, value: object) -> dt.datetime:
    """YAML gives a datetime (naive = UTC, as YAML says), a date, or a string (ISO 8601)."""
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise TokensFileError(field, "must be an ISO 8601 time such as 2027-01-01T00:00:00Z", value) from None
    if isinstance(value, dt.datetime):
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)
    if isinstance(value, dt.date):
        return dt.datetime(value.year, value.month, value.day, tzinfo=dt.UTC)
    raise TokensFileError(field, "must be an ISO 8601 time such as 2027-01-01T00:00:00Z", value)


def _entry(i: int, raw: object) -> TokenEntry:
    where = f"tokens[{i}]"
    if not isinstance(raw, dict):
        raise TokensFileError(where, "must be a mapping with name, tenant, role, sha256 (and optional expires)")
    for key in raw:
        if key not in _ENTRY_KEYS:
            raise TokensFileError(f"{where}.{key}" if isinstance(key, str) else where,
                                  f"unknown field; allowed: {', '.join(_ENTRY_KEYS)}",
                                  None if isinstance(key, str) else key)
    role = raw.get("role", "tenant")
    if role not in ROLES:
        raise TokensFileError(f"{where}.role", f"must be one of {', '.join(ROLES)}", role)
    tenant = raw.get("tenant", "")
    if tenant is None:
        tenant = ""
    if not isinstance(tenant, str) or (tenant and not NAME_RE.match(tenant)):
        raise TokensFileError(f"{where}.tenant", _NAME_RULE, tenant)
    if role == "tenant" and not tenant:
        raise TokensFileError(f"{where}.tenant", "is required for role tenant")
    name = raw.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise TokensFileError(f"{where}.name", "is required and " + _NAME_RULE, name)
    digest = raw.get("sha256")
    if not isinstance(digest, str) or not _HEX_RE.match(digest):
        # the value is not repeated: it may be a pasted token
        raise TokensFileError(f"{where}.sha256", "is required: the 64 lowercase hex digits of the token's SHA-256 "
                              "(`hsched tokens create` writes it)")
    expires = _expires(f"{where}.expires", raw["expires"]) if raw.get("expires") is not None else None
    return TokenEntry(name, tenant, role, digest, expires)


def parse_tokens(document: object) -> list[TokenEntry]:
    """The entries of a parsed tokens file; TokensFileError naming the first field that breaks a rule."""
    if document is None:
        return []
    if not isinstance(document, dict):
        raise TokensFileError("(top level)", "must be a mapping with `version: 1` and a `tokens` list")
    for key in document:
        if key not in ("version", "tokens"):
            # repr() keeps an empty or non-string key visible as a field name
            raise TokensFileError(key if isinstance(key, str) and key else repr(key),
                                  "unknown field; allowed: version, tokens")
    if document.get("version", VERSION) != VERSION:
        raise TokensFileError("version", f"must be {VERSION}", document.get("version"))
    raw = document.get("tokens")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise TokensFileError("tokens", "must be a list of entries")
    entries = [_entry(i, item) for i, item in enumerate(raw)]
    names: set[str] = set()
    hashes: set[str] = set()
    for i, e in enumerate(entries):
        if e.name in names:
            raise TokensFileError(f"tokens[{i}].name", "must be unique in the file", e.name)
        if e.sha256 in hashes:
            raise TokensFileError(f"tokens[{i}].sha256", "must be unique in the file (the same token twice)")
        names.add(e.name)
        hashes.add(e.sha256)
    return entries


def load_tokens(path: str | os.PathLike) -> list[TokenEntry]:
    """Read and validate a tokens file; TokensFileError (naming the file and the field) if it is unusable."""
    try:
        # YAML 1.1 numbers: every value is a string, and _write's safe_dump leaves a name such as `1e5` unquoted
        document = yamlfile.document(yamlfile.read_text(path), str(path), json_numbers=False)
    except OSError as exc:
        raise TokensFileError(str(path), f"cannot read the tokens file ({exc.strerror or exc})") from None
    except yamlfile.YamlFileError as exc:
        raise TokensFileError(str(path), exc.rule) from None
    try:
        return parse_tokens(document)
    except TokensFileError as exc:
        raise TokensFileError(f"{path}: {exc.field}", exc.rule, exc.value) from None


class TokenTable:
    """The entries of one version of the tokens file, matched against presented tokens."""

    def __init__(self, entries: list[TokenEntry]) -> None:
        self.entries = list(entries)
        self._digests = [(bytes.fromhex(e.sha256), e) for e in self.entries]

    def match(self, token: str) -> TokenEntry | None:
        """The entry of `token`, or None. Every stored hash is compared in constant time, with no early exit,
        so the time taken says nothing about which hash, or how much of one, matched."""
        presented = hashlib.sha256(token.encode()).digest()
        found = None
        for digest, entry in self._digests:
            if hmac.compare_digest(digest, presented):
                found = entry
        return found


class TokensFile:
    """The tokens file the gateway authenticates against. `table()` re-reads it when it changed (size, mtime
    or inode: `tokens create/revoke` replace it by a rename); an edit that does not validate keeps the last
    good table, less the tokens whose hash the file no longer holds, and is logged once (until the file changes
    again). Missing or broken at start: TokensFileError."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._seen = self._signature()
        self._table = TokenTable(load_tokens(self.path))

    def _signature(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def table(self) -> TokenTable:
        signature = self._signature()
        if signature == self._seen:
            return self._table
        with self._lock:
            if signature != self._seen:
                self._seen = signature
                try:
                    self._table = TokenTable(load_tokens(self.path))
                    log.info("tokens file %s reloaded: %d tokens", self.path, len(self._table.entries))
                except TokensFileError as exc:
                    kept = self._still_named(self._table.entries)
                    gone = len(self._table.entries) - len(kept)
                    self._table = TokenTable(kept)
                    log.error("tokens file changed but cannot be used, keeping the previous %d tokens%s: %s",
                              len(kept), f" (dropped {gone} whose hash the file no longer holds)" if gone else "",
                              exc)
        return self._table

    def _still_named(self, entries: list[TokenEntry]) -> list[TokenEntry]:
        """The entries whose sha256 the file's text (unusable as YAML or by the rules) still holds. This gateway
        may not have seen every good version: `tokens revoke` then a broken edit before any call would keep the
        revoked token with the last table it read. A token whose hash left the file stays refused; an unreadable
        or missing file keeps none."""
        try:
            text = self.path.read_text(errors="replace")
        except OSError:
            return []
        return [e for e in entries if e.sha256 in text]


# -- editing the file (hsched tokens create / list / revoke) -----------------------------------------------------


def _write(path: Path, entries: list[TokenEntry]) -> None:
    write_private(path, "# hsched tokens file: SHA-256 hashes of bearer tokens (hsched tokens create/list/revoke)\n"
                 + yaml.safe_dump({"version": VERSION, "tokens": [e.to_yaml() for e in entries]}, sort_keys=False))


def _existing(path: Path) -> list[TokenEntry]:
    return load_tokens(path) if path.exists() else []


def create_token(path: str | os.PathLike, tenant: str = "", role: str = "tenant", name: str = "",
                 expires: dt.datetime | None = None) -> tuple[str, TokenEntry]:
    """Add a new token to the file (created if missing); returns (the token — shown once, stored nowhere —,
    its entry). `name` defaults to `<tenant or role>-<4 hex>`."""
    path = Path(path)
    entries = _existing(path)
    name = name or f"{tenant or role}-{secrets.token_hex(2)}"
    token = new_token()
    raw = {"name": name, "tenant": tenant, "role": role, "sha256": token_hash(token)}
    if expires is not None:
        raw["expires"] = expires
    entry = _entry(len(entries), raw)
    if entry.expired(dt.datetime.now(dt.UTC)):
        raise TokensFileError(f"tokens[{len(entries)}].expires", "must be in the future (a token past it is refused)",
                              entry.expires.strftime("%Y-%m-%dT%H:%M:%SZ"))
    if any(e.name == name for e in entries):
        raise TokensFileError("name", f"a token named {name!r} is already in {path}; revoke it or choose another")
    _write(path, [*entries, entry])
    return token, entry


def revoke_token(path: str | os.PathLike, name: str) -> TokenEntry:
    """Remove the entry `name`; the gateway refuses its token from its next call (it re-reads the file)."""
    path = Path(path)
    entries = _existing(path)
    gone = [e for e in entries if e.name == name]
    if not gone:
        raise TokensFileError("name", f"no token named {name!r} in {path}", None)
    _write(path, [e for e in entries if e.name != name])
    return gone[0]


def list_tokens(path: str | os.PathLike) -> list[TokenEntry]:
    return load_tokens(path)


ADMIN_TOKEN_NAME = "admin"


def ensure_admin_token(state_dir: str | os.PathLike) -> tuple[Path, Path]:
    """`hsched up --auth`: <state_dir>/tokens.yaml holding an admin token whose value is in
    <state_dir>/admin.token (0600). Kept across restarts while both agree; otherwise a new admin token
    replaces the old entry. Returns (tokens file, admin token file)."""
    state = Path(state_dir)
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    tokens, token_file = state / "tokens.yaml", state / "admin.token"
    entries = _existing(tokens)
    if token_file.exists():
        current = TokenTable(entries).match(token_file.read_text().strip())
        if current is not None and current.name == ADMIN_TOKEN_NAME and current.role == "admin":
            return tokens, token_file
    if any(e.name == ADMIN_TOKEN_NAME for e in entries):
        revoke_token(tokens, ADMIN_TOKEN_NAME)
    token, _ = create_token(tokens, role="admin", name=ADMIN_TOKEN_NAME)
    write_private(token_file, token + "\n")
    return tokens, token_file


def read_token_file(path: str | os.PathLike) -> str:
    """The token in a token file (surrounding whitespace removed); TokensFileError naming the file otherwise."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise TokensFileError(str(path), f"cannot read the token file ({exc.strerror or exc})") from None
    if not token or any(c.isspace() for c in token) or not token.isprintable():
        raise TokensFileError(str(path), "must hold one token (hst_...) and nothing else")
    return token
