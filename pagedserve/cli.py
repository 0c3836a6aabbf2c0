"""The one entry point, ``pagedserve``; each subcommand imports its service lazily."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GiB = 1 << 30


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
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1, help="completions returned per prompt")
    p.add_argument("--beam-width", type=int, default=None, help="beam search with this width")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--swap-space", type=float, default=1.0, help="GiB")
    p.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None)
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", action="store_true", help="one JSON line per request")
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
    from pagedserve.settings import ExecutorConfig, PreemptionMode

    requests = _read_requests(args)
    llm = OfflineLLM(
        ExecutorConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks,
            swap_space=args.swap_space,
        ),
        preemption_mode=PreemptionMode(args.preemption_mode) if args.preemption_mode else None,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    for result in llm.generate(requests):
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
    p = sub.add_parser("executor", help="serve the model and the paged KV cache over gRPC")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV pool size in blocks")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool size in bytes")
    p.add_argument("--swap-space", type=float, default=1.0, help="CPU swap pool in GiB")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.set_defaults(func=_run_executor)


def _run_executor(args: argparse.Namespace) -> int:
    from executor_svc.server import serve
    from pagedserve.log import configure_logging
    from pagedserve.settings import ExecutorConfig

    configure_logging()
    config = ExecutorConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_memory=args.kv_cache_memory,
        swap_space=args.swap_space,
        max_model_len=args.max_model_len,
    )
    return serve(config, host=args.host, port=args.port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="LLM serving on a paged KV cache (PagedAttention)."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_executor(sub)
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
