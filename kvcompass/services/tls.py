"""TLS for every hop of the discovery plane: SSL contexts built from PEM files.

One :class:`TLSConfig` (the ``--tls-cert``, ``--tls-key``, ``--tls-ca`` and
``--tls-client-auth`` flags of every subcommand) gives both sides of a hop:

* :meth:`TLSConfig.server_context` for grpclib servers (``Server.start(ssl=...)``, ALPN ``h2``)
  and aiohttp sites (``SockSite(ssl_context=...)``, ALPN ``http/1.1``). With ``client_auth``
  the server asks for a client certificate and refuses a handshake without one that ``ca``
  signed (mutual TLS).
* :meth:`TLSConfig.client_context` for grpclib channels and aiohttp connectors: the peer is
  verified against ``ca`` (the system trust store when None) with hostname checking, and
  ``cert``/``key`` are presented when given (what a mutual-TLS server requires).

Every file is checked when the context is built, so a wrong path or a key that belongs to
another certificate fails at startup with a message naming the file, never at the first
handshake. Both sides require TLS 1.2 or later.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Literal

from grpclib.client import Channel

from kvcompass.errors import InvalidArgumentError

__all__ = ["GRPC_ALPN", "HTTP_ALPN", "CertFiles", "TLSConfig", "ThrowawayCA", "grpc_channel", "scheme"]

GRPC_ALPN = ("h2",)
HTTP_ALPN = ("http/1.1",)
Protocol = Literal["grpc", "http"]


def _alpn(proto: Protocol) -> list[str]:
    return list(GRPC_ALPN if proto == "grpc" else HTTP_ALPN)


def _need_file(path: str, what: str) -> str:
    if not os.path.exists(path):
        raise InvalidArgumentError(f"TLS {what} file {path} does not exist")
    if not os.path.isfile(path):
        raise InvalidArgumentError(f"TLS {what} path {path} is not a file")
    if not os.access(path, os.R_OK):
        raise InvalidArgumentError(f"TLS {what} file {path} is not readable")
    return path


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str | None) -> None:
    _need_file(cert, "certificate")
    if key is not None:
        _need_file(key, "private key")
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        reason = getattr(e, "reason", None) or ""
        if "KEY_VALUES_MISMATCH" in reason or "key values mismatch" in str(e):
            raise InvalidArgumentError(f"TLS private key {key or cert} does not match the certificate in {cert}") from None
        raise InvalidArgumentError(f"TLS certificate {cert} / key {key or cert}: not a PEM certificate chain and private key ({e})") from None


def _load_ca(ctx: ssl.SSLContext, ca: str) -> None:
    _need_file(ca, "CA")
    try:
        ctx.load_verify_locations(cafile=ca)
    except ssl.SSLError as e:
        raise InvalidArgumentError(f"TLS CA file {ca} holds no usable PEM certificate ({e})") from None
    if not ctx.get_ca_certs():
        raise InvalidArgumentError(f"TLS CA file {ca} holds no CA certificate")


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """Certificate, key and CA files (PEM) of one process; see the module doc."""

    cert: str | None = None
    """This process's certificate chain: a server's (required to serve TLS) or a client's
    (presented to mutual-TLS servers)."""
    key: str | None = None
    """The private key of ``cert`` (None: it is in the ``cert`` file)."""
    ca: str | None = None
    """The CA bundle peers are verified against: server certificates for clients (None: the
    system trust store), client certificates for servers with ``client_auth``."""
    client_auth: bool = False
    """Servers: require a client certificate signed by ``ca`` (mutual TLS)."""

    def __post_init__(self) -> None:
        if self.key is not None and self.cert is None:
            raise InvalidArgumentError("--tls-key given without --tls-cert")
        if self.client_auth and self.ca is None:
            raise InvalidArgumentError("--tls-client-auth needs --tls-ca: the CA that signs the client certificates")

    @property
    def enabled(self) -> bool:
        """Whether this process speaks TLS at all (any file given)."""
        return self.cert is not None or self.ca is not None

    def server_context(self, proto: Protocol = "grpc") -> ssl.SSLContext:
        """The context a server listens with (``proto`` picks the ALPN protocol)."""
        if self.cert is None:
            raise InvalidArgumentError("serving TLS needs --tls-cert (and --tls-key unless the key is in the same file)")
        # Not create_default_context: that would also trust the system CAs for client certificates.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_chain(ctx, self.cert, self.key)
        if self.ca is not None:
            _load_ca(ctx, self.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if self.client_auth else ssl.CERT_NONE
        ctx.set_alpn_protocols(_alpn(proto))
        return ctx

    def client_context(self, proto: Protocol = "grpc") -> ssl.SSLContext:
        """The context a client connects with: verifies the server, presents ``cert`` if any."""
        if self.ca is not None:
            # Only the given CA: a private plane's peers must not be vouched for by a public CA.
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies certificates and hostnames
            _load_ca(ctx, self.ca)
        else:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert is not None:
            _load_chain(ctx, self.cert, self.key)
        ctx.set_alpn_protocols(_alpn(proto))
        return ctx

    def server_or_none(self, proto: Protocol = "grpc") -> ssl.SSLContext | None:
        return self.server_context(proto) if self.enabled else None

    def client_or_none(self, proto: Protocol = "grpc") -> ssl.SSLContext | None:
        return self.client_context(proto) if self.enabled else None


def grpc_channel(target: str, ssl_context: ssl.SSLContext | None = None) -> Channel:
    """A grpclib channel to ``host:port`` (``[v6]:port`` too), over TLS when ``ssl_context``."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidArgumentError(f"{target!r} is not HOST:PORT")
    return Channel(host.strip("[]"), int(port), ssl=ssl_context)


