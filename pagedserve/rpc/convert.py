"""Conversions between the executor API's pb messages and our dataclasses, both directions.

The server and the client both use these, so pb objects never travel past either one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import fields

from pagedserve.grammar import Grammar
from pagedserve.model_info import ExecutorStats, ModelInfo
from pagedserve.rpc.v1 import executor_pb2 as pb
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import (
    BlockPairs,
    ExecuteStep,
    PromptLogprob,
    SeqOutput,
    SeqStep,
    StepResult,
)

# The executor API's revision (InitCacheResponse.protocol), raised with each change that a
# side of another revision would misread. 1: a call sent ahead's sequences in columns.
EXECUTOR_PROTOCOL = 1


def pairs_to_pb(pairs: BlockPairs) -> list[pb.BlockPair]:
    return [pb.BlockPair(src=src, dst=dst) for src, dst in pairs]


def pairs_from_pb(pairs: Iterable[pb.BlockPair]) -> BlockPairs:
    return [(p.src, p.dst) for p in pairs]


def params_to_pb(p: SamplingParams) -> pb.SamplingParameters:
    return pb.SamplingParameters(
        n=p.n,
        best_of=p.best_of,
        use_beam_search=p.use_beam_search,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        max_tokens=p.max_tokens,
        ignore_eos=p.ignore_eos,
        stop_token_ids=p.stop_token_ids,
        seed=p.seed,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        length_penalty=p.length_penalty,
        grammar=pb.Grammar(kind=p.grammar.kind, spec=p.grammar.spec) if p.grammar else None,
    )


def params_from_pb(m: pb.SamplingParameters) -> SamplingParams:
    """Raises ValueError when the parameters are invalid (SamplingParams validates)."""
    return SamplingParams(
        n=m.n,
        best_of=m.best_of if m.HasField("best_of") else None,
        use_beam_search=m.use_beam_search,
        temperature=m.temperature,
        top_p=m.top_p,
        top_k=m.top_k,
        min_p=m.min_p,
        repetition_penalty=m.repetition_penalty,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        max_tokens=m.max_tokens,
        ignore_eos=m.ignore_eos,
        stop_token_ids=tuple(m.stop_token_ids),
        seed=m.seed if m.HasField("seed") else None,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        length_penalty=m.length_penalty,
        grammar=Grammar(m.grammar.kind, m.grammar.spec) if m.HasField("grammar") else None,
    )


# By id(params): the object, its message and the message's bytes.
ParamsCache = dict[int, tuple[SamplingParams, pb.SamplingParameters, bytes]]


def step_to_pb(step: ExecuteStep, known: ParamsCache | None = None) -> pb.ExecuteRequest:
    """Sequences are added in place, and equal sampling parameters go once into the
    request's list for all the sequences that have them (each request of hundreds has its
    own SamplingParams object, most of them equal), each object converted once. The
    followers that end the step go in columns (``FollowerColumns``) when they carry no
    token lists, as those of a call sent ahead do.

    ``known`` carries conversions from one step to the next (a request keeps its
    SamplingParams object for life) and is left holding this step's: each entry keeps its
    object alive, so no id in it is reused for another while it is there.
    """
    request = pb.ExecuteRequest(
        step_id=step.step_id,
        epoch=step.epoch,
        blocks_to_swap_out=pairs_to_pb(step.blocks_to_swap_out),
        blocks_to_swap_in=pairs_to_pb(step.blocks_to_swap_in),
        blocks_to_copy=pairs_to_pb(step.blocks_to_copy),
        follows_step_id=step.follows_step_id,
    )
    last = known if known is not None else {}
    params: ParamsCache = {}
    indices: dict[bytes, int] = {}  # a message's bytes -> its place in the request's list

    def index_of(p: SamplingParams) -> int:
        entry = params.get(id(p)) or last.get(id(p))
        if entry is None:
            message = params_to_pb(p)
            entry = (p, message, message.SerializeToString(deterministic=True))
        params[id(p)] = entry
        index = indices.get(entry[2])
        if index is None:
            index = indices[entry[2]] = len(indices)
            request.sampling_params.append(entry[1])
        return index

    split = len(step.seqs)
    while split and _in_columns(step.seqs[split - 1]):
        split -= 1
    add = request.seqs.add
    for s in step.seqs[:split]:
        seq = add(
            seq_id=s.seq_id,
            num_computed_tokens=s.num_computed_tokens,
            sampling_params_index=index_of(s.sampling_params),
            num_samples=s.num_samples,
            sample_index=s.sample_index,
            num_steps=s.num_steps,
            follows=s.follows,
            table_start=s.table_start,
        )
        # Lists only where not empty: an empty list passed costs about what a scalar
        # does, and a sequence sent ahead usually has none but a few table entries.
        table = s.block_table[s.table_start :] if s.table_start else s.block_table
        if table:
            seq.block_table.extend(table)
        if s.new_token_ids:
            seq.new_token_ids.extend(s.new_token_ids)
        if s.prompt_token_ids:
            seq.prompt_token_ids.extend(s.prompt_token_ids)
        if s.output_token_ids:
            seq.output_token_ids.extend(s.output_token_ids)
    if split < len(step.seqs):
        _followers_to_pb(step.seqs[split:], index_of, request.followers)
    if known is not None:
        known.clear()
        known.update(params)
    return request


def _in_columns(s: SeqStep) -> bool:
    """Whether ``FollowerColumns`` says all that the sequence's step holds."""
    return (
        s.follows
        and s.num_samples == 1
        and not (s.new_token_ids or s.num_computed_tokens)
        and not (s.prompt_token_ids or s.output_token_ids)
    )


