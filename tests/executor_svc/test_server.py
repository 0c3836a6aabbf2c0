"""The executor service as a real process over loopback gRPC, driven by ExecutorClient."""

from __future__ import annotations

import dataclasses
import math
import random
import signal
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pagedserve.grammar import Grammar
from pagedserve.model_files import load_tokenizer
from pagedserve.model_info import ModelInfo
from pagedserve.rpc import GRPC_OPTIONS
from pagedserve.rpc.convert import EXECUTOR_PROTOCOL, step_to_pb
from pagedserve.rpc.v1 import executor_pb2 as pb
from pagedserve.rpc.v1 import executor_pb2_grpc as pb_grpc
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import CacheConfig, ExecutorConfig, SchedulerConfig
from pagedserve.step import ExecuteStep, SeqStep, StepResult
from scheduler_svc.core.sequence import Sequence, SequenceGroup
from scheduler_svc.engine import engine as engine_module
from scheduler_svc.engine.detokenizer import Detokenizer
from scheduler_svc.engine.engine import LLMEngine, StepExecutor, StepOutcome
from scheduler_svc.engine.executor_client import ExecutorClient, StepRefused
from scheduler_svc.engine.lanes import Lane, Move, NewRequest
from scheduler_svc.state.journal import Journal
from scheduler_svc.state.persistence import group_from_json
from scheduler_svc.state.state_store import InMemoryStateStore, StepCommit
from scheduler_svc.state.streams import RequestDelta
from tests.executor_svc.executor_proc import (
    NUM_GPU_BLOCKS,
    SWAP_GIB,
    Server,
    start_executor,
    stop_executor,
)