def scheme(ssl_context: ssl.SSLContext | None) -> str:
    """``https`` when a server listens with ``ssl_context``, else ``http``."""
    return "https" if ssl_context is not None else "http"


# -- throwaway certificates (``kvcompass up --tls`` and the tests) ------------------------------


@dataclass(frozen=True, slots=True)
class CertFiles:
    """A PEM certificate and its private key on disk."""

    cert: str
    key: str


@dataclass(frozen=True, slots=True)
class ThrowawayCA:
    """A CA made on the spot (EC P-256, valid for two days) that issues certificates good for
    both ends of a TLS hop (``serverAuth`` and ``clientAuth``). Made with the ``cryptography``
    package when it is installed, else with the ``openssl`` command; never for production."""

    cert: str
    key: str
    directory: str

    @classmethod
    def create(cls, directory: str | os.PathLike[str], name: str = "kvcompass throwaway CA") -> ThrowawayCA:
        d = os.fspath(directory)
        os.makedirs(d, mode=0o700, exist_ok=True)
        cert, key = os.path.join(d, "ca.pem"), os.path.join(d, "ca.key")
        if _have_cryptography():
            _crypto_ca(name, cert, key)
        else:
            _openssl(["req", "-x509", *_EC, "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
                      "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
        os.chmod(key, 0o600)
        return cls(cert, key, d)

    def issue(self, name: str, hosts: tuple[str, ...] = ("127.0.0.1", "localhost", "::1")) -> CertFiles:
        """A certificate for ``hosts`` (IP addresses or DNS names) signed by this CA."""
        cert, key = os.path.join(self.directory, f"{name}.pem"), os.path.join(self.directory, f"{name}.key")
        if _have_cryptography():
            _crypto_leaf(self, name, hosts, cert, key)
        else:
            csr, ext = os.path.join(self.directory, f"{name}.csr"), os.path.join(self.directory, f"{name}.ext")
            sans = ",".join(f"IP:{h}" if _is_ip(h) else f"DNS:{h}" for h in hosts)
            with open(ext, "w") as f:
                f.write(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=critical,CA:FALSE\n"
                        "keyUsage=critical,digitalSignature\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
            _openssl(["req", "-new", *_EC, "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={name}"])
            _openssl(["x509", "-req", "-in", csr, "-CA", self.cert, "-CAkey", self.key, "-set_serial", str(int.from_bytes(os.urandom(8), "big") >> 1),
                      "-days", "2", "-out", cert, "-extfile", ext])
            os.unlink(csr)
            os.unlink(ext)
        os.chmod(key, 0o600)
        return CertFiles(cert, key)


_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")


def _have_cryptography() -> bool:
    import importlib.util

    return importlib.util.find_spec("cryptography") is not None


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _openssl(args: list[str]) -> None:
    import shutil
    import subprocess

    exe = shutil.which("openssl")
    if exe is None:
        raise InvalidArgumentError("making throwaway certificates needs the cryptography package or the openssl command; neither is installed")
    r = subprocess.run([exe, *args], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise InvalidArgumentError(f"openssl {args[0]} failed: {r.stderr.strip()}")


def _crypto_ca(name: str, cert_path: str, key_path: str) -> None:  # pragma: no cover - one of two backends
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False, key_agreement=False,
                          key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_pem(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    _write_pem(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def _crypto_leaf(ca: ThrowawayCA, name: str, hosts: tuple[str, ...], cert_path: str, key_path: str) -> None:  # pragma: no cover - one of two backends
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    with open(ca.cert, "rb") as f:
        ca_cert = x509.load_pem_x509_certificate(f.read())
    with open(ca.key, "rb") as f:
        ca_key = serialization.load_pem_private_key(f.read(), None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise InvalidArgumentError(f"{ca.key}: not the EC key of a throwaway CA")
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h) for h in hosts]
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_pem(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    _write_pem(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def _write_pem(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
