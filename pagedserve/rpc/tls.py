"""gRPC credentials from TlsOptions: for a server's port, and for a channel to an executor."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc

from pagedserve.settings import TlsOptions

ChannelOptions = Sequence[tuple[str, int | str]]


def server_credentials(tls: TlsOptions, require_client_cert: bool) -> grpc.ServerCredentials | None:
    """The credentials a gRPC port is served with (None: plaintext); ``require_client_cert``
    refuses every client without a certificate signed by ``tls.tls_ca``."""
    if require_client_cert and (tls.tls_cert is None or tls.tls_ca is None):
        raise ValueError("client certificates (--tls-ca) need --tls-cert and --tls-key")
    if tls.tls_cert is None or tls.tls_key is None:
        return None
    return grpc.ssl_server_credentials(
        [(_read(tls.tls_key), _read(tls.tls_cert))],
        root_certificates=_read(tls.tls_ca) if require_client_cert else None,
        require_client_auth=require_client_cert,
    )


def add_port(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None
) -> int:
    """Listen on ``address`` with ``credentials`` (None: plaintext); returns the bound port."""
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def executor_channel(address: str, tls: TlsOptions | None, options: ChannelOptions) -> grpc.Channel:
    """A blocking channel to the executor at ``address``: over TLS when ``tls`` has a
    certificate or a CA (the certificate, if any, presented as the client's)."""
    if tls is None or not tls.dials_tls:
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(tls.tls_ca) if tls.tls_ca else None,
        private_key=_read(tls.tls_key) if tls.tls_key else None,
        certificate_chain=_read(tls.tls_cert) if tls.tls_cert else None,
    )
    if tls.tls_server_name:
        options = [*options, ("grpc.ssl_target_name_override", tls.tls_server_name)]
    return grpc.secure_channel(address, credentials, options=options)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()