MAX_UINT64 = 2**64 - 1  # the widest epoch and step id on the wire


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One executor for the module, pools allocated and SERVING; killed at the end."""
    server = start_executor(tiny_model_dir, tmp_path_factory.mktemp("executor") / "executor.log")
    try:
        server.client.init_cache()
        server.client.wait_ready(timeout=30)
        yield server
    finally:
        stop_executor(server)


def _step(step_id: int, epoch: int, **seq_fields: object) -> ExecuteStep:
    """One prefill of 3 tokens into block 0, sampled at temperature 1 (a rerun would
    almost surely draw differently), with ``seq_fields`` overriding the sequence."""
    fields = dict(
        seq_id=0,
        new_token_ids=[5, 6, 7],
        num_computed_tokens=0,
        block_table=[0],
        sampling_params=SamplingParams(temperature=1.0, logprobs=3),
        num_samples=4,
    )
    fields.update(seq_fields)
    return ExecuteStep(step_id, epoch, [SeqStep(**fields)])


def _generate(executor: StepExecutor, info: ModelInfo, epoch: int) -> list:
    """Greedy and seeded parallel-sampling requests (forks, copy-on-write) to the end."""
    cache = CacheConfig(
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
    )
    # 16 tokens a step: the longer prompts go in chunks, the first ones drawing nothing.
    sched = SchedulerConfig(max_model_len=info.max_model_len, max_num_batched_tokens=16)
    engine = LLMEngine(executor, cache, sched, info.eos_token_id)
    engine.epoch = epoch
    rng = random.Random(0)
    prompts = [[rng.randrange(3, info.vocab_size) for _ in range(n)] for n in (5, 17, 33, 40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    groups = [
        engine.add_request(str(i), prompt, greedy if i % 2 else sampled, arrival_time=i)
        for i, prompt in enumerate(prompts)
    ]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.num_prompt_chunks > 0
    return [
        [(s.output_token_ids, s.cumulative_logprob, s.output_top_logprobs) for s in g.outputs()]
        for g in groups
    ]


def test_health_init_cache_and_sigterm(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = start_executor(tiny_model_dir, tmp_path / "executor.log")
    try:
        client = server.client
        assert client.health() == "NOT_SERVING"
        with pytest.raises(StepRefused) as refused:
            client.execute(_step(0, MAX_UINT64))
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        info = client.init_cache()
        client.wait_ready(timeout=10)
        assert client.health() == "SERVING"
        assert (info.num_gpu_blocks, info.vocab_size, info.block_size) == (64, 512, 16)
        assert info.num_cpu_blocks > 0 and info.instance_id
        assert client.init_cache() == info  # a repeat keeps the pools
        assert client.get_stats().epoch == 0  # the refused step fenced no one
        client.execute(_step(0, 0))
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=10) == 0, server.log_path.read_text()
    finally:
        stop_executor(server)


def test_engine_over_grpc_matches_in_process(server: Server, tiny_model_dir: Path) -> None:
    from executor_svc.executor import Executor

    info = server.client.init_cache()
    before = server.client.get_stats()
    remote = _generate(server.client, info, server.next_epoch())
    assert server.client.get_stats().num_blocks_copied > before.num_blocks_copied  # CoW ran
    config = ExecutorConfig(
        model=str(tiny_model_dir), device="cpu", num_gpu_blocks=NUM_GPU_BLOCKS, swap_space=SWAP_GIB
    )
    local_executor = Executor(config)
    local_info = local_executor.init_cache()
    assert dataclasses.replace(local_info, instance_id=info.instance_id) == info
    local = _generate(local_executor, local_info, epoch=0)
    for got, want in zip(remote, local, strict=True):
        assert [tokens for tokens, _, _ in got] == [tokens for tokens, _, _ in want]
        assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-4)
    assert remote[1][0][2] and len(remote[1][0][2]) == 24  # top logprobs travelled


def test_replay_is_answered_from_the_stored_result(server: Server) -> None:
    client = server.client
    epoch = server.next_epoch()
    step = _step(10, epoch)
    first = client.execute(step)
    before = client.get_stats()
    assert client.execute(step) == first
    # A restarted scheduler (newer epoch) replaying its pending step gets the lost result,
    # and the step becomes the newer epoch's last: an older id is out of order there.
    newer = server.next_epoch()
    assert client.execute(dataclasses.replace(step, epoch=newer)) == first
    with pytest.raises(StepRefused, match="out of order"):
        client.execute(_step(9, newer))
    after = client.get_stats()
    assert after.num_steps == before.num_steps and after.last_step_id == 10
    assert after.num_replayed_steps == before.num_replayed_steps + 2
    assert client.execute(_step(11, after.epoch)) != first  # the next step is applied
    assert client.get_stats().num_steps == before.num_steps + 1


def test_stats_split_the_time_of_applied_calls(server: Server) -> None:
    """Reading a call, the executor's own work around its step and the step itself follow
    one another for a call waited for: together less than the calls' wall time, each some.
    A replay is not counted (no step ran)."""
    client = server.client
    epoch = server.next_epoch()
    before = client.get_stats()
    start = time.perf_counter()
    for step_id in range(30, 35):
        client.execute(_step(step_id, epoch))
    wall = time.perf_counter() - start
    after = client.get_stats()
    read = after.total_read_seconds - before.total_read_seconds
    own = after.total_overhead_seconds - before.total_overhead_seconds
    busy = after.total_step_seconds - before.total_step_seconds
    assert read > 0 and own > 0 and busy > 0
    assert read + own + busy < wall
    client.execute(_step(34, epoch))  # a replay
    replayed = client.get_stats()
    assert replayed.total_overhead_seconds == after.total_overhead_seconds
    assert replayed.total_read_seconds == after.total_read_seconds


def test_a_fence_refuses_older_epochs_and_names_the_last_step(server: Server) -> None:
    client = server.client
    old = server.next_epoch()
    client.execute(_step(20, old))
    sent = client.start(_step(21, old))  # the old leader's step, journaled or not
    assert len(sent().outputs) == 1
    new = server.next_epoch()
    assert client.fence(new) == 21  # the successor learns the executor ran it
    before = client.get_stats()
    assert before.epoch == new
    with pytest.raises(StepRefused, match="older than the newest"):
        client.execute(_step(22, old))
    with pytest.raises(StepRefused, match="older than the newest"):
        client.fence(old)
    assert client.get_stats() == before


@pytest.mark.parametrize(
    ("step_id", "epoch_delta", "why"),
    [(12, -1, "older than the newest"), (4, 0, "out of order"), (5, 0, "different content")],
)
def test_stale_steps_are_refused(server: Server, step_id: int, epoch_delta: int, why: str) -> None:
    client = server.client
    epoch = server.next_epoch()
    client.execute(_step(5, epoch))
    before = client.get_stats()
    stale = _step(step_id, epoch + epoch_delta, new_token_ids=[9, 9])
    with pytest.raises(StepRefused, match=why) as refused:
        client.execute(stale)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert client.get_stats() == before


MAX_LEN = 1024  # the tiny model's max_position_embeddings


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"block_table": [NUM_GPU_BLOCKS]}, "seqs[0].block_table[0]"),
        ({"block_table": [-1]}, "seqs[0].block_table[0]"),
        ({"new_token_ids": [5, 512]}, "seqs[0].new_token_ids[1]"),
        ({"new_token_ids": [-3]}, "seqs[0].new_token_ids[0]"),
        ({"num_computed_tokens": -1}, "seqs[0].num_computed_tokens"),
        ({"new_token_ids": list(range(20))}, "seqs[0].block_table"),
        ({"num_computed_tokens": MAX_LEN - 1, "block_table": [0] * 65}, "max_model_len"),
        ({"num_samples": 0, "num_steps": 2}, "seqs[0].num_steps"),  # a chunk draws nothing
        ({"num_steps": 2}, "seqs[0].num_steps"),  # steps in a row of four samples each
        ({"num_samples": 1, "num_steps": 15}, "seqs[0].block_table"),  # 17 positions
        (
            {"num_samples": 1, "num_steps": 3, "num_computed_tokens": MAX_LEN - 4},
            "max_model_len",
        ),
        ({"blocks_to_copy": [(0, NUM_GPU_BLOCKS)]}, "blocks_to_copy[0].dst"),
        ({"blocks_to_swap_in": [(10**6, 0)]}, "blocks_to_swap_in[0].src"),
    ],
)
def test_invalid_steps_are_refused(server: Server, overrides: dict, field: str) -> None:
    client = server.client
    epoch = server.next_epoch()
    step_fields = {k: overrides.pop(k) for k in list(overrides) if k.startswith("blocks_")}
    bad = dataclasses.replace(_step(0, epoch, **overrides), **step_fields)
    bad.blocks_to_swap_out = bad.blocks_to_swap_out or [(1, 0)]  # valid: must not run
    before = client.get_stats()
    with pytest.raises(StepRefused) as refused:
        client.execute(bad)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in refused.value.message
    assert client.get_stats() == before  # epoch, ledger and pools untouched
    assert len(client.execute(_step(0, epoch, seq_id=epoch)).outputs[0].token_ids) == 4
    assert client.get_stats().num_steps == before.num_steps + 1  # applied, not a replay


def _send(server: Server, request: pb.ExecuteRequest) -> grpc.StatusCode:
    """Send a request as any client may, past the checks of our dataclasses; returns the
    status it was refused with."""
    channel = grpc.insecure_channel(server.client.address, options=GRPC_OPTIONS)
    with channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.ExecutorStub(channel).Execute(request, timeout=30)
    return refused.value.code()


def _nan_top_p(request: pb.ExecuteRequest) -> None:
    request.sampling_params[0].top_p = float("nan")  # SamplingParams refuses it


def _long_grammar_kind(request: pb.ExecuteRequest) -> None:
    # The fuzzer's find: a refusal quoting it all outgrew the status's metadata.
    request.sampling_params[0].grammar.kind = "x" * 100_000


@pytest.mark.parametrize("epoch", [2**63 - 1, MAX_UINT64])
def test_a_refused_call_fences_no_one(server: Server, epoch: int) -> None:
    client = server.client
    legit = server.next_epoch()
    client.execute(_step(1, legit))
    before = client.get_stats()
    bad_table = step_to_pb(_step(2, epoch, block_table=[-1]))
    bad_params = step_to_pb(_step(2, epoch))
    _nan_top_p(bad_params)
    for request in (bad_table, bad_params):
        assert _send(server, request) == grpc.StatusCode.INVALID_ARGUMENT
        assert client.get_stats() == before  # epoch, last step id and counters
    assert len(client.execute(_step(2, legit)).outputs[0].token_ids) == 4
    after = client.get_stats()
    assert (after.epoch, after.last_step_id, after.num_steps) == (legit, 2, before.num_steps + 1)


Corrupt = Callable[[pb.ExecuteRequest], None]


def _set(**values: object) -> Corrupt:
    """Set fields of the first sequence, or of its sampling parameters when named so."""

    def corrupt(request: pb.ExecuteRequest) -> None:
        seq = request.seqs[0]
        for name, value in values.items():
            target = seq if hasattr(pb.SequenceStep(), name) else request.sampling_params[0]
            setattr(target, name, value)

    return corrupt


def _extend(field: str, values: list[int]) -> Corrupt:
    return lambda request: getattr(request.seqs[0], field).extend(values)


def _clear(field: str) -> Corrupt:
    return lambda request: request.seqs[0].ClearField(field)


def _seqs_beyond_the_pool(request: pb.ExecuteRequest) -> None:
    """One more single-token sequence than the pool has slots."""
    seq = request.seqs[0]
    del seq.new_token_ids[1:]
    for seq_id in range(1, NUM_GPU_BLOCKS * 16 + 1):
        request.seqs.add().CopyFrom(seq)
        request.seqs[-1].seq_id = seq_id


def _duplicate_seq(request: pb.ExecuteRequest) -> None:
    request.seqs.add().CopyFrom(request.seqs[0])


CORRUPTIONS: dict[str, Corrupt] = {
    "num_samples_uint32_max": _set(num_samples=2**32 - 1),
    "num_samples_past_pool": _set(num_samples=NUM_GPU_BLOCKS + 1),
    "num_steps_uint32_max": _set(num_steps=2**32 - 1),
    "num_computed_tokens_int32_max": _set(num_computed_tokens=2**31 - 1),
    "new_token_id_int32_max": _extend("new_token_ids", [2**31 - 1]),
    "no_new_tokens": _clear("new_token_ids"),
    "no_block_table": _clear("block_table"),
    "block_table_past_max_model_len": _extend("block_table", [0] * MAX_LEN),
    "prompt_past_max_model_len": _extend("prompt_token_ids", [5] * (MAX_LEN + 1)),
    "negative_output_token": _extend("output_token_ids", [-1]),
    "copy_from_negative_block": lambda r: r.blocks_to_copy.add(src=-1, dst=0),
    "swap_out_to_int32_max": lambda r: r.blocks_to_swap_out.add(src=0, dst=2**31 - 1),
    "seqs_past_pool_slots": _seqs_beyond_the_pool,
    "duplicate_seq_id": _duplicate_seq,  # the fuzzer's first find: outputs are keyed by it
    "no_sampling_params": lambda r: r.ClearField("sampling_params"),
    "sampling_params_index_past_them": _set(sampling_params_index=1),
    "top_p_nan": _nan_top_p,
    "grammar_kind_of_100_kb": _long_grammar_kind,
    "temperature_inf": _set(temperature=float("inf")),
    "temperature_nan": _set(temperature=float("nan")),
    "min_p_minus_inf": _set(min_p=float("-inf")),
    "repetition_penalty_zero": _set(repetition_penalty=0.0),
    "presence_penalty_nan": _set(presence_penalty=float("nan")),
    "frequency_penalty_minus_inf": _set(frequency_penalty=float("-inf")),
    "length_penalty_inf": _set(length_penalty=float("inf")),
    "top_k_zero": _set(top_k=0),
    "n_zero": _set(n=0),
    "best_of_below_n": _set(best_of=0),
    "max_tokens_zero": _set(max_tokens=0),
    "beams_at_temperature_1": _set(use_beam_search=True),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=list(CORRUPTIONS))
def test_any_field_value_is_refused_as_invalid(server: Server, corrupt: Corrupt) -> None:
    """Whatever a client puts in a request: refused as its mistake, nothing changed."""
    client = server.client
    request = step_to_pb(_step(0, 2**63 - 1, num_samples=1))
    corrupt(request)
    before = client.get_stats()
    assert _send(server, request) == grpc.StatusCode.INVALID_ARGUMENT
    assert client.get_stats() == before


def test_outputs_come_in_request_order_with_a_refused_grammar_in_its_place(
    server: Server,
) -> None:
    """The tiny model has no tokenizer, so its grammar is refused; the fuzzer found the
    refused sequence's output moved to the end."""
    epoch = server.next_epoch()
    refused = SamplingParams(temperature=0.0, grammar=Grammar("regex", "[a-z]+"))
    seqs = [
        SeqStep(3, [5], 0, [1], SamplingParams(temperature=0.0)),
        SeqStep(1, [6], 0, [2], refused),
        SeqStep(2, [7], 0, [3], SamplingParams(temperature=0.0)),
    ]
    outputs = server.client.execute(ExecuteStep(0, epoch, seqs)).outputs
    assert [o.seq_id for o in outputs] == [3, 1, 2]
    assert [bool(o.error) for o in outputs] == [False, True, False]


