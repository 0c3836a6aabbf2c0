"""JSON forms of what the engine persists: sequence groups with their block tables, and
the step in flight. Versioned; never pickle."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteStep, SeqStep
from scheduler_svc.sequence import Sequence, SequenceGroup, SequenceStatus

SCHEMA_VERSION = 1


@dataclasses.dataclass(slots=True)
class RestoredGroup:
    group: SequenceGroup
    queue: str  # "waiting", "running" or "swapped"
    block_tables: dict[int, tuple[list[int], int]]  # seq_id -> (block ids, slots mapped)


# Field names read once: dataclasses.asdict deep-copies every value and, called for each
# group and each sequence of every step's commit, was most of the scheduler's JSON time.
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_SEQ_FIELDS = tuple(f.name for f in dataclasses.fields(Sequence))
_SEQ_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(SeqStep) if f.name != "sampling_params")


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in _PARAM_FIELDS}


def params_from_dict(data: dict[str, Any]) -> SamplingParams:
    data = dict(data)
    data["stop"] = tuple(data.get("stop", ()))
    data["stop_token_ids"] = tuple(data.get("stop_token_ids", ()))
    return SamplingParams(**data)


def _seq_to_dict(seq: Sequence) -> dict[str, Any]:
    data = {name: getattr(seq, name) for name in _SEQ_FIELDS}
    data["status"] = int(seq.status)
    data["output_top_logprobs"] = [list(top.items()) for top in seq.output_top_logprobs]
    return data


def _seq_from_dict(data: dict[str, Any]) -> Sequence:
    data = dict(data)
    data["status"] = SequenceStatus(data["status"])
    data["output_top_logprobs"] = [dict(map(tuple, top)) for top in data["output_top_logprobs"]]
    return Sequence(**data)


def group_to_json(
    group: SequenceGroup, queue: str, block_tables: dict[int, tuple[list[int], int]]
) -> str:
    return json.dumps(
        {
            "version": SCHEMA_VERSION,
            "request_id": group.request_id,
            "arrival_time": group.arrival_time,
            "num_preemptions": group.num_preemptions,
            "sampling_params": params_to_dict(group.sampling_params),
            "queue": queue,
            "seqs": [_seq_to_dict(seq) for seq in group.seqs],
            "block_tables": {str(k): list(v) for k, v in block_tables.items()},
        }
    )


def group_from_json(text: str) -> RestoredGroup:
    data = json.loads(text)
    if data.get("version") != SCHEMA_VERSION:
        raise ValueError(f"group state version {data.get('version')} is not {SCHEMA_VERSION}")
    group = SequenceGroup(
        data["request_id"],
        [_seq_from_dict(s) for s in data["seqs"]],
        data["arrival_time"],
        params_from_dict(data["sampling_params"]),
        data["num_preemptions"],
    )
    tables = {int(k): (v[0], v[1]) for k, v in data["block_tables"].items()}
    return RestoredGroup(group, data["queue"], tables)


def step_to_json(step: ExecuteStep) -> str:
    params: dict[int, dict[str, Any]] = {}  # a group's sequences share one SamplingParams
    seqs = []
    for seq in step.seqs:
        data = {name: getattr(seq, name) for name in _SEQ_STEP_FIELDS}
        key = id(seq.sampling_params)
        if key not in params:
            params[key] = params_to_dict(seq.sampling_params)
        data["sampling_params"] = params[key]
        seqs.append(data)
    body = {
        "step_id": step.step_id,
        "epoch": step.epoch,
        "seqs": seqs,
        "blocks_to_swap_out": step.blocks_to_swap_out,
        "blocks_to_swap_in": step.blocks_to_swap_in,
        "blocks_to_copy": step.blocks_to_copy,
    }
    return json.dumps({"version": SCHEMA_VERSION, "step": body})


def step_from_json(text: str) -> ExecuteStep:
    data = json.loads(text)
    if data.get("version") != SCHEMA_VERSION:
        raise ValueError(f"step state version {data.get('version')} is not {SCHEMA_VERSION}")
    body = data["step"]
    seqs = [
        SeqStep(**(s | {"sampling_params": params_from_dict(s["sampling_params"])}))
        for s in body["seqs"]
    ]
    pairs = {
        k: [tuple(p) for p in body[k]]
        for k in ("blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy")
    }
    return ExecuteStep(body["step_id"], body["epoch"], seqs, **pairs)
