"""How the `ray` backend is configured: the cluster, restarts, placement, per-component actor options, TLS.

Checked when a deployment's config is built, so a wrong option fails `deploy()` before anything
starts. Imports nothing of Ray.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from patchkit.errors import ConfigError

if TYPE_CHECKING:
    import grpc  # loaded by the front-end that dials the workers, not by the config that names this module's options

__all__ = ["ACTOR_OPTIONS", "ACTOR_RESOURCES", "WORKER_SERVER_NAME", "RayOptions", "TlsFiles"]

# The name a per-deployment certificate is issued to: the front-end checks it instead of the worker's address,
# which is not known when the certificate is made (Ray places the actors afterwards).
WORKER_SERVER_NAME = "patchkit-worker"
CERTIFICATE_DAYS = 3650  # a deployment's own certificate, trusted by that deployment only, outlives the deployment

# What `ray_actor_options` may set per component, as Ray Serve's option of the same name: they override
# what the plan asks for (num_cpus, num_gpus) and add what it does not know (memory, custom resources). The
# resources a replica asks for, which `GET /v1/plan` shows, then its environment, which it never shows.
ACTOR_RESOURCES = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type")
ACTOR_OPTIONS = (*ACTOR_RESOURCES, "runtime_env")


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes read from the files the config names; the worker's certificate and key travel to its actor."""

    certificate: bytes
    key: bytes
    root: bytes  # what the front-end trusts: the CA's certificate, else the worker certificate itself
    server_name: str | None

    def channel_credentials(self) -> tuple[grpc.ChannelCredentials, list[tuple[str, Any]]]:
        """The front-end's credentials and channel options for a worker's address (an IP the certificate may not name)."""
        import grpc

        options: list[tuple[str, Any]] = []
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.ssl_channel_credentials(root_certificates=self.root), options

    @classmethod
    def self_signed(cls) -> TlsFiles:
        """A new certificate and key for one deployment's workers, issued to `WORKER_SERVER_NAME` and trusted
        by that deployment's front-end only (it is its own root). Made by the front-end, which keeps the key
        in memory; the certificate and key travel to the actors in their bootstrap, through Ray."""
        try:
            from cryptography import x509
            from cryptography.hazmat.primitives import hashes, serialization
            from cryptography.hazmat.primitives.asymmetric import ec
            from cryptography.x509.oid import NameOID
        except ImportError:
            raise ConfigError(
                "TLS to the Ray workers needs a certificate: install the cryptography package (pip install -e "
                "'.[ray]' in patchkit's checkout) to have one made, or pass tls_cert= and tls_key=, or tls=False to "
                "send in plaintext"
            ) from None

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, WORKER_SERVER_NAME)])
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))  # nodes' clocks differ
            .not_valid_after(now + datetime.timedelta(days=CERTIFICATE_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(WORKER_SERVER_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        certificate_pem = certificate.public_bytes(serialization.Encoding.PEM)
        return cls(certificate_pem, key_pem, certificate_pem, WORKER_SERVER_NAME)


@dataclass(frozen=True)
class RayOptions:
    """The `ray_*` and `tls_*` fields of a deployment's config.

    address: the cluster (`"auto"`, `"HOST:PORT"`, `"ray://HOST:10001"`); None: the one `RAY_ADDRESS`
        names, else a local Ray instance started for the deployment.
    max_restarts: times Ray restarts a dead replica's actor in place; past that the backend starts a new actor.
    placement_timeout_s: how long a replica may wait for the cluster's resources before its start
        fails with an error naming what is missing (Ray itself would queue it forever).
    actor_options: by component name, Ray actor options (`ACTOR_OPTIONS`) that override the plan's.
    tls: TLS between the front-end and the workers (True, the default: the workers listen beyond
        loopback); False turns it off, and then no tls_* option may be given.
    tls_cert, tls_key: PEM files of the workers' certificate and key (both or neither); without them
        each deployment makes a self-signed certificate of its own (`TlsFiles.self_signed`). tls_ca:
        the CA that signed it (default: trust the certificate itself). tls_server_name: the name the
        certificate was issued to, when it is not the worker's IP.
    """

    address: str | None = None
    max_restarts: int = 3
    placement_timeout_s: float = 60.0
    actor_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    tls: bool = True
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < -1:
            raise ConfigError(f"ray_max_restarts must be an int >= 0 (or -1: without end); got {self.max_restarts!r}")
        if not (isinstance(self.placement_timeout_s, (int, float)) and math.isfinite(self.placement_timeout_s)
                and self.placement_timeout_s > 0):
            raise ConfigError(f"ray_placement_timeout_s must be a number of seconds > 0; got {self.placement_timeout_s!r}")
        if self.address is not None and not (isinstance(self.address, str) and self.address.strip()):
            raise ConfigError(f"ray_address must be a cluster address such as 'auto' or 'HOST:6379'; got {self.address!r}")
        self._check_actor_options()
        self._check_tls()

    def _check_actor_options(self) -> None:
        if not isinstance(self.actor_options, Mapping):
            raise ConfigError(f"ray_actor_options must map component names to Ray actor options; got {self.actor_options!r}")
        for name, options in self.actor_options.items():
            if not isinstance(options, Mapping):
                raise ConfigError(f"ray_actor_options[{name!r}] must be a dict such as {{'num_gpus': 0.5}}; got {options!r}")
            for key, value in options.items():
                if key not in ACTOR_OPTIONS:
                    raise ConfigError(f"ray_actor_options[{name!r}] sets {key!r}; it may set {', '.join(ACTOR_OPTIONS)}")
                if key in ("num_cpus", "num_gpus", "memory") and (
                    isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
                ):
                    raise ConfigError(f"ray_actor_options[{name!r}][{key!r}] must be a number >= 0; got {value!r}")
                if key == "resources" and not (
                    isinstance(value, Mapping) and all(isinstance(v, (int, float)) and v >= 0 for v in value.values())
                ):
                    raise ConfigError(f"ray_actor_options[{name!r}]['resources'] must map resource names to amounts >= 0; "
                                     f"got {value!r}")

    def _check_tls(self) -> None:
        if not isinstance(self.tls, bool):
            raise ConfigError(f"tls must be True or False; got {self.tls!r}")
        if not self.tls:
            given = [f"{name}={getattr(self, name)!r}" for name in ("tls_cert", "tls_key", "tls_ca", "tls_server_name")
                     if getattr(self, name) is not None]
            if given:
                raise ConfigError(f"tls=False turns TLS off, but {', '.join(given)} {'asks' if len(given) == 1 else 'ask'} "
                                  "for it: drop one or the other")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(f"tls_cert ({self.tls_cert!r}) and tls_key ({self.tls_key!r}) go together: give both or neither")
        if self.tls_cert is None and (self.tls_ca is not None or self.tls_server_name is not None):
            raise ConfigError("tls_ca and tls_server_name need tls_cert and tls_key")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{name} names {path!r}, which is not a readable file")

    def tls_files(self) -> TlsFiles | None:
        """The TLS files' contents, read on the front-end's machine; a new self-signed certificate when none
        is given; None with `tls=False`. Called once per deployment by the ray backend."""
        if not self.tls:
            return None
        if self.tls_cert is None or self.tls_key is None:
            return TlsFiles.self_signed()
        certificate = Path(self.tls_cert).read_bytes()
        root = Path(self.tls_ca).read_bytes() if self.tls_ca else certificate
        return TlsFiles(certificate, Path(self.tls_key).read_bytes(), root, self.tls_server_name)