def _followers_to_pb(
    seqs: list[SeqStep], index_of: Callable[[SamplingParams], int], m: pb.FollowerColumns
) -> None:
    tables = [s.block_table[s.table_start :] for s in seqs]
    m.seq_ids.extend([s.seq_id for s in seqs])
    m.sampling_params_index.extend([index_of(s.sampling_params) for s in seqs])
    m.sample_index.extend([s.sample_index for s in seqs])
    m.num_steps.extend([s.num_steps for s in seqs])
    m.table_start.extend([s.table_start for s in seqs])
    m.table_lengths.extend([len(table) for table in tables])
    m.table_entries.extend([entry for table in tables for entry in table])


def step_from_pb(m: pb.ExecuteRequest) -> ExecuteStep:
    """Each of the request's parameters is read and validated once. A sequence that
    follows keeps the table entries sent, from ``table_start`` on, until the executor
    fills in the rest (SeqStep); those sent in columns come after the others.

    Raises ValueError when sampling parameters are invalid, a sequence names none, or
    the followers' columns do not add up."""
    params = [params_from_pb(p) for p in m.sampling_params]
    seqs = []
    for index, s in enumerate(m.seqs):
        if s.sampling_params_index >= len(params):
            raise ValueError(
                f"seqs[{index}].sampling_params_index: {s.sampling_params_index} "
                f"of {len(params)} sampling_params"
            )
        # Each read of a pb field costs a call, and a list made of an empty one costs
        # about what one made of a few entries: each list is read once, copied if any.
        new, table, prompt, output = (
            s.new_token_ids,
            s.block_table,
            s.prompt_token_ids,
            s.output_token_ids,
        )
        seqs.append(
            SeqStep(
                seq_id=s.seq_id,
                new_token_ids=list(new) if new else [],
                num_computed_tokens=s.num_computed_tokens,
                block_table=list(table) if table else [],
                sampling_params=params[s.sampling_params_index],
                num_samples=s.num_samples,
                sample_index=s.sample_index,
                prompt_token_ids=list(prompt) if prompt else [],
                output_token_ids=list(output) if output else [],
                num_steps=max(s.num_steps, 1),
                follows=s.follows,
                table_start=s.table_start,
            )
        )
    if m.HasField("followers"):
        seqs += _followers_from_pb(m.followers, params)
    return ExecuteStep(
        step_id=m.step_id,
        epoch=m.epoch,
        seqs=seqs,
        blocks_to_swap_out=pairs_from_pb(m.blocks_to_swap_out),
        blocks_to_swap_in=pairs_from_pb(m.blocks_to_swap_in),
        blocks_to_copy=pairs_from_pb(m.blocks_to_copy),
        follows_step_id=m.follows_step_id if m.HasField("follows_step_id") else None,
    )


def _followers_from_pb(m: pb.FollowerColumns, params: list[SamplingParams]) -> list[SeqStep]:
    seq_ids = list(m.seq_ids)
    columns = {
        name: list(getattr(m, name))
        for name in ("sampling_params_index", "sample_index", "num_steps", "table_start")
    }
    lengths, entries = list(m.table_lengths), list(m.table_entries)
    for name, column in [*columns.items(), ("table_lengths", lengths)]:
        if len(column) != len(seq_ids):
            raise ValueError(f"followers.{name}: {len(column)} entries, {len(seq_ids)} seq_ids")
    if sum(lengths) != len(entries):
        raise ValueError(f"followers.table_entries: {len(entries)}, table_lengths {sum(lengths)}")
    for i, index in enumerate(columns["sampling_params_index"]):
        if index >= len(params):
            raise ValueError(
                f"followers.sampling_params_index[{i}]: {index} of {len(params)} sampling_params"
            )
    seqs, start = [], 0
    for seq_id, index, sample, num_steps, kept, length in zip(
        seq_ids, *columns.values(), lengths, strict=True
    ):
        end = start + length
        # Every field in order, none by keyword: for hundreds of sequences, keywords and
        # default factories cost twice the construction.
        table = entries[start:end]
        steps = max(num_steps, 1)
        seqs.append(
            SeqStep(seq_id, [], 0, table, params[index], 1, sample, [], [], steps, True, kept)
        )
        start = end
    return seqs


