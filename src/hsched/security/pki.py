"""A local certificate authority for hsched's mutual TLS: one CA, one leaf certificate per service and client.

Identities are SPIFFE-style URI SANs in the trust domain `hsched.local` (see `identity_for`):
`spiffe://hsched.local/service/<role>` for gateway, selector, placer, thermal, supervisor (and redis), and
`spiffe://hsched.local/admin/<name>` / `spiffe://hsched.local/tenant/<name>` for clients of the gateway.
Every leaf also carries DNS `localhost` and IP `127.0.0.1` so a server verifies on loopback, and is usable
both as a server and as a client certificate (services dial each other with the same certificate).
Keys are ECDSA P-256 (accepted by grpc's BoringSSL, redis-server's OpenSSL and every other TLS stack).

Directory layout (`init_dir`; directory 0700, keys 0600, certificates 0644):
    D/ca.crt      trust bundle: the current CA first, then any CA kept during a roll-over (`rotate(new_ca=True)`)
    D/ca.key      the current CA's key (signs leaves)
    D/<name>.crt  leaf certificate, D/<name>.key its key, for each name of DEFAULT_NAMES (and `issue` extras)

Every file is written atomically (a temporary file in D, then rename) relative to an open handle of D, and a
path that is a symbolic link is refused, never followed. Errors are `PkiError` with a one-line message.

Stable API (used by hsched.security.tls, the stack, `hsched certs`, and the Redis TLS tests):
    TRUST_DOMAIN, SERVICE_ROLES, DEFAULT_NAMES, PkiError
    identity_for(name) -> str                      the URI SAN the leaf `name` carries
    paths(directory, name) -> (crt_path, key_path)
    ca_paths(directory) -> (crt_path, key_path)
    init_dir(directory, names=DEFAULT_NAMES, *, leaf_days=LEAF_DAYS, force=False) -> Path
    issue(directory, name, *, uri=None, leaf_days=LEAF_DAYS) -> (crt_path, key_path)
    rotate(directory, *, new_ca=False, drop_old_cas=False, leaf_days=LEAF_DAYS) -> list[str]
    leaf_names(directory) -> list[str]; expiring(directory, within: timedelta) -> list[str]
    CertificateAuthority.create(common_name) / .load(directory) / .issue(name, uri=..., not_before=..., not_after=...)
    Leaf(cert_pem, key_pem).write(directory, name)
    uri_sans(cert_pem) -> list[str]
    write_private(directory, filename, data, mode=0o600)
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hsched.domain.task import NAME_RE
from hsched.security import files

TRUST_DOMAIN = "hsched.local"
SERVICE_ROLES = ("gateway", "selector", "placer", "thermal", "supervisor")
# the names `init_dir` issues: the services, the Redis server (also a Redis client cert) and an operator
DEFAULT_NAMES = (*SERVICE_ROLES, "redis", "admin")
CA_DAYS = 3650
LEAF_DAYS = 90
# leaves start a few minutes in the past so a peer whose clock is slightly behind still accepts them
CLOCK_SKEW = dt.timedelta(minutes=5)


class PkiError(Exception):
    """A certificate directory or file that cannot be created, read or trusted (one-line message)."""


class PkiNameError(PkiError):
    """A leaf name or identity URI outside its rule: the caller's input, not the directory's state."""


def identity_for(name: str) -> str:
    """The SPIFFE ID of the leaf called `name`: a service role (or redis) -> service/<name>; "admin" ->
    admin/admin; "tenant-<t>" -> tenant/<t>; "admin-<n>" -> admin/<n>."""
    _check_name(name)
    if name in SERVICE_ROLES or name == "redis":
        return f"spiffe://{TRUST_DOMAIN}/service/{name}"
    if name == "admin":
        return f"spiffe://{TRUST_DOMAIN}/admin/admin"
    for kind in ("tenant", "admin"):
        if name.startswith(f"{kind}-") and len(name) > len(kind) + 1:
            who = name[len(kind) + 1:]
            if not NAME_RE.match(who):  # else the gateway could never map the certificate to a tenant or admin
                raise PkiNameError(f"name {name!r}: {who!r} must be lowercase letters, digits, '.', '_' or '-' (a "
                               "tenant's rule)")
            return f"spiffe://{TRUST_DOMAIN}/{kind}/{who}"
    raise PkiNameError(f"name {name!r}: not a service role ({', '.join(SERVICE_ROLES)}, redis), 'admin', "
                   "'admin-<name>' or 'tenant-<tenant>'; pass uri= to choose the identity")


def _check_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith(".") or name == "ca":
        raise PkiNameError(f"name {name!r}: must be letters, digits, '-', '_' or '.', not start with '.', not 'ca'")


def paths(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    _check_name(name)
    d = Path(directory)
    return d / f"{name}.crt", d / f"{name}.key"


def ca_paths(directory: str | os.PathLike) -> tuple[Path, Path]:
    d = Path(directory)
    return d / "ca.crt", d / "ca.key"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass(frozen=True)
class Leaf:
    """A leaf certificate and its private key, both PEM."""
    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
        """Write D/<name>.key (0600) then D/<name>.crt (0644); returns their paths."""
        crt, key = paths(directory, name)
        write_private(directory, key.name, self.key_pem, 0o600)
        write_private(directory, crt.name, self.cert_pem, 0o644)
        return crt, key


class CertificateAuthority:
    """A CA certificate and key that issue leaf certificates."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey):
        self.cert = cert
        self.key = key

    @classmethod
    def create(cls, common_name: str = "hsched local CA", days: int = CA_DAYS) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hsched"),
                          x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = _now()
        cert = (x509.CertificateBuilder()
                .subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + dt.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return cls(cert, key)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> CertificateAuthority:
        """The current CA of D: the first certificate of ca.crt and ca.key (they must match)."""
        crt_path, key_path = ca_paths(directory)
        bundle = load_bundle(crt_path)
        key_data = read_file(key_path)
        try:
            key = serialization.load_pem_private_key(key_data, password=None)
        except (ValueError, TypeError) as exc:
            raise PkiError(f"{key_path}: not an unencrypted PEM private key ({exc})") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise PkiError(f"{key_path}: expected an EC key, found {type(key).__name__}")
        if key.public_key().public_numbers() != bundle[0].public_key().public_numbers():
            raise PkiError(f"{key_path} does not belong to the first certificate of {crt_path}")
        return cls(bundle[0], key)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str, *, uri: str | None = None, days: int = LEAF_DAYS,
              not_before: dt.datetime | None = None, not_after: dt.datetime | None = None) -> Leaf:
        """A leaf for `name` with URI SAN `uri` (default identity_for(name)), DNS localhost/<name> and IP
        127.0.0.1, valid for server and client authentication. not_before/not_after override the validity
        window (tests issue expired certificates this way)."""
        uri = uri or identity_for(name)
        if not uri.startswith("spiffe://"):
            raise PkiNameError(f"uri {uri!r}: must start with spiffe://")
        key = ec.generate_private_key(ec.SECP256R1())
        start = not_before or (_now() - CLOCK_SKEW)
        end = not_after or (start + CLOCK_SKEW + dt.timedelta(days=days))
        if end <= start:
            raise PkiError(f"validity window of {name!r}: not_after {end} is not after not_before {start}")
        dns = ["localhost"] + ([name] if name != "localhost" else [])
        sans = [x509.UniformResourceIdentifier(uri), *(x509.DNSName(d) for d in dns),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hsched"),
                                         x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                             crl_sign=False, content_commitment=False, data_encipherment=False,
                                             key_agreement=False, encipher_only=False, decipher_only=False),
                               critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                               critical=False)
                .sign(self.key, hashes.SHA256()))
        return Leaf(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


# ---- files ---------------------------------------------------------------------------------------------

def ensure_private_dir(directory: str | os.PathLike, create: bool = True) -> Path:
    """Create D (0700) if missing (unless not `create`); refuse a symlink, a non-directory, another user's
    directory, or one that group/others can access (a key directory must be private)."""
    d = Path(directory)
    try:
        if create:
            d.mkdir(mode=0o700, parents=True)
        st = os.lstat(d)
    except FileExistsError:
        st = os.lstat(d)
    except FileNotFoundError:
        raise PkiError(f"{d}: no such directory (create it with `hsched certs init --dir {d}`)") from None
    except OSError as exc:
        raise PkiError(f"cannot create {d}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise PkiError(f"{d} is a symbolic link; refusing to use it as a key directory")
    if not stat.S_ISDIR(st.st_mode):
        raise PkiError(f"{d} is not a directory")
    if st.st_uid != os.getuid():
        raise PkiError(f"{d} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        raise PkiError(f"{d} has mode {stat.S_IMODE(st.st_mode):04o}; a key directory must be private (chmod 700)")
    return d


def write_private(directory: str | os.PathLike, filename: str, data: bytes, mode: int = 0o600) -> Path:
    """Atomically replace D/filename with `data` (mode `mode`) in the private directory D
    (`hsched.security.files.write_private`). A symbolic link at D/filename, or D being one, is refused."""
    d = ensure_private_dir(directory)
    if "/" in filename or filename in ("", ".", ".."):
        raise PkiError(f"file name {filename!r}: must be a plain name inside {d}")
    target = d / filename
    if target.is_symlink():
        raise PkiError(f"{target} is a symbolic link; refusing to write through it")
    try:
        return files.write_private(target, data, mode, follow_dir=False)
    except OSError as exc:
        raise PkiError(f"cannot write {target}: {exc.strerror}") from None


def read_file(path: str | os.PathLike) -> bytes:
    """Read a certificate or key file without following a symbolic link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise PkiError(f"{path}: no such file (create the directory with `hsched certs init --dir DIR`)") from None
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the final component is a symlink
            raise PkiError(f"{path} is a symbolic link; refusing to read through it") from None
        raise PkiError(f"cannot read {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def load_bundle(path: str | os.PathLike) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(read_file(path))
    except ValueError as exc:
        raise PkiError(f"{path}: not PEM certificates ({exc})") from None
    return certs


def uri_sans(cert_pem: bytes) -> list[str]:
    """The URI SANs of the (first) certificate in cert_pem."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return ext.value.get_values_for_type(x509.UniformResourceIdentifier)


def _bundle_pem(certs: Iterable[x509.Certificate]) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


# ---- operations (hsched certs init|issue|rotate) ------------------------------------------------------------

def init_dir(directory: str | os.PathLike, names: Iterable[str] = DEFAULT_NAMES, *,
             leaf_days: int = LEAF_DAYS, force: bool = False) -> Path:
    """A new CA in D and a leaf for each name. An existing CA is an error unless force (which replaces it:
    every certificate it signed stops being trusted)."""
    d = ensure_private_dir(directory)
    if ca_paths(d)[0].exists() and not force:
        raise PkiError(f"{d} already holds a CA (ca.crt); use `rotate` to re-issue, or force to replace it")
    ca = CertificateAuthority.create()
    names = list(names)
    for name in names:
        _check_name(name)
    write_private(d, "ca.key", _key_pem(ca.key), 0o600)
    write_private(d, "ca.crt", ca.cert_pem, 0o644)
    for name in names:
        ca.issue(name, days=leaf_days).write(d, name)
    return d


def issue(directory: str | os.PathLike, name: str, *, uri: str | None = None,
          leaf_days: int = LEAF_DAYS) -> tuple[Path, Path]:
    """Issue (or re-issue) the leaf `name` in D with D's current CA."""
    d = ensure_private_dir(directory, create=False)
    return CertificateAuthority.load(d).issue(name, uri=uri, days=leaf_days).write(d, name)


def leaf_names(directory: str | os.PathLike) -> list[str]:
    """The names of D's leaves (every <name>.crt with a <name>.key, except the CA)."""
    d = Path(directory)
    return sorted(p.stem for p in d.glob("*.crt")
                  if p.stem != "ca" and not p.name.startswith(".") and (d / f"{p.stem}.key").exists())


def expiring(directory: str | os.PathLike, within: dt.timedelta) -> list[str]:
    """The leaves of D whose certificate expires within `within` from now (or already has)."""
    limit = _now() + within
    return [name for name in leaf_names(directory)
            if load_bundle(paths(directory, name)[0])[0].not_valid_after_utc <= limit]


def rotate(directory: str | os.PathLike, *, new_ca: bool = False, drop_old_cas: bool = False,
           leaf_days: int = LEAF_DAYS) -> list[str]:
    """Re-issue every leaf of D (same names, same identities, new keys), each replaced atomically.

    new_ca: first create a new CA; ca.crt becomes [new CA, previous CAs...] so peers still holding leaves
    of the old CA keep being trusted during the roll-over. drop_old_cas: ca.crt keeps only the current CA
    (run once every service has picked up its new leaf). Returns the re-issued names."""
    d = ensure_private_dir(directory, create=False)
    current = CertificateAuthority.load(d)
    bundle = load_bundle(ca_paths(d)[0])
    if new_ca:
        current = CertificateAuthority.create()
        write_private(d, "ca.key", _key_pem(current.key), 0o600)
        bundle = [current.cert, *bundle]
    if drop_old_cas:
        bundle = [current.cert]
    # the trust bundle first, so a peer that sees a new leaf can already verify it
    write_private(d, "ca.crt", _bundle_pem(bundle), 0o644)
    names = leaf_names(d)
    for name in names:
        uris = uri_sans(paths(d, name)[0].read_bytes())
        current.issue(name, uri=uris[0] if uris else None, days=leaf_days).write(d, name)
    return names
