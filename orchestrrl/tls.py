"""TLS and mutual TLS for every OrchestrRL channel.

A daemon either runs with mutual TLS (its certificate and key, and the CA that signs
its peers) or, only when asked explicitly with ``--plaintext``, without encryption for
local development. With mTLS, a peer whose certificate the CA did not sign fails the
handshake; a peer with a valid certificate is then authorized by its identity (the
certificate's common name or a DNS subject alternative name).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from orchestrrl import errors


@dataclass(frozen=True)
class TlsConfig:
    cert: Path
    key: Path
    ca: Path

    def _read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key),
                           ("--tls-ca", self.ca)):  # fmt: skip
            try:
                out.append(path.read_bytes())
            except OSError as exc:
                raise errors.field_error(
                    flag, str(path), f"a readable PEM file ({exc.strerror})"
                ) from None
        return out[0], out[1], out[2]

    def server_credentials(self) -> Any:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )

    def channel_credentials(self) -> Any:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security (mutual TLS, or --plaintext for local development)")
    g.add_argument("--tls-cert", type=Path, metavar="PEM", help="this daemon's certificate")
    g.add_argument("--tls-key", type=Path, metavar="PEM", help="its private key")
    g.add_argument("--tls-ca", type=Path, metavar="PEM", help="the CA that signs every peer")
    g.add_argument(
        "--plaintext",
        action="store_true",
        help="no TLS at all: only for local development on a trusted host",
    )


def from_args(args: argparse.Namespace, required: bool = True) -> TlsConfig | None:
    """The TLS config of the flags; None for --plaintext (or, when not ``required``,
    when no flag is given). Raises InvalidArgument naming what is missing."""
    given: dict[str, Path | None] = {
        k: getattr(args, k, None) for k in ("tls_cert", "tls_key", "tls_ca")
    }
    if getattr(args, "plaintext", False):
        if any(given.values()):
            raise errors.InvalidArgument("--plaintext cannot be combined with --tls-* flags")
        return None
    if not any(given.values()) and not required:
        return None
    if not any(given.values()):
        raise errors.InvalidArgument(
            "no TLS configured: pass --tls-cert, --tls-key and --tls-ca (mutual TLS), "
            "or --plaintext for local development"
        )
    cert, key, ca = given["tls_cert"], given["tls_key"], given["tls_ca"]
    if cert is None or key is None or ca is None:
        missing = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is None]
        raise errors.InvalidArgument(
            f"TLS needs {', '.join(missing)} as well (all of --tls-cert, --tls-key, --tls-ca), "
            "or --plaintext for local development"
        )
    cfg = TlsConfig(cert, key, ca)
    cfg._read()  # fail now, with the flag's name, rather than at the first connection
    return cfg


# The node a command is meant for, sent by the controller (and by an agent following a
# request on another agent) with every call to an agent. The agent refuses a command meant
# for another node: without TLS this is what binds an agent address to a node (with TLS
# the handshake does, see ``server_name``).
NODE_METADATA = "x-orl-node"


def addressed_to(node: str) -> tuple[tuple[str, str], ...]:
    """The call metadata naming the node a call to an agent is meant for."""
    return ((NODE_METADATA, node),)


def check_addressee(context: Any, node: str) -> None:
    """Refuse a call meant for another node (FailedPrecondition naming both): a controller
    that registered this agent's address under another node's name. A call without the
    metadata (orlctl, tools) is accepted."""
    for key, value in context.invocation_metadata() or ():
        if key == NODE_METADATA and value != node:
            raise errors.FailedPrecondition(
                f"this agent is node {node!r}, the call is meant for node "
                f"{errors.shown(value, 128)}: the caller has the wrong address for that node "
                "(it registered this agent's address); nothing was done"
            )


def peer_identities(context: Any) -> frozenset[str] | None:
    """Identities of an mTLS peer (common name and DNS SANs); None without TLS."""
    auth = context.auth_context()
    if not auth.get("transport_security_type"):
        return None
    names = [*auth.get("x509_common_name", []), *auth.get("x509_subject_alternative_name", [])]
    return frozenset(n.decode() if isinstance(n, bytes) else str(n) for n in names)


class Authorizer:
    """Who may call what, by certificate identity. Without TLS everything is allowed
    (plaintext is for local development only)."""

    def __init__(self, tls: TlsConfig | None, operators: frozenset[str] = frozenset()) -> None:
        self.enabled = tls is not None
        self.operators = operators

    def _identities(self, context: Any) -> frozenset[str]:
        ids = peer_identities(context)
        if ids is None:
            raise errors.Unauthenticated("this server requires mutual TLS")
        return ids

    def operator(self, context: Any) -> None:
        if not self.enabled:
            return
        ids = self._identities(context)
        if not ids & self.operators:
            allowed = ", ".join(sorted(self.operators)) or "none configured (--operator NAME)"
            raise errors.PermissionDenied(
                f"certificate {'/'.join(sorted(ids))} is not an operator; operators: {allowed}"
            )

    def node(self, context: Any, node: str) -> None:
        """An agent may speak only for the node its certificate names."""
        if not self.enabled:
            return
        ids = self._identities(context)
        if node not in ids:
            raise errors.PermissionDenied(
                f"certificate {'/'.join(sorted(ids))} may not act for node {node!r}"
            )

    def peer(self, context: Any, allowed: frozenset[str]) -> None:
        """Only the named identities (e.g. the controller) may call."""
        if not self.enabled:
            return
        ids = self._identities(context)
        if not ids & allowed:
            raise errors.PermissionDenied(
                f"certificate {'/'.join(sorted(ids))} may not call this service "
                f"(allowed: {', '.join(sorted(allowed))})"
            )
