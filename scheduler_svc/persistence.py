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


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


def params_from_dict(data: dict[str, Any]) -> SamplingParams:
    data = dict(data)
    data["stop"] = tuple(data.get("stop", ()))
    data["stop_token_ids"] = tuple(data.get("stop_token_ids", ()))
    return SamplingParams(**data)


def _seq_to_dict(seq: Sequence) -> dict[str, Any]:
    data = {f.name: getattr(seq, f.name) for f in dataclasses.fields(seq)}
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
    return json.dumps({"version": SCHEMA_VERSION, "step": dataclasses.asdict(step)})


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
