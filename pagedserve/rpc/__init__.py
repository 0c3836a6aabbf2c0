"""The RPC boundary: generated stubs (v1/), pb <-> dataclass conversions, channel options."""

from __future__ import annotations

# A step of thousands of sequences with full histories, or a top-logprobs answer, can pass
# the 4 MiB gRPC default; both sides set the same explicit limit.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# Liveness of a peer comes from HTTP/2 pings, not from call deadlines: a step may run for
# minutes (a long prompt's prefill) while a peer that is gone shows within two pings. The
# servers accept a client's ping this often, with or without a call open.
KEEPALIVE_MS = 10_000
RECONNECT_MS = 2_000

GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.min_time_between_pings_ms", KEEPALIVE_MS // 2),
    # A peer that went away is dialled again at most RECONNECT_MS apart: gRPC's own backoff
    # grows to 120 s, so an executor restarted after a minute went unnoticed for another.
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_MS // 4),
    ("grpc.min_reconnect_backoff_ms", RECONNECT_MS // 4),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MS),
]