def test_extreme_valid_values_are_applied(server: Server) -> None:
    extreme = SamplingParams(temperature=1.0, top_k=2**31 - 1, seed=-(2**63), logprobs=2**32 - 1)
    seq_fields = dict(seq_id=-(2**63), sample_index=2**32 - 1, sampling_params=extreme)
    step = _step(MAX_UINT64, server.next_epoch(), **seq_fields)
    (output,) = server.client.execute(step).outputs
    assert output.seq_id == -(2**63) and len(output.token_ids) == 4
    assert len(output.top_logprobs[0]) == 512  # the whole vocabulary
    assert server.client.get_stats().last_step_id == MAX_UINT64


def test_copy_and_swap_blocks_count(server: Server) -> None:
    client = server.client
    before = client.get_stats()
    assert client.copy_blocks([(1, 2), (3, 4)]) == 2
    assert client.swap_blocks([(2, 0), (4, 1)], [(0, 5)]) == (2, 1)
    after = client.get_stats()
    assert after.num_blocks_copied == before.num_blocks_copied + 2
    assert after.num_blocks_swapped_out == before.num_blocks_swapped_out + 2
    assert after.num_blocks_swapped_in == before.num_blocks_swapped_in + 1
    with pytest.raises(StepRefused, match=r"blocks_to_swap_in\[0\].dst"):
        client.swap_blocks([], [(0, NUM_GPU_BLOCKS)])
    assert client.get_stats() == after


