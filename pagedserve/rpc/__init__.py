"""The RPC boundary: generated stubs (v1/), pb <-> dataclass conversions, channel options."""

from __future__ import annotations

# A step of thousands of sequences with full histories, or a top-logprobs answer, can pass
# the 4 MiB gRPC default; both sides set the same explicit limit.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
