"""JSON forms of what the engine persists: sequence groups with their block tables, and
the step in flight by reference. Versioned; never pickle.

A group's stored value is JSON lines: a snapshot, then one delta per step that only
appended to it (new tokens, text and blocks), so a step's commit grows with what the step
added rather than with every running group's whole history.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson

from pagedserve.grammar import Grammar
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import NO_BLOCK, BlockPairs, ExecuteStep, PromptLogprob, num_freed
from scheduler_svc.core.output_text import OutputText
from scheduler_svc.core.sequence import Sequence, SequenceGroup, SequenceStatus

SCHEMA_VERSION = 1
STEP_VERSION = 2  # 1 wrote each sequence of the step whole


@dataclasses.dataclass(slots=True)
class RestoredGroup:
    group: SequenceGroup
    queue: str  # "waiting", "running" or "swapped"
    block_tables: dict[int, tuple[list[int], int]]  # seq_id -> (block ids, slots mapped)


# Field names read once, for shallow dicts: dataclasses.asdict deep-copies every value, and
# every step's commit converts each group and each sequence.
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_SEQ_FIELDS = tuple(
    f.name for f in dataclasses.fields(Sequence) if f.name not in Sequence.TRANSIENT
)


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    data = {name: getattr(params, name) for name in _PARAM_FIELDS}
    if params.grammar is not None:
        data["grammar"] = {"kind": params.grammar.kind, "spec": params.grammar.spec}
    return data


def params_from_dict(data: dict[str, Any]) -> SamplingParams:
    data = dict(data)
    data["stop"] = tuple(data.get("stop", ()))
    data["stop_token_ids"] = tuple(data.get("stop_token_ids", ()))
    if data.get("grammar") is not None:
        data["grammar"] = Grammar(**data["grammar"])
    return SamplingParams(**data)


def _seq_to_dict(seq: Sequence) -> dict[str, Any]:
    data = {name: getattr(seq, name) for name in _SEQ_FIELDS}
    data["status"] = int(seq.status)
    data["output_text"] = str(seq.output_text)
    data["output_top_logprobs"] = [list(top.items()) for top in seq.output_top_logprobs]
    return data


def _seq_from_dict(data: dict[str, Any]) -> Sequence:
    data = dict(data)
    data["status"] = SequenceStatus(data["status"])
    data["output_top_logprobs"] = [dict(map(tuple, top)) for top in data["output_top_logprobs"]]
    return Sequence(**data)


def prompt_logprobs_to_list(scored: list[PromptLogprob]) -> list[list[Any]]:
    """``[logprob, rank, [[token_id, logprob], ...]]`` per token: stored groups and events."""
    return [[p.logprob, p.rank, list(p.top_logprobs.items())] for p in scored]


def prompt_logprobs_from_list(data: list[list[Any]]) -> list[PromptLogprob]:
    return [PromptLogprob(lp, rank, dict(map(tuple, top))) for lp, rank, top in data]


def group_to_json(
    group: SequenceGroup, queue: str, block_tables: dict[int, tuple[list[int], int]]
) -> str:
    return orjson.dumps(
        {
            "version": SCHEMA_VERSION,
            "request_id": group.request_id,
            "arrival_time": group.arrival_time,
            "num_preemptions": group.num_preemptions,
            "sampling_params": params_to_dict(group.sampling_params),
            "queue": queue,
            "seqs": [_seq_to_dict(seq) for seq in group.seqs],
            "block_tables": {str(k): list(v) for k, v in block_tables.items()},
            "prompt_logprobs": prompt_logprobs_to_list(group.prompt_logprobs),
        }
    ).decode()


def group_from_json(text: str) -> RestoredGroup:
    """Read a snapshot and apply the deltas that follow it."""
    snapshot, *deltas = text.split("\n")  # JSON escapes newlines inside strings
    data = orjson.loads(snapshot)
    if data.get("version") != SCHEMA_VERSION:
        raise ValueError(f"group state version {data.get('version')} is not {SCHEMA_VERSION}")
    group = SequenceGroup(
        data["request_id"],
        [_seq_from_dict(s) for s in data["seqs"]],
        data["arrival_time"],
        params_from_dict(data["sampling_params"]),
        data["num_preemptions"],
        prompt_logprobs_from_list(data.get("prompt_logprobs", [])),
    )
    tables = {int(k): (v[0], v[1]) for k, v in data["block_tables"].items()}
    restored = RestoredGroup(group, data["queue"], tables)
    for delta in deltas:
        _apply_delta(restored, orjson.loads(delta))
    return restored


@dataclasses.dataclass(slots=True)
class StoredMark:
    """What the store holds of a group, enough to tell whether its next write can be a delta."""

    seq_ids: tuple[int, ...]
    num_outputs: list[int]
    num_tops: list[int]
    texts: list[tuple[OutputText, int, int]]  # each text object, its length and cuts then
    tables: list[list[int]]  # [] for a sequence without blocks
    num_prompt_logprobs: int = 0
    num_deltas: int = 0
    whole_chars: int = 0  # the size of the last whole write
    delta_chars: int = 0  # the deltas' size since


def stored_mark(
    group: SequenceGroup,
    tables: dict[int, tuple[list[int], int]],
    num_deltas: int = 0,
    whole_chars: int = 0,
    delta_chars: int = 0,
) -> StoredMark:
    """The mark of ``group`` as just written, ``tables`` being copies (kept, not re-copied)."""
    seqs = group.seqs
    return StoredMark(
        tuple(seq.seq_id for seq in seqs),
        [len(seq.output_token_ids) for seq in seqs],
        [len(seq.output_top_logprobs) for seq in seqs],
        [(seq.output_text, len(seq.output_text), seq.output_text.cuts) for seq in seqs],
        [tables[seq.seq_id][0] if seq.seq_id in tables else [] for seq in seqs],
        len(group.prompt_logprobs),
        num_deltas,
        whole_chars,
        delta_chars,
    )


def group_delta(
    group: SequenceGroup, queue: str, tables: dict[int, tuple[list[int], int]], mark: StoredMark
) -> str | None:
    """One JSON line taking the stored group from ``mark`` to its state now, or None when
    the change is not an append (a sequence came or went, text was cut at a stop string,
    blocks were freed or moved): then the caller writes a snapshot. Leading entries freed
    outside a sliding window count as an append: the line then ends with their number."""
    if tuple(seq.seq_id for seq in group.seqs) != mark.seq_ids:
        return None
    seqs = []
    for i, seq in enumerate(group.seqs):
        table, num_slots = tables.get(seq.seq_id, ([], 0))
        old_table, start = mark.tables[i], mark.num_outputs[i]
        text, text_len, cuts = mark.texts[i]
        freed = num_freed(table)
        if (
            len(seq.output_token_ids) < start
            or freed > len(old_table)
            or table[freed : len(old_table)] != old_table[freed:]
            or seq.output_text is not text
            or text.cuts != cuts
        ):
            return None
        entry = [
            seq.seq_id,
            int(seq.status),
            seq.num_computed_tokens,
            seq.cumulative_logprob,
            seq.prefix_offset,
            seq.read_offset,
            seq.output_token_ids[start:],
            seq.output_logprobs[start:],
            [list(top.items()) for top in seq.output_top_logprobs[mark.num_tops[i] :]],
            text.since(text_len),
            table[len(old_table) :],
            num_slots,
        ]
        seqs.append([*entry, freed] if freed else entry)
    delta = {"queue": queue, "num_preemptions": group.num_preemptions, "seqs": seqs}
    if len(group.prompt_logprobs) > mark.num_prompt_logprobs:
        scored = group.prompt_logprobs[mark.num_prompt_logprobs :]
        delta["prompt_logprobs"] = prompt_logprobs_to_list(scored)
    return orjson.dumps(delta).decode()


def _apply_delta(restored: RestoredGroup, delta: dict[str, Any]) -> None:
    restored.queue = delta["queue"]
    restored.group.num_preemptions = delta["num_preemptions"]
    restored.group.prompt_logprobs += prompt_logprobs_from_list(delta.get("prompt_logprobs", []))
    by_id = {seq.seq_id: seq for seq in restored.group.seqs}
    for entry in delta["seqs"]:  # the fields in group_delta's order
        seq_id, status, computed, cum, prefix, read, ids, lps, tops, text, blocks, slots, *rest = (
            entry
        )
        freed = rest[0] if rest else 0  # written only once entries were freed
        seq = by_id[seq_id]
        seq.status = SequenceStatus(status)
        seq.num_computed_tokens = computed
        seq.cumulative_logprob = cum
        seq.prefix_offset, seq.read_offset = prefix, read
        seq.output_token_ids += ids
        seq.output_logprobs += lps
        seq.output_top_logprobs += [dict(map(tuple, top)) for top in tops]
        seq.output_text += text
        if blocks or seq_id in restored.block_tables:
            table = restored.block_tables.get(seq_id, ([], 0))[0]
            table = [NO_BLOCK] * freed + table[freed:] + blocks
            restored.block_tables[seq_id] = (table, slots)


@dataclasses.dataclass(slots=True)
class PendingStep:
    """The step in flight as the journal keeps it: its sequences by id, in the order sent,
    and its block moves. Each sequence's tokens, table and parameters are in the groups of
    the same commit, from which the engine rebuilds the step it sent (see LLMEngine.recover),
    so a commit does not repeat what its groups already hold."""

    step_id: int
    seq_ids: list[int]
    blocks_to_swap_out: BlockPairs
    blocks_to_swap_in: BlockPairs
    blocks_to_copy: BlockPairs


def step_to_json(step: ExecuteStep) -> str:
    body = {
        "step_id": step.step_id,
        "seq_ids": [seq.seq_id for seq in step.seqs],
        "blocks_to_swap_out": step.blocks_to_swap_out,
        "blocks_to_swap_in": step.blocks_to_swap_in,
        "blocks_to_copy": step.blocks_to_copy,
    }
    return orjson.dumps({"version": STEP_VERSION, "step": body}).decode()


def step_from_json(text: str) -> PendingStep:
    """Read a pending step; version 1, which held every sequence whole, gives its ids."""
    data = orjson.loads(text)
    version = data.get("version")
    if version not in (1, STEP_VERSION):
        raise ValueError(f"step state version {version} is not {STEP_VERSION}")
    body = data["step"]
    seq_ids = body["seq_ids"] if version == STEP_VERSION else [s["seq_id"] for s in body["seqs"]]
    pairs = {
        k: [tuple(p) for p in body[k]]
        for k in ("blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy")
    }
    return PendingStep(body["step_id"], seq_ids, **pairs)
