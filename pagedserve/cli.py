"""The one entry point, ``pagedserve``; each subcommand imports its service lazily."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pagedserve.settings import SERVING_DECODE_STEPS_QUIET_S, SchedulerConfig


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="run the engine in this process on prompts, offline")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt, sent as plain text")
    src.add_argument(
        "--prompts-file",
        type=Path,
        help='JSON lines: {"prompt": ..., "chat": bool} or {"prompt_token_ids": [...]}, '
        'optionally "max_tokens"',
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1, help="completions returned per prompt")
    p.add_argument("--beam-width", type=int, default=None, help="beam search with this width")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON line per request")
    _add_executor_flags(p)
    _add_engine_flags(p)
    p.set_defaults(func=_run_generate)


def _read_requests(args: argparse.Namespace) -> list:
    from pagedserve.offline import Request
    from pagedserve.sampling_params import SamplingParams

    def params(max_tokens: int) -> SamplingParams:
        beam = args.beam_width is not None
        return SamplingParams(
            n=args.n,
            best_of=args.beam_width if beam else None,
            use_beam_search=beam,
            temperature=0.0 if beam else args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            max_tokens=max_tokens,
            ignore_eos=args.ignore_eos,
        )

    if args.prompt is not None:
        return [Request("0", prompt=args.prompt, params=params(args.max_tokens))]
    requests = []
    for line_no, line in enumerate(args.prompts_file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{args.prompts_file}:{line_no}: not JSON ({e})") from None
        requests.append(
            Request(
                str(item.get("id", len(requests))),
                prompt=item.get("prompt"),
                prompt_token_ids=item.get("prompt_token_ids"),
                chat=bool(item.get("chat", False)),
                params=params(int(item.get("max_tokens", args.max_tokens))),
            )
        )
    return requests


def _run_generate(args: argparse.Namespace) -> int:
    from pagedserve.offline import OfflineLLM
    from pagedserve.settings import PreemptionMode

    requests = _read_requests(args)
    llm = OfflineLLM(
        _executor_config(args),
        preemption_mode=PreemptionMode(args.preemption_mode) if args.preemption_mode else None,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        num_decode_steps=args.num_decode_steps,
    )
    try:
        results = llm.generate(requests)
    finally:
        llm.close()
    for result in results:
        if args.json:
            outputs = [
                {
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "cumulative_logprob": c.cumulative_logprob,
                }
                for c in result.outputs
            ]
            print(json.dumps({"id": result.request_id, "outputs": outputs}))
        else:
            for index, c in enumerate(result.outputs):
                print(f"[{result.request_id}.{index}] ({c.finish_reason}) {c.text}")
    return 0


def _add_executor_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="SmolLM2-135M-Instruct",
        help="default model name, checkpoint directory or .gguf file",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV pool size in blocks")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool size in bytes")
    p.add_argument("--swap-space", type=float, default=1.0, help="CPU swap pool in GiB")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over N worker processes (one GPU each); N divides the heads",
    )


def _executor_config(args: argparse.Namespace):  # -> ExecutorConfig, imported lazily
    from pagedserve.settings import ExecutorConfig

    return ExecutorConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_memory=args.kv_cache_memory,
        swap_space=args.swap_space,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--num-decode-steps",
        type=int,
        default=SchedulerConfig.num_decode_steps,
        help="decode steps run in a row per executor call when nothing waits (1: off)",
    )
    p.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None)
    p.add_argument("--enable-prefix-caching", action="store_true")


def _add_executor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("executor", help="serve the model and the paged KV cache over gRPC")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument(
        "--state-store",
        default=None,
        help="redis://HOST:PORT/DB: register there for schedulers to find (and drain on "
        "SIGTERM); default: no registration, schedulers dial --executor",
    )
    p.add_argument("--namespace", default="pagedserve", help="Redis key prefix")
    p.add_argument(
        "--advertise-address",
        default=os.environ.get("PAGEDSERVE_ADVERTISE_ADDRESS", ""),
        help="HOST:PORT schedulers dial (env PAGEDSERVE_ADVERTISE_ADDRESS); default: --host:--port",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds a SIGTERM'd executor keeps serving its requests before it exits",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9100,
        help="serve Prometheus metrics on this port (0: off)",
    )
    _add_executor_flags(p)
    p.set_defaults(func=_run_executor)


def _run_executor(args: argparse.Namespace) -> int:
    from executor_svc.server import serve
    from pagedserve.log import configure_logging

    configure_logging()
    registration = None
    if args.state_store is not None:
        from executor_svc.registration import RegistrationOptions

        registration = RegistrationOptions(
            state_store=args.state_store,
            namespace=args.namespace,
            advertise_address=args.advertise_address,
            drain_timeout_s=args.drain_timeout,
        )
    return serve(
        _executor_config(args),
        host=args.host,
        port=args.port,
        registration=registration,
        metrics_port=args.metrics_port,
    )


def _add_api_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument(
        "--state-store",
        default=None,
        help="redis://HOST:PORT/DB to survive restarts; default: in this process",
    )
    p.add_argument("--namespace", default="pagedserve", help="Redis key prefix")
    p.add_argument(
        "--store-budget",
        type=float,
        default=30.0,
        help="seconds a stream waits out an unreachable --state-store before it ends with "
        "an error event (the request goes on; resume it with Last-Event-ID)",
    )
    p.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="also serve the gRPC Generate front door on this port",
    )
    p.add_argument(
        "--decode-steps-quiet",
        type=float,
        default=SERVING_DECODE_STEPS_QUIET_S,
        help="seconds without a new request before --num-decode-steps apply: while "
        "requests keep arriving each executor call is one step (shorter waits to start)",
    )
    _add_engine_flags(p)


def _add_scheduler(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scheduler", help="run the engine loop and the OpenAI-compatible API")
    p.add_argument(
        "--executor",
        action="append",
        default=None,
        help="executor HOST:PORT, repeatable; default: the executors registered in "
        "--state-store, else 127.0.0.1:50051",
    )
    p.add_argument("--tokenizer", default=None, help="default: the executor's model")
    p.add_argument(
        "--routing",
        choices=["prefix", "round-robin"],
        default="prefix",
        help="how a new request picks among several executors: the one holding the longest "
        "prefix of its prompt, then the most free blocks; or each in turn",
    )
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=3.0,
        help="with --state-store: seconds before a standby replica takes over from a "
        "silent engine leader",
    )
    _add_api_flags(p)
    p.set_defaults(func=_run_scheduler)


def _scheduler_options(args: argparse.Namespace, executors: list[str]):
    from pagedserve.settings import PreemptionMode
    from scheduler_svc.service import SchedulerOptions

    return SchedulerOptions(
        executors=tuple(executors),
        tokenizer=getattr(args, "tokenizer", None),
        max_num_seqs=args.max_num_seqs,
        num_decode_steps=args.num_decode_steps,
        decode_steps_quiet_s=args.decode_steps_quiet,
        preemption_mode=PreemptionMode(args.preemption_mode) if args.preemption_mode else None,
        enable_prefix_caching=args.enable_prefix_caching,
        state_store=args.state_store,
        namespace=args.namespace,
        grpc_port=args.grpc_port,
        lease_ttl=getattr(args, "lease_ttl", 3.0),
        store_budget_s=args.store_budget,
        routing=getattr(args, "routing", "prefix"),
    )


def _run_scheduler(args: argparse.Namespace) -> int:
    import asyncio

    from pagedserve.log import configure_logging
    from pagedserve.settings import ApiConfig
    from scheduler_svc.service import serve

    configure_logging()
    api = ApiConfig(host=args.host, port=args.port, api_key=args.api_key)
    return asyncio.run(serve(_scheduler_options(args, args.executor or []), api))


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="executor and scheduler together on this machine")
    p.add_argument("--executor-port", type=int, default=50051)
    p.add_argument(
        "--executor-metrics-port",
        type=int,
        default=9100,
        help="the executor's Prometheus metrics port (0: off)",
    )
    _add_api_flags(p)
    _add_executor_flags(p)
    p.set_defaults(func=_run_serve)


# libgomp's spins before an idle OpenMP worker sleeps, for the executor `serve` starts. At the
# default (300,000) the executor's worker spun on for milliseconds after each step, on a core the
# scheduler, Redis and the clients on the same machine needed while the step's results went
# round; 20,000 still spans the gaps between one step's parallel regions. sharegpt-60 through
# `bench/throughput.py --systems services`, alternating: 105.7 and 102.7 s at the default,
# 94.1 and 98.1 s at 20,000. An executor on its own machine has no one to yield to.
SERVE_GOMP_SPINCOUNT = "20000"


def executor_environ(environ: dict[str, str]) -> dict[str, str]:
    """The environment of the executor `serve` starts: ``environ`` with SERVE_GOMP_SPINCOUNT
    unless it sets GOMP_SPINCOUNT itself."""
    return {"GOMP_SPINCOUNT": SERVE_GOMP_SPINCOUNT, **environ}


def _run_serve(args: argparse.Namespace) -> int:
    """Start the executor as a child process, then the scheduler here; stop both together."""
    import subprocess

    flags = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(_executor_config(args)).items()
        if v is not None and k != "seed"
    ]
    executor = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedserve.cli",
            "executor",
            "--port",
            str(args.executor_port),
            f"--metrics-port={args.executor_metrics_port}",
            *flags,
        ],
        env=executor_environ(dict(os.environ)),
    )
    try:
        return _run_scheduler(
            argparse.Namespace(**vars(args), executor=[f"127.0.0.1:{args.executor_port}"])
        )
    finally:
        executor.terminate()
        executor.wait(timeout=30)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="LLM serving on a paged KV cache (PagedAttention)."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_executor(sub)
    _add_scheduler(sub)
    _add_serve(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pagedserve {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
