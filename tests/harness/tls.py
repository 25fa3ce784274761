"""Throw-away TLS certificates for test brokers: a CA, a server and a client certificate.

Made with the ``openssl`` command line (Debian's ``openssl`` package), valid
for two days, for ``127.0.0.1`` and ``localhost`` only.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ("Certificates", "make_certificates")


@dataclass(frozen=True)
class Certificates:
    """Paths of the PEM files: the CA, the server's and a client's certificate and key."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("'openssl' not found: run `make setup` (Debian package openssl)")
    done = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr[-2000:]}")


def make_certificates(directory: Path, *, name: str = "celery-fair test") -> Certificates:
    """A CA and two certificates it signed, written to ``directory`` (created if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    days = "2"
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", days, "-subj", f"/CN={name} CA", cwd=directory,
    )  # fmt: skip
    (directory / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    (directory / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who in ("server", "client"):
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out", f"{who}.csr",
            "-subj", f"/CN={name} {who}", cwd=directory,
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{who}.crt", "-days", days, "-extfile", f"{who}.ext",
            cwd=directory,
        )  # fmt: skip
    for key in ("server.key", "client.key"):
        (directory / key).chmod(0o644)  # a broker started as another user reads it too
    return Certificates(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )
