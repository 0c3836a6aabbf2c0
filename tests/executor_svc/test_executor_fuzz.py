"""Property-based fuzzing of the executor's own gRPC API on one real executor process.

Requests are built from the proto schema (mostly in range, so many are applied) and then
mutated: ids outside their pools and the vocabulary, negative and huge numbers, NaN and
infinite sampling parameters, duplicated and huge block lists, wrong epochs and step ids,
empty fields, grammars that do not compile. Every mutating RPC is fuzzed: Execute,
CopyBlocks, SwapBlocks, Fence, EndSteps and InitCache.

Properties after every case: the answer is OK, INVALID_ARGUMENT, or FAILED_PRECONDITION
where that is the contract (an epoch older than the newest seen, a step id out of order),
or RESOURCE_EXHAUSTED from gRPC itself for a message past MAX_MESSAGE_BYTES;
a refused call changed nothing (GetStats and both pools); an applied call answered one
output per sequence and wrote no block it did not name. The pools are checked through
canaries: a sequence whose KV sits in a KV-pool block and, copied, in a swap-pool block
that valid cases never name; a greedy decode over each must give the very token and
logprobs it gave when it was written. A case that names a canary block and is applied
writes the canaries anew.

PAGEDSERVE_FUZZ_EXAMPLES cases (default 200), as for the front doors.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor
from google.protobuf.message import Message
from hypothesis import event, given
from hypothesis import strategies as st

from pagedserve.rpc import GRPC_OPTIONS, MAX_MESSAGE_BYTES
from pagedserve.rpc.convert import result_from_pb, step_to_pb
from pagedserve.rpc.v1 import executor_pb2 as pb
from pagedserve.rpc.v1 import executor_pb2_grpc as pb_grpc
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteStep, SeqStep, StepResult
from tests.executor_svc.executor_proc import NUM_GPU_BLOCKS, Server, start_executor, stop_executor
from tests.fuzz import FUZZ

VOCAB, BLOCK_SIZE, MAX_LEN = 512, 16, 1024  # the tiny model's
GPU_CANARY, GPU_SCRATCH = NUM_GPU_BLOCKS - 1, NUM_GPU_BLOCKS - 2  # valid cases name neither
CANARY_PROMPT = [17, 250, 3, 99, 401, 8, 77, 310, 42, 5, 260]  # positions 0..10
CANARY_TOKEN = 123  # decoded at position 11, written anew identically by every check
INT32, UINT32, INT64, UINT64 = 2**31, 2**32 - 1, 2**63, 2**64 - 1
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


# -- strategies ---------------------------------------------------------------------------


def _mostly(valid: st.SearchStrategy, nasty: st.SearchStrategy) -> st.SearchStrategy:
    """Three draws in four from ``valid``."""
    return st.one_of(valid, valid, valid, nasty)


TOKENS = st.lists(st.integers(0, VOCAB - 1), max_size=8)
GRAMMARS = st.sampled_from(
    [("regex", "[a-z]+"), ("json_schema", '{"type": "object"}'), ("ebnf", 'root ::= "a"')]
).map(lambda g: pb.Grammar(kind=g[0], spec=g[1]))
SAMPLING = st.builds(  # valid; proto defaults are literal, so 1.0 is sent where it is "off"
    pb.SamplingParameters,
    n=st.just(1),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_p=st.sampled_from([1.0, 0.9]),
    top_k=st.sampled_from([-1, 1, 5]),
    min_p=st.sampled_from([0.0, 0.1]),
    repetition_penalty=st.sampled_from([1.0, 1.2]),
    presence_penalty=st.sampled_from([0.0, 0.5]),
    frequency_penalty=st.sampled_from([0.0, -0.5]),
    max_tokens=st.integers(1, 16),
    ignore_eos=st.booleans(),
    stop_token_ids=TOKENS,
    seed=st.one_of(st.none(), st.integers(-INT64, INT64 - 1)),
    logprobs=st.one_of(st.none(), st.integers(0, 5)),
    length_penalty=st.just(1.0),
    prompt_logprobs=st.one_of(st.none(), st.none(), st.integers(0, 3)),
    grammar=st.one_of(st.none(), st.none(), st.none(), GRAMMARS),
)


@st.composite
def sequences(draw: st.DrawFn) -> pb.SequenceStep:
    """A valid sequence of a step, its blocks below the canaries' (see _written_blocks)."""
    num_computed = draw(st.integers(0, 40))
    new_tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24))
    num_samples = draw(st.integers(0, 3))
    num_steps = draw(st.integers(1, 4)) if num_samples == 1 else 1
    num_blocks = -(-(num_computed + len(new_tokens) + num_steps - 1) // BLOCK_SIZE)
    blocks = st.integers(0, GPU_SCRATCH - 1)
    return pb.SequenceStep(
        seq_id=draw(st.integers(-INT64, INT64 - 1)),
        new_token_ids=new_tokens,
        num_computed_tokens=num_computed,
        block_table=draw(st.lists(blocks, min_size=num_blocks, max_size=num_blocks + 1)),
        num_samples=num_samples,
        sample_index=draw(st.integers(0, UINT32)),
        prompt_token_ids=draw(TOKENS),
        output_token_ids=draw(TOKENS),
        num_steps=draw(st.sampled_from([num_steps, num_steps, 0])) if num_steps == 1 else num_steps,
    )


def _pairs(num_src: int, num_dst: int) -> st.SearchStrategy[list[pb.BlockPair]]:
    """Valid (src, dst) block pairs below the canaries' blocks."""
    pair = st.builds(pb.BlockPair, src=st.integers(0, num_src - 1), dst=st.integers(0, num_dst - 1))
    return st.lists(pair, max_size=3)


@dataclass(frozen=True)
class Pools:
    """The pools' sizes; the swap pool's canary is its last block."""

    num_cpu: int

    @property
    def cpu_canary(self) -> int:
        return self.num_cpu - 1

    def limits(self) -> dict[str, tuple[int, int]]:
        """Each pair field's (src, dst) pool sizes."""
        gpu, cpu = NUM_GPU_BLOCKS, self.num_cpu
        return {
            "blocks_to_swap_out": (gpu, cpu),
            "blocks_to_swap_in": (cpu, gpu),
            "blocks_to_copy": (gpu, gpu),
        }

    def pairs(self, name: str) -> st.SearchStrategy[list[pb.BlockPair]]:
        src, dst = self.limits()[name]
        return _pairs(
            min(src, GPU_SCRATCH, self.cpu_canary), min(dst, GPU_SCRATCH, self.cpu_canary)
        )


# -- mutations, by field type ---------------------------------------------------------------

FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, -1e-300, 1e308, 2.0])
INTS = st.sampled_from([-1, 0, 1, 2, 65, 512, 1023, 1024, INT32 - 1, -INT32, UINT32, -INT64])
IDS = st.sampled_from([-1, -INT32, 0, GPU_SCRATCH, GPU_CANARY, NUM_GPU_BLOCKS, VOCAB, INT32 - 1])
STRINGS = st.sampled_from(["", "bogus", "(", "{", "x" * 100_000, "\x00", "[a-z]+", "json_schema"])
F = descriptor.FieldDescriptor


def _fit(field: descriptor.FieldDescriptor, value: int) -> int:
    """Wrap ``value`` into the field's wire type, so that every mutation can be sent."""
    bits = {F.TYPE_INT32: 32, F.TYPE_UINT32: 32, F.TYPE_INT64: 64, F.TYPE_UINT64: 64}[field.type]
    value %= 2**bits
    signed = field.type in (F.TYPE_INT32, F.TYPE_INT64)
    return value - 2**bits if signed and value >= 2 ** (bits - 1) else value


@st.composite
def mutate(draw: st.DrawFn, message: Message) -> None:
    """Give one field of ``message``, chosen from its descriptor, a value a client could send
    and a valid one would not: out of range, NaN, empty, huge, duplicated, cleared."""
    field = draw(st.sampled_from(list(message.DESCRIPTOR.fields)))
    name, value = field.name, getattr(message, field.name)
    if field.type == F.TYPE_MESSAGE and not field.is_repeated:
        if draw(st.booleans()):
            message.ClearField(name)
        else:
            draw(mutate(value))
    elif field.is_repeated and field.type == F.TYPE_MESSAGE:
        if len(value) and draw(st.booleans()):
            draw(mutate(value[draw(st.integers(0, len(value) - 1))]))
        elif len(value):  # thousands only of a small one: the test's memory is bounded
            times = [1, 3, 2_000] if value[0].ByteSize() < 1_000 else [1, 3]
            value.extend([value[0]] * draw(st.sampled_from(times)))
    elif field.is_repeated:
        choice = draw(st.sampled_from(["clear", "bad", "huge", "duplicate"]))
        if choice == "clear":
            del value[:]
        elif choice == "bad":
            value.insert(draw(st.integers(0, len(value))), _fit(field, draw(IDS)))
        elif choice == "huge":
            value.extend([_fit(field, draw(IDS))] * draw(st.sampled_from([1_000, 100_000])))
        elif len(value):
            value.append(value[-1])
    elif field.type == F.TYPE_DOUBLE:
        setattr(message, name, draw(FLOATS))
    elif field.type == F.TYPE_BOOL:
        setattr(message, name, not value)
    elif field.type == F.TYPE_STRING:
        setattr(message, name, draw(STRINGS))
    else:
        setattr(message, name, _fit(field, draw(INTS | IDS)))


@st.composite
def execute_requests(draw: st.DrawFn, pools: Pools) -> tuple[pb.ExecuteRequest, int, str]:
    """A valid step with up to three mutations, its epoch as an offset from the newest the
    executor has seen, and its step id against the last applied one ("last", "next", "max")."""
    request = pb.ExecuteRequest(seqs=draw(st.lists(sequences(), max_size=3)))
    for index, seq in enumerate(request.seqs):  # parameters of their own
        request.sampling_params.append(draw(SAMPLING))
        seq.sampling_params_index = index
    for name in pools.limits():
        getattr(request, name).extend(draw(pools.pairs(name)))
    targets = [request, *request.seqs, *request.sampling_params]
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 3]))):
        draw(mutate(draw(st.sampled_from(targets))))
    epoch_offset = draw(st.sampled_from([-1, 0, 1, 1, 1]))
    return request, epoch_offset, draw(st.sampled_from(["next", "next", "last", "max"]))


@st.composite
def pair_requests(draw: st.DrawFn, pools: Pools, kind: type[Message]) -> Message:
    """A CopyBlocks or SwapBlocks request: valid pairs, up to two mutations."""
    request = kind()
    for name in request.DESCRIPTOR.fields_by_name:
        getattr(request, name).extend(draw(pools.pairs(name)))
    for _ in range(draw(st.integers(0, 2))):
        draw(mutate(request))
    return request


def calls(pools: Pools) -> st.SearchStrategy[tuple[str, object]]:
    """One RPC of any kind that mutates, with its request; Execute half the time."""
    requests = {
        "Execute": execute_requests(pools),
        "CopyBlocks": pair_requests(pools, pb.CopyBlocksRequest),
        "SwapBlocks": pair_requests(pools, pb.SwapBlocksRequest),
        "Fence": st.integers(-2, 2),  # an offset from the newest epoch
        "EndSteps": st.builds(pb.EndStepsRequest, step_id=st.integers(0, UINT64)),
        "InitCache": st.builds(pb.InitCacheRequest),
    }
    kinds = st.sampled_from(["Execute"] * 5 + [k for k in requests if k != "Execute"])
    return kinds.flatmap(lambda kind: st.tuples(st.just(kind), requests[kind]))


# -- the executor and its canaries --------------------------------------------------------


def _written_blocks(kind: str, request: Message) -> tuple[set[int], set[int]]:
    """The KV-pool and swap-pool blocks an applied call writes."""
    gpu: set[int] = set()
    cpu: set[int] = set()
    if kind in ("Execute", "CopyBlocks"):
        gpu |= {p.dst for p in request.blocks_to_copy}
    if kind in ("Execute", "SwapBlocks"):
        cpu |= {p.dst for p in request.blocks_to_swap_out}
        gpu |= {p.dst for p in request.blocks_to_swap_in}
    for seq in getattr(request, "seqs", []):
        end = seq.num_computed_tokens + len(seq.new_token_ids) + max(seq.num_steps, 1) - 1
        gpu |= {seq.block_table[pos // BLOCK_SIZE] for pos in range(seq.num_computed_tokens, end)}
    return gpu, cpu


@dataclass
class Executor:
    """A real executor process, a raw stub (past our dataclasses' checks, as any client),
    and the canaries' expected decode."""

    server: Server
    stub: pb_grpc.ExecutorStub
    pools: Pools
    step_ids: Iterator[int] = field(default_factory=lambda: itertools.count(10**15))
    expected: StepResult | None = None

    def stats(self) -> pb.GetStatsResponse:
        return self.stub.GetStats(pb.GetStatsRequest(), timeout=30)

    def step(self, seq: SeqStep) -> StepResult:
        """A step of the canaries' own, in a new epoch, with a step id no case uses."""
        step = ExecuteStep(next(self.step_ids), self.stats().epoch + 1, [seq])
        return result_from_pb(self.stub.Execute(step_to_pb(step), timeout=30))

    def decode(self, block: int) -> StepResult:
        """Greedy decode of the canary's next token over the KV in ``block``: rewrites
        position 11 with what it held, reads positions 0..10."""
        params = SamplingParams(temperature=0.0, logprobs=5)
        seq = SeqStep(0, [CANARY_TOKEN], len(CANARY_PROMPT), [block], params, num_samples=1)
        return self.step(seq)

    def write_canaries(self) -> None:
        """Prefill the canary into its KV-pool block, take its expected decode, and copy
        the block to the swap pool's canary."""
        params = SamplingParams(temperature=0.0)
        self.step(SeqStep(0, CANARY_PROMPT, 0, [GPU_CANARY], params, num_samples=0))
        self.expected = self.decode(GPU_CANARY)
        out = pb.BlockPair(src=GPU_CANARY, dst=self.pools.cpu_canary)
        self.stub.SwapBlocks(pb.SwapBlocksRequest(blocks_to_swap_out=[out]), timeout=30)

    def check_canaries(self) -> None:
        """Both pools' canaries decode as when they were written."""
        assert _same(self.decode(GPU_CANARY), self.expected), "the KV pool's canary changed"
        into = pb.BlockPair(src=self.pools.cpu_canary, dst=GPU_SCRATCH)
        self.stub.SwapBlocks(pb.SwapBlocksRequest(blocks_to_swap_in=[into]), timeout=30)
        assert _same(self.decode(GPU_SCRATCH), self.expected), "the swap pool's canary changed"


def _same(got: StepResult, want: StepResult) -> bool:
    (a,), (b,) = got.outputs, want.outputs
    return a.token_ids == b.token_ids and a.top_logprobs == b.top_logprobs


@pytest.fixture(scope="module")
def executor(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Executor]:
    server = start_executor(tiny_model_dir, tmp_path_factory.mktemp("fuzz") / "executor.log")
    try:
        info = server.client.init_cache()
        channel = grpc.insecure_channel(server.client.address, options=GRPC_OPTIONS)
        with channel:
            executor = Executor(server, pb_grpc.ExecutorStub(channel), Pools(info.num_cpu_blocks))
            executor.write_canaries()
            yield executor
    finally:
        stop_executor(server)


# -- the property ---------------------------------------------------------------------------


def _send(
    executor: Executor, kind: str, request: object, before: pb.GetStatsResponse
) -> tuple[grpc.StatusCode, Message, Message | None, bool]:
    """Send one call; returns its status, the request as sent, the answer (None when
    refused), and whether FAILED_PRECONDITION is within the contract for it."""
    stub, precondition_ok = executor.stub, False
    if kind == "Execute":
        request, epoch_offset, step_choice = request
        request.epoch = max(0, before.epoch + epoch_offset)
        last = before.last_step_id if before.HasField("last_step_id") else 0
        request.step_id = {"last": last, "next": min(last + 1, UINT64), "max": UINT64}[step_choice]
        # A step that follows another may not follow the last applied one.
        precondition_ok = epoch_offset <= 0 or request.HasField("follows_step_id")
    if kind == "Fence":
        precondition_ok = request < 0
        request = pb.FenceRequest(epoch=max(0, before.epoch + request))
    try:
        answer = getattr(stub, kind)(request, timeout=60)
    except grpc.RpcError as e:
        return e.code(), request, None, precondition_ok
    return grpc.StatusCode.OK, request, answer, precondition_ok


@FUZZ
@given(data=st.data())
def test_every_call_is_applied_whole_or_refused_whole(
    executor: Executor, data: st.DataObject
) -> None:
    kind, request = data.draw(calls(executor.pools), label="call")
    before = executor.stats()
    code, sent, answer, precondition_ok = _send(executor, kind, request, before)
    event(f"{kind}: {code.name}")  # --hypothesis-show-statistics: how many were applied
    # gRPC refuses a message past its size limit before the executor sees it.
    too_big = code is grpc.StatusCode.RESOURCE_EXHAUSTED and sent.ByteSize() > MAX_MESSAGE_BYTES
    precondition = code is grpc.StatusCode.FAILED_PRECONDITION and precondition_ok
    assert code in ALLOWED or precondition or too_big, (
        f"{kind} of {sent.ByteSize()} bytes answered {code}:\n"
        f"{executor.server.log_path.read_text()[-3000:]}"
    )
    if code is not grpc.StatusCode.OK:
        assert executor.stats() == before, "a refused call changed the executor's state"
        executor.check_canaries()
        return
    if kind == "Execute":
        outputs = result_from_pb(answer).outputs
        assert [o.seq_id for o in outputs] == [s.seq_id for s in sent.seqs]
    gpu, cpu = _written_blocks(kind, sent)
    if GPU_CANARY in gpu or executor.pools.cpu_canary in cpu:
        executor.write_canaries()  # the call named a canary's block: its KV is new
    executor.check_canaries()