def test_end_steps_arrives_though_the_caller_keeps_no_future(server: Server) -> None:
    """The engine asks and goes on without the call's future. gRPC cancels a call whose
    future is collected, often before it leaves, so the client holds it until answered:
    otherwise the newcomer waited for every decode step of the calls in flight."""
    client = server.client
    epoch = server.next_epoch()
    client.execute(_step(10, epoch, num_samples=1))  # the epoch the asks are for
    # A cancelled call still leaves now and then: ask ten times, each must end its call.
    for step_id in range(11, 21):
        asked = weakref.ref(client.end_steps(step_id))  # dropped at once, as the engine does
        deadline = time.monotonic() + 30
        while (call := asked()) is not None and not call.done() and time.monotonic() < deadline:
            del call  # held only by the client: let go once answered (or cancelled)
            time.sleep(0.01)
        cut = client.execute(_step(step_id, epoch, num_samples=1, num_steps=8))
        assert len(cut.outputs[0].token_ids) == 1, f"ask {step_id - 10} of 10 was lost"


def test_end_steps_stops_a_call_of_decode_steps_in_a_row(server: Server) -> None:
    """EndSteps names the newest step to end: sent before it runs (as an arrival can be),
    that step stops after its first decode step, and so does every earlier one still to
    run (a call sent ahead); a later step runs whole, and an older name asked late does
    not undo a newer one."""
    client = server.client
    epoch = server.next_epoch()
    greedy = SamplingParams(temperature=0.0)
    whole = client.execute(_step(0, epoch, num_samples=1, num_steps=8, sampling_params=greedy))
    client.end_steps(0).result()
    assert (
        len(client.execute(_step(1, epoch, num_samples=1, num_steps=8)).outputs[0].token_ids) == 8
    )
    client.end_steps(2).result()
    client.end_steps(1).result()  # an older arrival's ask, delivered late, ends no less
    cut = client.execute(_step(2, epoch, num_samples=1, num_steps=8, sampling_params=greedy))
    assert cut.outputs[0].token_ids == whole.outputs[0].token_ids[:1]


def _follower(step_id: int, epoch: int, after: int, **seq_fields: object) -> ExecuteStep:
    """One decode of seq 0 that goes on from step ``after``: the executor fills in the
    token and the position."""
    fields = dict(
        new_token_ids=[],
        num_samples=1,
        follows=True,
        sampling_params=SamplingParams(temperature=0.0),
    )
    step = _step(step_id, epoch, **(fields | seq_fields))
    return dataclasses.replace(step, follows_step_id=after)


def test_the_executor_names_the_api_revision_it_speaks(server: Server) -> None:
    with grpc.insecure_channel(server.client.address) as channel:
        answer = pb_grpc.ExecutorStub(channel).InitCache(pb.InitCacheRequest(), timeout=30)
    assert answer.protocol == EXECUTOR_PROTOCOL
    assert server.client.init_cache().instance_id == answer.instance_id  # accepted


@pytest.mark.parametrize("table_start", [0, 1])
def test_a_step_that_follows_equals_the_step_spelled_out(server: Server, table_start: int) -> None:
    """Sent before the answer it follows was read (async scheduling), a step draws what
    the same step with the token and position written out draws; a step of several
    decodes in a row is followed from its last token. With ``table_start`` 1 the wire
    carries no table entry: the executor takes block 0 from the step followed."""
    client = server.client
    epoch = server.next_epoch()
    greedy = SamplingParams(temperature=0.0)
    first = _step(0, epoch, num_samples=1, num_steps=3, sampling_params=greedy)
    drawn = client.execute(first).outputs[0].token_ids
    spelled = _step(
        1,
        epoch,
        new_token_ids=drawn[-1:],
        num_computed_tokens=3 + len(drawn) - 1,
        num_samples=1,
        num_steps=2,
        sampling_params=greedy,
    )
    want = client.execute(spelled).outputs[0].token_ids
    client.execute(dataclasses.replace(first, step_id=2))
    follower = _follower(3, epoch, after=2, num_steps=2, table_start=table_start)
    assert list(step_to_pb(follower).followers.table_lengths) == [1 - table_start]
    got = client.execute(follower)
    assert got.outputs[0].token_ids == want


@pytest.mark.parametrize(
    ("follows", "seq_fields", "code", "why"),
    [
        (4, {}, grpc.StatusCode.FAILED_PRECONDITION, "follows step 4 .* last applied is step 5"),
        (None, {}, grpc.StatusCode.INVALID_ARGUMENT, "no follows_step_id"),
        (5, {"seq_id": 9}, grpc.StatusCode.INVALID_ARGUMENT, "drew no token for seq 9"),
        (5, {"table_start": 2}, grpc.StatusCode.INVALID_ARGUMENT, "2 entries kept of a table of 1"),
        (  # the entries kept were checked with the step followed, the new ones are now
            5,
            {"table_start": 1, "block_table": [0, NUM_GPU_BLOCKS]},
            grpc.StatusCode.INVALID_ARGUMENT,
            rf"block_table\[1\]: block id {NUM_GPU_BLOCKS} outside",
        ),
        (
            5,
            {"follows": False, "table_start": 1},
            grpc.StatusCode.INVALID_ARGUMENT,
            "table_start: only a sequence that follows",
        ),
    ],
)
def test_a_step_that_cannot_follow_is_refused(
    server: Server, follows: int | None, seq_fields: dict, code: grpc.StatusCode, why: str
) -> None:
    client = server.client
    epoch = server.next_epoch()
    client.execute(_step(4, epoch, num_samples=1))
    client.execute(_step(5, epoch, num_samples=1))
    before = client.get_stats()
    step = dataclasses.replace(_follower(6, epoch, after=0, **seq_fields), follows_step_id=follows)
    with pytest.raises(StepRefused, match=why) as refused:
        client.execute(step)
    assert refused.value.code == code
    assert client.get_stats() == before