def _entries_to_pb(top: dict[int, float]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in top.items()]


def _entries_from_pb(entries: Iterable[pb.TokenLogprob]) -> dict[int, float]:
    return {e.token_id: e.logprob for e in entries}


def _prompt_logprob_to_pb(scored: PromptLogprob) -> pb.PromptLogprob:
    return pb.PromptLogprob(
        logprob=scored.logprob,
        rank=scored.rank,
        top_logprobs=_entries_to_pb(scored.top_logprobs),
    )


def result_to_pb(result: StepResult) -> pb.ExecuteResponse:
    outputs = result.outputs
    if not any(o.top_logprobs or o.prompt_logprobs or o.error for o in outputs):
        drawn = pb.DrawnColumns(
            seq_ids=[o.seq_id for o in outputs],
            counts=[len(o.token_ids) for o in outputs],
            token_ids=[t for o in outputs for t in o.token_ids],
            logprobs=[lp for o in outputs for lp in o.logprobs],
        )
        return pb.ExecuteResponse(step_id=result.step_id, drawn=drawn)
    messages = [
        pb.SequenceOutput(
            seq_id=o.seq_id,
            token_ids=o.token_ids,
            logprobs=o.logprobs,
            top_logprobs=[pb.TopLogprobs(entries=_entries_to_pb(top)) for top in o.top_logprobs],
            prompt_logprobs=[_prompt_logprob_to_pb(scored) for scored in o.prompt_logprobs],
            error=o.error,
        )
        for o in outputs
    ]
    return pb.ExecuteResponse(step_id=result.step_id, outputs=messages)


def result_from_pb(m: pb.ExecuteResponse) -> StepResult:
    """A decode step's output is a token and its logprob: the rest is read only when sent
    (each read of a pb field costs a call, and this runs for every sequence of a step)."""
    if m.HasField("drawn"):
        return StepResult(step_id=m.step_id, outputs=_drawn_from_pb(m.drawn))
    outputs = []
    for o in m.outputs:
        out = SeqOutput(o.seq_id, list(o.token_ids), list(o.logprobs), error=o.error)
        if o.top_logprobs:
            out.top_logprobs = [_entries_from_pb(top.entries) for top in o.top_logprobs]
        if o.prompt_logprobs:
            out.prompt_logprobs = [
                PromptLogprob(p.logprob, p.rank, _entries_from_pb(p.top_logprobs))
                for p in o.prompt_logprobs
            ]
        outputs.append(out)
    return StepResult(step_id=m.step_id, outputs=outputs)


def _drawn_from_pb(m: pb.DrawnColumns) -> list[SeqOutput]:
    counts, token_ids, logprobs = list(m.counts), list(m.token_ids), list(m.logprobs)
    if len(token_ids) != len(logprobs) or len(token_ids) != sum(counts):
        raise ValueError(
            f"drawn: {len(token_ids)} tokens, {len(logprobs)} logprobs, counts {sum(counts)}"
        )
    if all(count == 1 for count in counts):  # one decode step
        return [
            SeqOutput(seq_id, [t], [lp])
            for seq_id, t, lp in zip(m.seq_ids, token_ids, logprobs, strict=True)
        ]
    outputs, start = [], 0
    for seq_id, count in zip(m.seq_ids, counts, strict=True):
        end = start + count
        outputs.append(SeqOutput(seq_id, token_ids[start:end], logprobs[start:end]))
        start = end
    return outputs


def model_info_to_pb(info: ModelInfo) -> pb.InitCacheResponse:
    return pb.InitCacheResponse(
        protocol=EXECUTOR_PROTOCOL,
        model=info.model,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        eos_token_id=info.eos_token_id,
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
        sliding_window=info.sliding_window,
        instance_id=info.instance_id,
    )


def model_info_from_pb(m: pb.InitCacheResponse) -> ModelInfo:
    return ModelInfo(
        model=m.model,
        vocab_size=m.vocab_size,
        max_model_len=m.max_model_len,
        eos_token_id=m.eos_token_id if m.HasField("eos_token_id") else None,
        block_size=m.block_size,
        num_gpu_blocks=m.num_gpu_blocks,
        num_cpu_blocks=m.num_cpu_blocks,
        sliding_window=m.sliding_window,
        instance_id=m.instance_id,
    )


_STATS_FIELDS = [f.name for f in fields(ExecutorStats)]


def stats_to_pb(stats: ExecutorStats) -> pb.GetStatsResponse:
    return pb.GetStatsResponse(**{name: getattr(stats, name) for name in _STATS_FIELDS})


def stats_from_pb(m: pb.GetStatsResponse) -> ExecutorStats:
    values = {name: getattr(m, name) for name in _STATS_FIELDS}
    if not m.HasField("last_step_id"):
        values["last_step_id"] = None
    return ExecutorStats(**values)
