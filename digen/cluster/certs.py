"""A cluster's own certificate authority and one certificate per node (``digen certs``).

Every digen connection that crosses hosts is mutual TLS: the Dask scheduler, its workers and
clients (``tls://``), and the blob servers of the data plane. Each side shows a certificate
that the cluster's CA signed and checks the other's against that CA, so a process without one
of the cluster's certificates is refused. :func:`make_certs` writes that CA and one
certificate per node name (with the ``cryptography`` library, as Dask's
``Security.temporary()`` does)::

    OUT/ca.pem              the CA certificate (every node gets a copy)
    OUT/ca.key              the CA's private key (0600; keep it here, or offline)
    OUT/NAME/ca.pem         a copy of the CA certificate
    OUT/NAME/cert.pem       NAME's certificate (signed by the CA)
    OUT/NAME/key.pem        NAME's private key (0600)
    OUT/NAME/security.yaml  a ``security:`` section naming the three files (relative paths),
                            for ``digen worker|serve|train --security OUT/NAME/security.yaml``

Every file is 0600 and every folder 0700 (the owner's alone). A node is given its own folder
and nothing else. Running it again with more names reuses
the CA and adds them; a node that already has its files keeps them (they are never
overwritten). Keys are EC P-256; the certificates serve both ends of a connection (server
and client) and name the node (DNS name or IP address) as subject alternative name, though
Dask, like the blob servers, checks the CA's signature rather than host names.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from digen.errors import ConfigError

CA_DAYS = 3650
"""Validity of a new CA; a node's certificate lasts ``days`` (default one year)."""


@dataclass(frozen=True)
class NodeFiles:
    name: str
    folder: Path
    created: bool
    """False: the node had its files already (kept as they were)."""


def _crypto():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise ConfigError("digen certs needs the cryptography package: pip install cryptography") from None
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def check_node_name(name: str) -> str:
    """A node name is a host name or an IP address (it becomes the certificate's SAN and a
    folder name)."""
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    if not name or len(name) > 253 or not all(c.isalnum() or c in "-." for c in name) or name[0] in "-.":
        raise ConfigError(
            f"node name {name!r} must be a host name (letters, digits, '-', '.') or an IP address"
        )
    return name


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a file that only its owner may read or write (0600 from the start;
    every file :func:`make_certs` writes is, the public ones too)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key) -> bytes:
    _, _, serialization, _, _, _ = _crypto()
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert) -> bytes:
    _, _, serialization, _, _, _ = _crypto()
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_usage(x509, *, ca: bool):
    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=ca,
        crl_sign=ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not ca,
        encipher_only=False,
        decipher_only=False,
    )


def _new_ca(out: Path, now: dt.datetime):
    cert, key = _ca(f"digen cluster CA ({out.resolve().name})", now)
    _write_private(out / "ca.pem", _cert_pem(cert))
    _write_private(out / "ca.key", _key_pem(key))
    return cert, key


def _ca(common_name: str, now: dt.datetime):
    """A new self-signed CA (certificate, private key), in memory."""
    x509, hashes, _, ec, _, NameOID = _crypto()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(x509, ca=True), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _load_ca(out: Path):
    x509, _, serialization, _, _, _ = _crypto()
    try:
        cert = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
        key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{out}/ca.pem and ca.key cannot be read as a CA ({type(exc).__name__}: {exc}); "
            f"give digen certs another folder"
        ) from None
    return cert, key