def test_the_steps_before_the_last_are_answered_again(server: Server) -> None:
    """A scheduler with three calls on the wire (two sent ahead) may resend all three
    after the connection drops: the executor keeps the last three results, and refuses
    a step older than those."""
    client = server.client
    epoch = server.next_epoch()
    client.execute(_step(6, epoch))
    answers = [client.execute(_step(step_id, epoch)) for step_id in (7, 8, 9)]
    before = client.get_stats()
    assert [client.execute(_step(step_id, epoch)) for step_id in (7, 8, 9)] == answers
    after = client.get_stats()
    assert after.num_steps == before.num_steps
    assert after.num_replayed_steps == before.num_replayed_steps + 3
    with pytest.raises(StepRefused, match="out of order"):
        client.execute(_step(6, epoch))


def _arrivals(
    executor: StepExecutor,
    info: ModelInfo,
    epoch: int,
    num_decode_steps: int,
    journal: Journal | None = None,
    commit_interval_s: float = 0.0,
    outcomes: list[StepOutcome] | None = None,
    on_engine: Callable[[LLMEngine], None] | None = None,
    **scheduling: float,
) -> tuple[list, LLMEngine]:
    """Greedy and seeded requests, each arriving after a step of those before it, to the
    end; their tokens and cumulative logprobs, and the engine. Each step's outcome goes
    to ``outcomes``, the engine to ``on_engine`` before its first step; ``scheduling``:
    more SchedulerConfig fields."""
    cache = CacheConfig(
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
    )
    sched = SchedulerConfig(
        max_model_len=info.max_model_len,
        num_decode_steps=num_decode_steps,
        commit_interval_s=commit_interval_s,
        **scheduling,
    )
    engine = LLMEngine(executor, cache, sched, info.eos_token_id, journal=journal)
    if journal is None:
        engine.epoch = epoch
    else:
        engine.recover(journal.store.begin_epoch(epoch))
    if on_engine is not None:
        on_engine(engine)
    steps = outcomes if outcomes is not None else []
    rng = random.Random(1)
    groups = []
    for i in range(6):
        prompt = [rng.randrange(3, info.vocab_size) for _ in range(3 + 7 * i)]
        params = SamplingParams(
            temperature=0.0 if i % 2 else 0.9,
            seed=None if i % 2 else 11 + i,
            max_tokens=9 + 5 * i,
            ignore_eos=True,
            logprobs=1,
        )
        groups.append(engine.add_request(str(i), prompt, params))
        steps.append(engine.step())  # the next request arrives while these run
    while engine.has_unfinished():
        steps.append(engine.step())
    engine.flush()
    return [(s.output_token_ids, s.cumulative_logprob) for g in groups for s in g.seqs], engine


