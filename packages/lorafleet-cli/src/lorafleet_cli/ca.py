"""A private certificate authority for one `lorafleet up` run (mutual TLS on loopback).

The CA signs one certificate per process and one admin certificate for the CLI, then its
key is dropped: nothing can issue further certificates for the run, and a restarted process
reuses its certificate. A certificate's common name is its role (`lorafleet.rpc.roles`):
`gateway`, or `trainer/trainer-0` for a replica that may register as itself only. Private
keys are written 0600 in a 0700 folder.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from lorafleet.rpc.roles import NAME_SEP

ADMIN_NAME = "lorafleet-admin"
VALIDITY = datetime.timedelta(days=30)


@dataclass(frozen=True)
class CertFiles:
    ca_file: Path
    cert_file: Path
    key_file: Path

    def env(self) -> dict[str, str]:
        """The LORAFLEET_TLS_* variables that give a process this identity."""
        return {
            "LORAFLEET_TLS_CA_FILE": str(self.ca_file),
            "LORAFLEET_TLS_CERT_FILE": str(self.cert_file),
            "LORAFLEET_TLS_KEY_FILE": str(self.key_file),
        }


def write_private(path: Path, data: bytes) -> None:
    """Create `path` readable by its owner only, from the first byte (no chmod race)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "lorafleet"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_run_ca(
    folder: Path, names: list[str], server_names: tuple[str, ...] = ()
) -> dict[str, CertFiles]:
    """Certificates with each of `names` as common name and one for `ADMIN_NAME`, signed by
    a new CA, keyed (and their files named) by the name's last part: `trainer/trainer-0` is
    `trainer-0`.

    Every certificate is valid as a server (for 127.0.0.1, localhost and `server_names`: the
    chart's shared `tls.serverName`, when a test runs the chart's settings) and as a client:
    services present the same one in both roles.
    """
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("lorafleet run CA")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_file = folder / "ca.crt"
    ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    issued = {}
    for name in [*names, ADMIN_NAME]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        *map(x509.DNSName, server_names),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        stem = name.rsplit(NAME_SEP, 1)[-1]
        files = CertFiles(ca_file, folder / f"{stem}.crt", folder / f"{stem}.key")
        files.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_private(files.key_file, _key_pem(key))
        issued[stem] = files
    return issued
