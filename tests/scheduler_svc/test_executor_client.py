"""The scheduler's executor client against an executor of another API revision."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagedserve.rpc.convert import EXECUTOR_PROTOCOL
from pagedserve.rpc.v1 import executor_pb2 as pb
from pagedserve.rpc.v1 import executor_pb2_grpc as pb_grpc
from scheduler_svc.engine.executor_client import ExecutorClient, ExecutorIncompatible


class _Unnumbered(pb_grpc.ExecutorServicer):
    """What an executor from before API revisions answers: no ``protocol``."""

    def InitCache(
        self, request: pb.InitCacheRequest, context: grpc.ServicerContext
    ) -> pb.InitCacheResponse:
        return pb.InitCacheResponse(
            model="m", vocab_size=32, max_model_len=64, block_size=16, num_gpu_blocks=8
        )


@pytest.fixture
def unnumbered() -> Iterator[str]:
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    pb_grpc.add_ExecutorServicer_to_server(_Unnumbered(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_an_executor_of_another_revision_is_refused_by_name(unnumbered: str) -> None:
    """Each side drops the fields it does not know unread (a call sent ahead's sequences,
    in columns since revision 1), so its steps would run without them: refused at once."""
    with ExecutorClient(unnumbered) as client, pytest.raises(ExecutorIncompatible) as refused:
        client.init_cache()
    assert str(refused.value) == (
        f"executor {unnumbered} speaks revision 0 of the executor API, this scheduler "
        f"{EXECUTOR_PROTOCOL}: run one pagedserve version on both"
    )
