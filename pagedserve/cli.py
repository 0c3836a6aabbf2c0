"""The one entry point, ``pagedserve``; each subcommand imports its service lazily."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pagedserve.flags import add_flags, apply_environment, from_args, to_flags
from pagedserve.settings import (
    SCHEDULER_ONLY_TLS,
    ApiConfig,
    EngineOptions,
    ExecutorConfig,
    RegistrationOptions,
    SchedulerOptions,
    TlsOptions,
)


def _command(sub: argparse._SubParsersAction, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand whose --help shows the defaults."""
    return sub.add_parser(
        name, help=summary, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "generate", "run the engine in this process on prompts, offline")
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
    add_flags(p, ExecutorConfig, skip=("seed",))  # --seed is the requests' own here
    # nothing arrives later, and no stream is read while the batch runs
    add_flags(
        p, EngineOptions, skip=("decode_steps_quiet_s", "decode_steps_span_s", "max_token_slowdown")
    )
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

    requests = _read_requests(args)
    llm = OfflineLLM(from_args(ExecutorConfig, args), from_args(EngineOptions, args))
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


def _add_executor(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "executor", "serve the model and the paged KV cache over gRPC")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=50051, help="gRPC port")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9100,
        help="serve Prometheus metrics on this port (0: off)",
    )
    add_flags(p, RegistrationOptions)
    add_flags(p, ExecutorConfig)
    add_flags(p, TlsOptions, skip=SCHEDULER_ONLY_TLS)
    p.set_defaults(func=_run_executor)


def _run_executor(args: argparse.Namespace) -> int:
    from executor_svc.server import serve
    from pagedserve.log import configure_logging

    configure_logging()
    registration = None
    if args.state_store is not None:
        registration = from_args(RegistrationOptions, args)
    return serve(
        from_args(ExecutorConfig, args),
        host=args.host,
        port=args.port,
        registration=registration,
        metrics_port=args.metrics_port,
        tls=from_args(TlsOptions, args),
    )


def _add_scheduler(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "scheduler", "run the engine loop and the OpenAI-compatible API")
    add_flags(p, ApiConfig)
    add_flags(p, SchedulerOptions)
    add_flags(p, EngineOptions)
    add_flags(p, TlsOptions)
    p.set_defaults(func=_run_scheduler)


def _run_scheduler(args: argparse.Namespace) -> int:
    import asyncio

    from pagedserve.log import configure_logging
    from scheduler_svc.service import serve

    configure_logging()
    return asyncio.run(serve(from_args(SchedulerOptions, args), from_args(ApiConfig, args)))


def _add_probe(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "probe", "exit 0 if an executor answers gRPC health (a health check)")
    p.add_argument("address", nargs="?", default="127.0.0.1:50051", help="executor HOST:PORT")
    p.add_argument(
        "--serving", action="store_true", help="also require SERVING (its pools allocated)"
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    add_flags(p, TlsOptions, skip=("tls_client_auth", "tls_http"))
    p.set_defaults(func=_run_probe)


def _run_probe(args: argparse.Namespace) -> int:
    """Standard gRPC health of the executor at ``args.address``, over TLS as a scheduler
    would dial it; 1 if it does not answer (or, with --serving, is not SERVING)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pagedserve.rpc.tls import executor_channel

    with executor_channel(args.address, from_args(TlsOptions, args), options=()) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=args.timeout
            )
        except grpc.RpcError as e:
            print(f"pagedserve probe: {args.address}: {e.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" or not args.serving else 1


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "serve", "executor and scheduler together on this machine")
    p.add_argument("--executor-port", type=int, default=50051, help="the executor's gRPC port")
    p.add_argument(
        "--executor-metrics-port",
        type=int,
        default=9100,
        help="the executor's Prometheus metrics port (0: off)",
    )
    add_flags(p, ApiConfig)
    add_flags(p, SchedulerOptions, skip=("executors", "tokenizer", "routing"))
    add_flags(p, EngineOptions)
    add_flags(p, ExecutorConfig)
    add_flags(p, TlsOptions)
    p.set_defaults(func=_run_serve)


# libgomp's spins before an idle OpenMP worker sleeps, for the executor `serve` starts. At the
# default the executor's idle worker keeps spinning after each step, on a core the scheduler,
# Redis and the clients on the same machine need while the step's results go round; 20,000
# still spans the gaps between one step's parallel regions. An executor on its own machine has
# no one to yield to.
SERVE_GOMP_SPINCOUNT = "20000"


def executor_environ(environ: dict[str, str]) -> dict[str, str]:
    """The environment of the executor `serve` starts: ``environ`` with SERVE_GOMP_SPINCOUNT
    unless it sets GOMP_SPINCOUNT itself."""
    return {"GOMP_SPINCOUNT": SERVE_GOMP_SPINCOUNT, **environ}


def _run_serve(args: argparse.Namespace) -> int:
    """Start the executor as a child process, then the scheduler here; stop both together."""
    import subprocess

    config, tls = from_args(ExecutorConfig, args), from_args(TlsOptions, args)
    flags = to_flags(config) + to_flags(tls, skip=SCHEDULER_ONLY_TLS)
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
            argparse.Namespace(**vars(args), executors=[f"127.0.0.1:{args.executor_port}"])
        )
    finally:
        executor.terminate()
        executor.wait(timeout=30)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="LLM serving on a paged KV cache (PagedAttention).",
        epilog="Every flag can also be set by an environment variable named after it: "
        "--max-num-seqs by PAGEDSERVE_MAX_NUM_SEQS, --api-key by PAGEDSERVE_API_KEY.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_executor(sub)
    _add_scheduler(sub)
    _add_serve(sub)
    _add_probe(sub)
    apply_environment(parser, os.environ)
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