@pytest.mark.parametrize("deep_share", [math.inf, 0.0], ids=["two-on-the-wire", "three"])
@pytest.mark.parametrize("num_decode_steps", [1, 4])
def test_async_scheduling_over_grpc_matches_in_process(
    server: Server,
    tiny_model_dir: Path,
    num_decode_steps: int,
    deep_share: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Calls sent ahead (each decode following the call before it, requests arriving
    while others decode and ending by length at different steps) draw what one call at a
    time in process draws: greedy and seeded tokens, and their logprobs. So do three
    calls on the wire (the second sent ahead follows the first before either answered),
    what an accelerator's fast steps get."""
    from executor_svc.executor import Executor

    monkeypatch.setattr(engine_module, "DEEP_AHEAD_SHARE", deep_share)
    info = server.client.init_cache()
    recorded = _Recorded(server.client)
    outcomes = _InFlight(recorded)
    remote, engine = _arrivals(
        recorded, info, server.next_epoch(), num_decode_steps, outcomes=outcomes
    )
    assert engine.async_scheduling and engine.stats.num_steps_ahead > 0
    assert max(outcomes.in_flight) == (2 if deep_share else 3)
    followers = [s for step in recorded.steps for s in step.seqs if s.follows]
    # The wire left out the entries of the tables followed, and carried the blocks added.
    assert followers and all(s.table_start > 0 for s in followers)
    assert any(len(s.block_table) > s.table_start for s in followers)
    local_executor = Executor(
        ExecutorConfig(
            model=str(tiny_model_dir),
            device="cpu",
            num_gpu_blocks=NUM_GPU_BLOCKS,
            swap_space=SWAP_GIB,
        )
    )
    local_info = local_executor.init_cache()
    local, local_engine = _arrivals(local_executor, local_info, 0, num_decode_steps)
    assert not local_engine.async_scheduling
    assert [tokens for tokens, _ in remote] == [tokens for tokens, _ in local]
    assert [lp for _, lp in remote] == pytest.approx([lp for _, lp in local], abs=1e-4)
    assert not engine.scheduler.block_manager.block_tables


def test_a_step_sends_the_call_after_the_one_in_flight_before_it_returns(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once N is applied, the step sends N+2 (following N+1, which runs) before the text,
    the events and the commit: the engine's loop between two steps is off the path from
    N's answer to N+2 on the wire, and a step returns with two calls in flight (a CPU's
    steps: the engine's own time is a small share of its wait)."""
    monkeypatch.setattr(engine_module, "DEEP_AHEAD_SHARE", math.inf)
    info = server.client.init_cache()
    recorded = _Recorded(server.client)
    outcomes = _InFlight(recorded)
    _, engine = _arrivals(recorded, info, server.next_epoch(), 1, outcomes=outcomes)
    assert engine.stats.num_steps_ahead > 0
    assert max(outcomes.in_flight) == 2
    assert outcomes.in_flight.count(2) > len(outcomes) // 2


@pytest.mark.parametrize("deep_share", [math.inf, 0.0], ids=["two-on-the-wire", "three"])
def test_a_request_arriving_during_a_step_joins_the_call_the_next_step_sends(
    server: Server, deep_share: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request routed to the lane while a step waits (the lane calls ``end_steps``)
    keeps that step from sending a call early: the next step sends it once the lane has
    added the newcomer, which then waits one call less. With three calls on the wire,
    the two sent before the wait stay."""
    monkeypatch.setattr(engine_module, "DEEP_AHEAD_SHARE", deep_share)
    ahead = 1 if deep_share else 2  # calls on the wire after a step with an arrival
    info = server.client.init_cache()
    recorded = _ArrivingWhileWaiting(server.client, every=3)
    outcomes = _InFlight(recorded)
    recorded.outcomes = outcomes
    _arrivals(recorded, info, server.next_epoch(), 1, outcomes=outcomes, on_engine=recorded.watch)
    arrived = set(recorded.arrived_in)
    assert arrived and all(outcomes.in_flight[i] <= ahead for i in arrived)
    assert ahead + 1 in [n for i, n in enumerate(outcomes.in_flight) if i not in arrived]


class _InFlight(list):
    """Outcomes, and the calls sent but not yet applied as each step returned (a step
    applies one call)."""

    def __init__(self, recorded: _Recorded) -> None:
        super().__init__()
        self.recorded = recorded
        self.in_flight: list[int] = []

    def append(self, outcome: StepOutcome) -> None:
        super().append(outcome)
        self.in_flight.append(len(self.recorded.steps) - len(self))


class _CountedStore(InMemoryStateStore):
    def __init__(self) -> None:
        super().__init__()
        self.num_commits = 0

    def commit(self, commit: StepCommit) -> bool:
        self.num_commits += 1
        return super().commit(commit)


def test_calls_that_only_continue_streams_share_a_commit(server: Server) -> None:
    """With a commit interval longer than the run, calls sent ahead are committed only
    where a request starts or ends: the others' tokens wait for a later commit, durable
    once it lands, in one event a request per commit (numbered 1, 2, ... as stored, the
    same events published), and the tokens are those of a commit after every call."""
    info = server.client.init_cache()
    runs = {}
    for interval in (0.0, 60.0):
        store, outcomes = _CountedStore(), _TokensCounted()
        tokens, engine = _arrivals(
            server.client, info, server.next_epoch(), 1, Journal(store), interval, outcomes
        )
        assert engine.stats.num_steps_ahead > 0
        assert all(o.durable is None or o.durable.result(timeout=0) is None for o in outcomes)
        assert not store.load().groups  # every request ended, and the store knows it
        events = [store.read_events(str(i)) for i in range(6)]
        runs[interval] = tokens, events, store.num_commits, len(outcomes), outcomes
    every, events, num_every, num_calls, _ = runs[0.0]
    shared, kept, num_shared, _, steps = runs[60.0]
    assert [t for t, _ in shared] == [t for t, _ in every]
    assert [_stream(e) for e in kept] == [_stream(e) for e in events]  # nothing lost
    assert sum(map(len, kept)) < sum(map(len, events))  # calls sharing a commit, an event
    assert num_shared < num_every and num_every >= num_calls
    # What clients get live: each request's events in order, once each, as stored.
    published = {}
    for outcome in steps:
        for d in outcome.deltas:
            published.setdefault(d.request_id, []).append((d.event, d.to_json()))
    assert [published[str(i)] for i in range(6)] == kept
    # The metrics' tokens: those of every event, counted as its step returns.
    assert [steps.counted[str(i)] for i in range(6)] == [len(t) for t, _ in shared]


@pytest.mark.parametrize("ahead_lost", [False, True])
def test_a_first_token_commits_only_its_group_and_a_new_leader_from_there_loses_nothing(
    server: Server, smollm2_dir: Path, ahead_lost: bool
) -> None:
    """Within the commit interval a newcomer's first token is committed with its group
    alone: the groups that only went on stay behind in the store, their tokens in no
    event yet. A leader killed right then and its successor leave every request's
    events numbered 1, 2, ... without a gap or a repeat, and the tokens of a run that
    no one killed. With ``ahead_lost`` the calls sent ahead of the one that committed
    never reach the executor (lost with the leader), so the successor finds it not past
    the journal: nothing is recomputed, and each group goes on from its own stored
    tokens (those left behind feed their last stored token again, over positions the
    executor had computed)."""
    tokenizer = load_tokenizer(smollm2_dir)
    streams = {}
    for killed in (False, True):
        executor = _LostAfterPrompt(server.client, lose=killed and ahead_lost)
        lane, store = _lane_sharing_commits(server, tokenizer, ("a", "b"), executor)
        _steps_sharing_a_commit(lane)
        executor.armed = True
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        lane.incoming.append(NewRequest("c", [9, 10, 11], params, time.time()))
        for _ in range(20):  # the step whose commit publishes c's first token
            if any(d.request_id == "c" for d in lane.step()[0].deltas):
                break
        else:
            pytest.fail("the newcomer's first token never came")
        lane.engine.journal.settle()
        stored = {r: group_from_json(t).group for r, t in store.load().groups.items()}
        live = {g.request_id: g for g in lane.engine.scheduler.running}
        assert stored["c"].seqs[0].output_token_ids == live["c"].seqs[0].output_token_ids
        for request_id in ("a", "b"):  # behind: their last calls wait for the interval
            behind = len(live[request_id].seqs[0].output_token_ids)
            assert len(stored[request_id].seqs[0].output_token_ids) < behind
        if killed:  # the leader is gone; the next one takes its journal over
            lane = Lane("executor", _engine_on(server, tokenizer, store))
        if killed and ahead_lost:
            assert executor.lost  # the calls sent ahead of the commit's
            last_step_id = server.client.get_stats().last_step_id
            assert last_step_id == int(store.load().meta["step_id"]) == executor.prompt_step
            assert sorted(g.request_id for g in lane.engine.scheduler.running) == ["a", "b", "c"]
        while lane.engine.has_unfinished():
            lane.step()
        lane.engine.flush()
        streams[killed] = {r: _stream(store.read_events(r))[:2] for r in ("a", "b", "c")}
        assert [len(streams[killed][r][0]) for r in ("a", "b", "c")] == [200, 200, 40]
    assert streams[True] == streams[False]


def test_a_request_ending_between_steps_first_gets_what_calls_sharing_a_commit_drew(
    server: Server, smollm2_dir: Path
) -> None:
    """Calls that share a commit leave their groups' text and events to it. A request
    aborted (through its lane, as the API does) or past its deadline between two steps
    first gets them: its events, published and stored alike, carry every token it drew
    and their text, then its end."""
    tokenizer = load_tokenizer(smollm2_dir)
    lane, store = _lane_sharing_commits(server, tokenizer, ("aborted", "late"))
    engine = lane.engine
    outcomes = _steps_sharing_a_commit(lane)
    groups = {g.request_id: g for g in engine.scheduler.running}
    lane.aborts.append("aborted")
    outcomes.append(lane.step()[0])  # commits at once: the abort's event
    outcomes += _steps_sharing_a_commit(lane)
    late, deltas = engine.expire(groups["late"].arrival_time + 7200.0)
    assert late == [groups["late"]]
    outcomes.append(StepOutcome(deltas=deltas))
    outcomes.append(StepOutcome(deltas=engine.flush()))
    for request_id, group in groups.items():
        events = _told_alike(store, outcomes, request_id, group, tokenizer)
        assert RequestDelta.from_json(events[-1][1]).finished
    assert RequestDelta.from_json(store.read_events("late")[-1][1]).error_code == (
        "deadline_exceeded"
    )


def test_groups_leaving_a_lane_first_get_what_calls_sharing_a_commit_drew(
    server: Server, smollm2_dir: Path
) -> None:
    """A lane that retires (its executor gone) after calls that shared a commit makes
    their events before its groups move: published and stored alike, every token drawn
    here and its text, and each moving group counts them."""
    tokenizer = load_tokenizer(smollm2_dir)
    lane, store = _lane_sharing_commits(server, tokenizer, ("a", "b"))
    outcomes = _steps_sharing_a_commit(lane)
    groups = {g.request_id: g.seqs[0].output_token_ids[:] for g in lane.engine.scheduler.running}
    lane.retiring = True
    outcome, moved = lane.step()
    outcomes.append(outcome)
    assert sorted(m.group.request_id for m in moved) == sorted(groups)
    for move in moved:
        events = _told_alike(store, outcomes, move.group.request_id, move.group, tokenizer)
        assert move.num_events == len(events)
        assert move.group.seqs[0].output_token_ids == groups[move.group.request_id]


def test_a_group_moving_in_after_calls_sharing_a_commit_leaves_each_event_stored_once(
    server: Server, smollm2_dir: Path
) -> None:
    """A group arriving from another lane is committed at once (flush), which first makes
    the events the lane's calls that shared a commit owed: published and stored once
    each, every token and its text, and the newcomer runs on."""
    tokenizer = load_tokenizer(smollm2_dir)
    lane, store = _lane_sharing_commits(server, tokenizer, ("a", "b"))
    outcomes = _steps_sharing_a_commit(lane)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    newcomer = SequenceGroup("moved", [Sequence(10_000, [8, 9, 10])], time.time(), params)
    lane.arriving.append(Move(newcomer, 0, "elsewhere"))
    outcomes += [lane.step()[0] for _ in range(4)]
    outcomes.append(StepOutcome(deltas=lane.engine.flush()))
    assert newcomer.seqs[0].output_token_ids
    for group in lane.engine.scheduler.running:
        if group.request_id != "moved":
            _told_alike(store, outcomes, group.request_id, group, tokenizer)


def _lane_sharing_commits(
    server: Server,
    tokenizer: Any,
    request_ids: tuple[str, ...],
    executor: StepExecutor | None = None,
) -> tuple[Lane, InMemoryStateStore]:
    """A lane whose calls share commits for a minute, ``request_ids`` queued to it (greedy,
    200 tokens each, a deadline an hour away), and its store; through ``executor`` (the
    gRPC client)."""
    store = InMemoryStateStore()
    lane = Lane("executor", _engine_on(server, tokenizer, store, executor))
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, timeout=3600.0)
    for request_id in request_ids:
        lane.incoming.append(NewRequest(request_id, [5, 6, 7], params, time.time()))
    return lane, store


def _engine_on(
    server: Server,
    tokenizer: Any,
    store: InMemoryStateStore,
    executor: StepExecutor | None = None,
) -> LLMEngine:
    """An engine whose calls share commits for a minute, leading ``store`` from what it
    holds (a new term), through ``executor`` (the gRPC client)."""
    info = server.client.init_cache()
    cache = CacheConfig(
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
    )
    sched = SchedulerConfig(max_model_len=info.max_model_len, commit_interval_s=60.0)
    engine = LLMEngine(
        executor or server.client,
        cache,
        sched,
        info.eos_token_id,
        detokenizer=Detokenizer(tokenizer),
        journal=Journal(store),
    )
    engine.recover(store.begin_epoch(server.next_epoch()))
    return engine


def _steps_sharing_a_commit(lane: Lane) -> list[StepOutcome]:
    """Eight steps of ``lane``, most of whose calls make no event (they share a commit)."""
    outcomes = [lane.step()[0] for _ in range(8)]
    assert [bool(o.deltas) for o in outcomes[2:]].count(False) >= 4
    return outcomes


def _told_alike(
    store: InMemoryStateStore,
    outcomes: list[StepOutcome],
    request_id: str,
    group: SequenceGroup,
    tokenizer: Any,
) -> list[tuple[int, str]]:
    """The request's stored events, checked to be those published and to carry every
    token its sequence holds, with their text. Returns them."""
    seq = group.seqs[0]
    stored = store.read_events(request_id)
    published = [(d.event, d.to_json()) for o in outcomes for d in o.deltas]
    assert [e for e in published if f'"{request_id}"' in e[1]] == stored
    tokens, text, _ = _stream(stored)
    assert tokens == seq.output_token_ids and len(tokens) > 8
    assert seq.read_offset >= len(tokens) - 3  # at most a character's bytes wait
    assert text == tokenizer.decode(tokens[: seq.read_offset], skip_special_tokens=True)
    return stored


class _TokensCounted(list):
    """Outcomes, their tokens counted by request as each is added (as observers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.counted: dict[str, int] = {}

    def append(self, outcome: StepOutcome) -> None:
        for d in outcome.deltas:
            tokens = sum(len(out.token_ids) for out in d.outputs)
            self.counted[d.request_id] = self.counted.get(d.request_id, 0) + tokens
        super().append(outcome)


def _stream(events: list[tuple[int, str]]) -> tuple[list[int], str, list[float]]:
    """The tokens, text and logprobs that ``events`` carry, checking they are numbered
    1, 2, ... ."""
    tokens, text, logprobs = [], "", []
    for index, line in events:
        delta = RequestDelta.from_json(line)
        assert delta.event == index
        for out in delta.outputs:
            tokens += out.token_ids
            text += out.text
            logprobs += out.logprobs
    return tokens, text, logprobs


class _Recorded:
    """The gRPC client, keeping every step it sends."""

    def __init__(self, client: ExecutorClient) -> None:
        self.client = client
        self.steps: list[ExecuteStep] = []

    def execute(self, step: ExecuteStep) -> StepResult:
        self.steps.append(step)
        return self.client.execute(step)

    def start(self, step: ExecuteStep) -> Callable[[], StepResult]:
        self.steps.append(step)
        return self.client.start(step)

    def fence(self, epoch: int) -> int | None:
        return self.client.fence(epoch)

    def end_steps(self, step_id: int) -> None:
        self.client.end_steps(step_id)


class _LostAfterPrompt(_Recorded):
    """The gRPC client; once ``armed``, and with ``lose``, every call sent after the one
    carrying a prompt (``prompt_step``) is lost on the way: never sent, never answered."""

    def __init__(self, client: ExecutorClient, lose: bool) -> None:
        super().__init__(client)
        self.lose, self.armed = lose, False
        self.prompt_step: int | None = None
        self.lost: list[int] = []

    def start(self, step: ExecuteStep) -> Callable[[], StepResult]:
        if self.lose and self.prompt_step is not None:
            self.lost.append(step.step_id)

            def never() -> StepResult:
                raise AssertionError(f"step {step.step_id} was lost: no answer comes")

            return never
        if self.armed and any(len(s.new_token_ids) > 1 for s in step.seqs):
            self.prompt_step = step.step_id
        return super().start(step)


class _ArrivingWhileWaiting(_Recorded):
    """The gRPC client; while the engine waits for every ``every``-th answer, a request
    arrives (``end_steps``, as the lane set calls it), in the step ``arrived_in`` names."""

    def __init__(self, client: ExecutorClient, every: int) -> None:
        super().__init__(client)
        self.every = every
        self.engine: LLMEngine | None = None
        self.outcomes: list[StepOutcome] = []
        self.arrived_in: list[int] = []
        self.num_waits = 0

    def watch(self, engine: LLMEngine) -> None:
        self.engine = engine

    def start(self, step: ExecuteStep) -> Callable[[], StepResult]:
        answer = super().start(step)

        def wait() -> StepResult:
            self.num_waits += 1
            if self.engine is not None and self.num_waits % self.every == 0:
                self.engine.end_steps()
                self.arrived_in.append(len(self.outcomes))  # the step running
            return answer()

        return wait


class _Slow(_Recorded):
    """The gRPC client, each answer taking ``seconds`` more: an executor whose steps far
    outlast the engine's own work per call, as a CPU's do."""

    def __init__(self, client: ExecutorClient, seconds: float) -> None:
        super().__init__(client)
        self.seconds = seconds

    def start(self, step: ExecuteStep) -> Callable[[], StepResult]:
        wait = super().start(step)

        def slowly() -> StepResult:
            time.sleep(self.seconds)
            return wait()

        return slowly


@pytest.mark.parametrize("quiet", [False, True])
def test_long_calls_are_sent_ahead_only_in_a_quiet_spell(server: Server, quiet: bool) -> None:
    """With steps that take 30 to 100 times the engine's own work per call, a call is not
    sent ahead while requests keep arriving (it is, at most, before the engine has timed a
    call): a newcomer would wait for it too, and the overlap gains little. Once no request
    has come for decode_steps_quiet_s, calls are sent ahead again. The tokens are the
    same either way. The share asked is a half, not the serving default's tenth: on a
    loaded machine (CI's workers side by side) the engine's own time per call reached a
    tenth of these steps."""
    info = server.client.init_cache()
    want, _ = _arrivals(server.client, info, server.next_epoch(), 1)
    slow = _Slow(server.client, 0.1)
    quiet_s = 0.0 if quiet else 60.0
    got, engine = _arrivals(
        slow, info, server.next_epoch(), 1, ahead_min_share=0.5, decode_steps_quiet_s=quiet_s
    )
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    num_calls = len(slow.steps)
    assert num_calls > 20
    if quiet:
        assert engine.stats.num_steps_ahead > num_calls // 2
    else:
        assert engine.stats.num_steps_ahead <= 2


class _FirstCallAheadArrivesFirst:
    """The gRPC client, except that the first call sent ahead is answered as if it had
    reached the executor before the call it follows (resent on a new connection): refused,
    without being sent."""

    def __init__(self, client: ExecutorClient) -> None:
        self.client = client
        self.num_refused = 0

    def execute(self, step: ExecuteStep) -> StepResult:
        return self.client.execute(step)

    def start(self, step: ExecuteStep) -> Callable[[], StepResult]:
        if step.follows_step_id is None or self.num_refused:
            return self.client.start(step)
        self.num_refused += 1

        def refused() -> StepResult:
            raise StepRefused(grpc.StatusCode.FAILED_PRECONDITION, "follows a step not applied")

        return refused

    def fence(self, epoch: int) -> int | None:
        return self.client.fence(epoch)

    def end_steps(self, step_id: int) -> None:
        self.client.end_steps(step_id)


def test_a_call_ahead_refused_for_arriving_first_is_sent_again(server: Server) -> None:
    info = server.client.init_cache()
    want, _ = _arrivals(server.client, info, server.next_epoch(), 1)
    executor = _FirstCallAheadArrivesFirst(server.client)
    got, engine = _arrivals(executor, info, server.next_epoch(), 1)
    assert executor.num_refused == 1 and engine.stats.num_steps_ahead > 1
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