def _node_cert(name: str, ca_cert, ca_key, now: dt.datetime, days: int):
    x509, hashes, _, ec, ExtendedKeyUsageOID, NameOID = _crypto()
    key = ec.generate_private_key(ec.SECP256R1())
    try:
        san = x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        san = x509.DNSName(name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName([san]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(x509, ca=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


SECURITY_YAML = """\
# this node's TLS files (digen certs); digen worker|serve|train --security THIS_FILE
security:
  ca_file: ca.pem
  cert_file: cert.pem
  key_file: key.pem
  require_encryption: true
"""


def make_certs(out: Path, names: list[str], days: int = 365) -> list[NodeFiles]:
    """Make (or reuse) the CA in ``out`` and a certificate for each node of ``names``."""
    if days < 1:
        raise ConfigError(f"--days ({days}) must be at least 1")
    names = [check_node_name(n) for n in names]
    if not names:
        raise ConfigError("give at least one node name: digen certs OUT --hosts head,gpu-node-1")
    out = Path(out)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    have_ca = (out / "ca.pem").exists(), (out / "ca.key").exists()
    if have_ca == (True, False):
        raise ConfigError(
            f"{out}/ca.pem exists without its ca.key: new nodes cannot be signed; use a new folder"
        )
    ca_cert, ca_key = _load_ca(out) if all(have_ca) else _new_ca(out, now)
    made = []
    for name in dict.fromkeys(names):
        folder = out / name
        if (folder / "cert.pem").exists() and (folder / "key.pem").exists():
            made.append(NodeFiles(name, folder, created=False))
            continue
        folder.mkdir(mode=0o700, exist_ok=True)
        cert, key = _node_cert(name, ca_cert, ca_key, now, days)
        _write_private(folder / "key.pem", _key_pem(key))
        _write_private(folder / "cert.pem", _cert_pem(cert))
        _write_private(folder / "ca.pem", _cert_pem(ca_cert))
        _write_private(folder / "security.yaml", SECURITY_YAML.encode())
        made.append(NodeFiles(name, folder, created=True))
    return made


class JobCerts:
    """The embedded cluster's TLS material, made for one job when it starts and removed when it
    ends (:meth:`make`, :meth:`remove`).

    Loopback is no boundary between the users of one machine: a plain Dask scheduler, nanny or
    worker on 127.0.0.1 runs any function that any local process sends it, and a blob server
    there answers anyone who learned the job's key. So the local cluster of a job without a
    ``security:`` section is mutual TLS too, with a CA of its own: a fresh CA signs one
    certificate (``127.0.0.1``) that the controller, the scheduler, every nanny and worker and
    every blob server show, and each checks its peer's against that CA. The CA's private key
    never touches the disk: it signs and is dropped, so nothing can sign another certificate
    the job would accept. The three files live in a new folder of the temporary directory
    (``$TMPDIR``, ``digen-tls-<pid>-*``, 0700), each 0600: only the job's user reads them, and
    the worker processes, the same user, read them when they start. A job killed before it
    could remove them (SIGTERM, SIGKILL) leaves the folder behind, still its user's alone, with
    a key that nothing accepts once the job's processes are gone; the next job of that user
    removes it (:func:`remove_leftovers`: the folders of this user whose pid is not alive).
    """

    def __init__(self, folder: Path):
        self.folder = folder

    @property
    def files(self) -> tuple[str, str, str]:
        """(CA certificate, certificate, private key) file paths."""
        return tuple(str(self.folder / n) for n in ("ca.pem", "cert.pem", "key.pem"))  # type: ignore[return-value]

    def security(self):
        """The files as a ``security:`` section (:class:`digen.config.SecurityConfig`)."""
        from digen.config import SecurityConfig

        ca, cert, key = self.files
        return SecurityConfig(ca_file=ca, cert_file=cert, key_file=key)

    @classmethod
    def make(cls, base: str | None = None) -> JobCerts:
        """A new CA and the job's certificate, written to a new 0700 folder under ``base``
        (default the temporary directory)."""
        import tempfile

        remove_leftovers(Path(base or tempfile.gettempdir()))
        folder = Path(tempfile.mkdtemp(prefix=f"digen-tls-{os.getpid()}-", dir=base))  # 0700, this user's
        try:
            os.chmod(folder, 0o700)
            now = dt.datetime.now(dt.UTC)
            ca_cert, ca_key = _ca(f"digen job CA ({folder.name})", now)
            cert, key = _node_cert("127.0.0.1", ca_cert, ca_key, now, CA_DAYS)
            _write_private(folder / "key.pem", _key_pem(key))
            _write_private(folder / "cert.pem", _cert_pem(cert))
            _write_private(folder / "ca.pem", _cert_pem(ca_cert))
        except BaseException:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
            raise
        return cls(folder)

    def remove(self) -> None:
        """Delete the folder and its files (again: nothing)."""
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def remove_leftovers(base: Path) -> list[Path]:
    """Remove the ``digen-tls-<pid>-*`` folders in ``base`` that this user owns and whose
    process is gone (a job killed before it removed its TLS files); returns them."""
    gone = []
    for folder in base.glob("digen-tls-*-*"):
        pid = folder.name.split("-")[2]
        try:
            if not pid.isdigit() or folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)  # alive (or another user's): kept
        except ProcessLookupError:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
        except OSError:
            continue
    return gone


__all__ = ["JobCerts", "remove_leftovers", "NodeFiles", "check_node_name", "make_certs"]
