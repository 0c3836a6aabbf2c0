"""Configuration: one frozen dataclass per concern, validated on construction.

``*Options`` hold what a user sets for one process; each field with a ``help`` is also a
command-line flag and a ``PAGEDSERVE_*`` environment variable (``pagedserve/flags.py``).
``*Config`` are what a component runs on, resolved from options and the executor's answers.
"""

from __future__ import annotations

import enum
import os
import socket
from dataclasses import dataclass, field

from pagedserve.model_info import ModelInfo
from pagedserve.redis_url import check_redis_url


class PreemptionMode(enum.Enum):
    """How a group is evicted when decode slots run out (the paper's §4.5)."""

    SWAP = "swap"
    RECOMPUTE = "recompute"


def _help(text: str, flag: str | None = None, choices: tuple[str, ...] = ()) -> dict[str, object]:
    """Field metadata that makes it a flag: ``--flag`` (default: the field's name)."""
    return {"help": text, "flag": flag, "choices": choices}


@dataclass(frozen=True)
class CacheConfig:
    """Shape of the paged KV cache as the block manager sees it."""

    block_size: int = field(default=16, metadata=_help("tokens per KV block (8-128)"))
    num_gpu_blocks: int = field(default=4096, metadata=_help("blocks in the executor's KV pool"))
    num_cpu_blocks: int = field(default=1024, metadata=_help("blocks in the CPU swap pool"))
    watermark: float = field(
        default=0.01, metadata=_help("fraction of the KV pool kept free at admission")
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_help("reuse computed blocks of identical prompt prefixes")
    )
    sliding_window: int = field(
        default=0,
        metadata=_help(
            "positions every layer attends back from a token, when all slide; blocks wholly "
            "before it go back to the pool (0: keep every block)"
        ),
    )

    def __post_init__(self) -> None:
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if self.num_gpu_blocks < 1 or self.num_cpu_blocks < 0:
            raise ValueError("num_gpu_blocks must be >= 1 and num_cpu_blocks >= 0")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


# A server's decode_steps_quiet_s: requests arriving every second or two (light online
# traffic) keep each call to one step.
SERVING_DECODE_STEPS_QUIET_S = 2.0
# A server's decode_steps_span_s: the tokens of decode steps in a row reach the streams
# together when the call ends, so a call of them lasts at most this long at the recent pace.
# On the CPU (25-33 ms a token at light load) that is 3 or 4 of the 8; a GPU's 5-10 ms keep 8.
SERVING_DECODE_STEPS_SPAN_S = 0.1
# Tokens of one step with chunked prefill. A larger budget prefills arriving prompts in
# bigger batches; a smaller one bounds how long a prompt's step stalls the streams. On the
# CPU, 1024 against vLLM's 2048 halved the streams' longest stalls and kept throughput and
# first tokens (bench/RESULTS.md, 2026-12-07, late morning).
CHUNKED_PREFILL_BUDGET = 1024
# A server's max_token_slowdown: how much slower than an idle executor's a token may get
# before admission holds newcomers back (bench/RESULTS.md, 2026-12-04, ten times the rate).
SERVING_MAX_TOKEN_SLOWDOWN = 4.0
# Requests waiting that say arrivals outpace the executor by far: pacing starts there.
PACING_BACKLOG = 16
# A server's commit_interval_s: calls that only continue streams and come back within it
# share one journal commit. Steps on this CPU take longer, so it changes nothing here; an
# accelerator's few-millisecond steps are then not each followed by a commit's work.
SERVING_COMMIT_INTERVAL_S = 0.025
# A server's ahead_min_share: a call is sent ahead while requests keep arriving only if the
# scheduler's own time per call is at least this share of its wait for the answer. With a
# CPU's steps of tens of milliseconds newcomers then wait one call less (TTFT 7 % lower at
# 1 req/s, bench/RESULTS.md, 2026-12-05, night); the control-plane bench's 5 ms steps still
# send every call ahead (its busy fraction unchanged).
SERVING_AHEAD_MIN_SHARE = 0.1


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets of one engine step and the preemption policy (see EngineOptions)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    preemption_mode: PreemptionMode | None = None
    num_decode_steps: int = 8
    decode_steps_quiet_s: float = 0.0
    decode_steps_span_s: float = 0.0
    enable_chunked_prefill: bool = True
    async_scheduling: bool = True
    max_token_slowdown: float = 0.0
    commit_interval_s: float = 0.0
    ahead_min_share: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.num_decode_steps < 1:
            raise ValueError(f"num_decode_steps must be >= 1, got {self.num_decode_steps}")
        if not self.decode_steps_quiet_s >= 0:  # also refuses NaN
            raise ValueError(f"decode_steps_quiet_s must be >= 0, got {self.decode_steps_quiet_s}")
        if not self.decode_steps_span_s >= 0:
            raise ValueError(f"decode_steps_span_s must be >= 0, got {self.decode_steps_span_s}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not self.commit_interval_s >= 0:  # also refuses NaN
            raise ValueError(f"commit_interval_s must be >= 0, got {self.commit_interval_s}")
        if not self.ahead_min_share >= 0:
            raise ValueError(f"ahead_min_share must be >= 0, got {self.ahead_min_share}")
        if not (self.max_token_slowdown == 0 or self.max_token_slowdown >= 1):  # and NaN
            raise ValueError(
                f"max_token_slowdown must be 0 (off) or >= 1, got {self.max_token_slowdown}"
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) without chunked prefill, or a long prompt "
                "could never run"
            )


@dataclass(frozen=True)
class EngineOptions:
    """What a user tunes of each engine; the rest comes from the executor it drives."""

    max_num_seqs: int = field(default=256, metadata=_help("sequences running at once"))
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=_help(
            "tokens computed in one step (prefill + decode); default: "
            f"{CHUNKED_PREFILL_BUDGET} with chunked prefill, else 8192 or the model's "
            "max_model_len if longer"
        ),
    )
    enable_chunked_prefill: bool = field(
        default=True,
        metadata=_help(
            "compute long prompts in chunks that share each step's token budget with the "
            "running decodes, so that an arriving prompt does not stall every stream"
        ),
    )
    num_decode_steps: int = field(
        default=8,
        metadata=_help(
            "decode steps an executor runs in a row when only decodes are scheduled and "
            "nothing waits (one scheduler round trip and commit for all of them; 1: off)"
        ),
    )
    decode_steps_quiet_s: float = field(
        default=SERVING_DECODE_STEPS_QUIET_S,
        metadata=_help(
            "seconds without a new request before --num-decode-steps apply: while requests "
            "keep arriving each executor call is one step, so a newcomer waits one step",
            flag="decode_steps_quiet",
        ),
    )
    decode_steps_span_s: float = field(
        default=SERVING_DECODE_STEPS_SPAN_S,
        metadata=_help(
            "longest a call of decode steps in a row may take at the pace of the steps before "
            "it: their tokens reach the streams together when it ends, so fewer than "
            "--num-decode-steps run where steps are slow (a CPU's); 0: no bound",
            flag="decode_steps_span",
        ),
    )
    async_scheduling: bool = field(
        default=True,
        metadata=_help(
            "decide and send an executor's next call while it runs the current one, so "
            "that scheduling, applying tokens and the journal overlap the forward pass "
            "(services only; the next call waits when it depends on the current one's tokens)"
        ),
    )
    max_token_slowdown: float = field(
        default=SERVING_MAX_TOKEN_SLOWDOWN,
        metadata=_help(
            f"once {PACING_BACKLOG} requests wait, admit them only while a step takes at most "
            "this many times as long per token as the fastest step seen (an idle executor's), "
            "so that under overload the running streams keep their pace and newcomers wait or "
            "are refused (429); 0: admit whenever sequences and blocks allow"
        ),
    )
    commit_interval_s: float = field(
        default=SERVING_COMMIT_INTERVAL_S,
        metadata=_help(
            "with async scheduling, calls that only continue running streams and come back "
            "within this many seconds of the last journal commit share the next one: with "
            "fast steps the scheduler then does a commit's work for several calls, and their "
            "tokens reach clients up to this much later (a call that starts or ends a request "
            "commits at once; a crash in between loses nothing, the calls are recomputed); "
            "0: commit after every call",
            flag="commit_interval",
        ),
    )
    ahead_min_share: float = field(
        default=SERVING_AHEAD_MIN_SHARE,
        metadata=_help(
            "with async scheduling, while requests keep arriving (one came within "
            "--decode-steps-quiet), send the next call ahead only if the scheduler's own time "
            "per call is at least this share of its wait for the answer: where steps are slow "
            "the overlap gains little, and a request arriving would wait for the call sent "
            "ahead too; 0: always send ahead"
        ),
    )
    preemption_mode: PreemptionMode | None = field(
        default=None,
        metadata=_help("swap or recompute; default: recompute single sequences, swap groups"),
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_help("reuse computed blocks of identical prompt prefixes")
    )
    free_outside_window: bool = field(
        default=True,
        metadata=_help(
            "when every layer of the model attends to a sliding window, return the KV blocks "
            "that lie wholly before it to the pool while the sequence runs"
        ),
    )

    def configs(self, info: ModelInfo) -> tuple[CacheConfig, SchedulerConfig]:
        """The engine's configuration for an executor that answered ``info``."""
        cache = CacheConfig(
            block_size=info.block_size,
            num_gpu_blocks=info.num_gpu_blocks,
            num_cpu_blocks=info.num_cpu_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            sliding_window=info.sliding_window if self.free_outside_window else 0,
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or self._default_budget(info),
            max_model_len=info.max_model_len,
            preemption_mode=self.preemption_mode,
            num_decode_steps=self.num_decode_steps,
            decode_steps_quiet_s=self.decode_steps_quiet_s,
            decode_steps_span_s=self.decode_steps_span_s,
            enable_chunked_prefill=self.enable_chunked_prefill,
            async_scheduling=self.async_scheduling,
            max_token_slowdown=self.max_token_slowdown,
            commit_interval_s=self.commit_interval_s,
            ahead_min_share=self.ahead_min_share,
        )
        return cache, scheduler

    def _default_budget(self, info: ModelInfo) -> int:
        if self.enable_chunked_prefill:
            return CHUNKED_PREFILL_BUDGET
        return max(8192, info.max_model_len)


@dataclass(frozen=True)
class ExecutorConfig:
    """The model and the memory the executor gives its KV pool and swap pool."""

    model: str = field(
        default="SmolLM2-135M-Instruct",
        metadata=_help("default model name, Hugging Face checkpoint directory or .gguf file"),
    )
    dtype: str = field(
        default="auto",
        metadata=_help(
            "weights: auto (float32 on CPU, bfloat16 on GPU), float32, float16 or bfloat16; "
            "on CPU activations, norms and biases stay float32 and only the weights take it"
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_help(
            "KV and swap pools: auto (the activations' dtype), float32, float16 or bfloat16; "
            "16 bits fit twice the blocks in the same memory"
        ),
    )
    device: str = field(default="auto", metadata=_help("auto, cpu or cuda[:N]"))
    block_size: int = field(default=16, metadata=_help("tokens per KV block (8-128)"))
    num_gpu_blocks: int | None = field(
        default=None, metadata=_help("KV pool size in blocks (overrides kv_cache_memory)")
    )
    kv_cache_memory: int | None = field(
        default=None,
        metadata=_help(
            "KV pool size in bytes (per rank); default 1 GiB on CPU, 90% of free GPU memory"
        ),
    )
    swap_space: float = field(default=1.0, metadata=_help("CPU swap pool in GiB (per rank)"))
    max_model_len: int | None = field(
        default=None, metadata=_help("longest sequence; default: the model's own limit")
    )
    seed: int = field(default=0, metadata=_help("seed of sampling requests that carry none"))
    tensor_parallel_size: int = field(
        default=1,
        metadata=_help("worker processes (one per GPU) splitting heads and MLP columns"),
    )

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in ("auto", "float32", "float16", "bfloat16"):
                raise ValueError(
                    f"{name} must be auto, float32, float16 or bfloat16; got {getattr(self, name)}"
                )
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")


@dataclass(frozen=True)
class ApiConfig:
    """The HTTP front door: address, authentication and the limits checked per request."""

    host: str = field(default="127.0.0.1", metadata=_help("address to listen on"))
    port: int = field(default=8000, metadata=_help("HTTP port"))
    api_keys: tuple[str, ...] = field(
        default=(),
        metadata=_help(
            "an accepted API key, repeatable: 'Authorization: Bearer KEY' is then required "
            "on every route but /health, /docs, /openapi.json and the /dashboard page, and "
            "on the gRPC front door. A key on the command line shows in ps: prefer "
            "--api-key-file or PAGEDSERVE_API_KEY=KEY1,KEY2",
            flag="api_key",
        ),
    )
    api_key_file: str | None = field(
        default=None,
        metadata=_help("file of accepted API keys, one a line (# comments), with --api-key's"),
    )
    max_n: int = field(default=16, metadata=_help("largest n (and best_of) accepted"))
    max_prompts: int = field(
        default=64, metadata=_help("most prompts in one /v1/completions request")
    )
    max_logprobs: int = field(default=20, metadata=_help("largest logprobs accepted"))
    max_body_bytes: int = field(default=4 << 20, metadata=_help("largest request body"))
    max_stops: int = field(
        default=16, metadata=_help("most stop strings, and most stop_token_ids, in a request")
    )
    max_messages: int = field(default=1024, metadata=_help("most messages in a chat request"))
    max_requests_per_key: int = field(
        default=256,
        metadata=_help(
            "most completions one API key may have in flight at once (streaming or not; "
            "0: no limit); without keys, --max-waiting-requests alone bounds the queue"
        ),
    )
    executor_budget_s: float = field(
        default=30.0,
        metadata=_help(
            "refuse new requests (503) once the executor is away this many seconds",
            flag="executor_budget",
        ),
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if any(not key or "," in key or key != key.strip() for key in self.api_keys):
            raise ValueError("an API key must be non-empty, without commas or outer spaces")
        limits = (self.max_n, self.max_prompts, self.max_body_bytes, self.max_messages)
        if min(limits) < 1 or min(self.max_logprobs, self.max_stops, self.max_requests_per_key) < 0:
            raise ValueError(
                "max_n, max_prompts, max_body_bytes and max_messages >= 1 and max_logprobs, "
                "max_stops and max_requests_per_key >= 0 required"
            )


REDIS_URL_HELP = (
    "redis:// or rediss:// (TLS) URL: redis[s]://[USER:PASSWORD@]HOST:PORT/DB, USER an ACL "
    "user; ?ssl_ca_certs=PEM (and ssl_certfile, ssl_keyfile) for a private CA. A password "
    "here shows in ps: pass the URL as PAGEDSERVE_STATE_STORE instead"
)


@dataclass(frozen=True)
class TlsOptions:
    """TLS of the gRPC ports a process serves and of the executors a scheduler dials."""

    tls_cert: str | None = field(
        default=None,
        metadata=_help(
            "PEM certificate (chain) this process serves its gRPC port(s) with, and a "
            "scheduler presents to executors as its client certificate"
        ),
    )
    tls_key: str | None = field(default=None, metadata=_help("PEM private key of --tls-cert"))
    tls_ca: str | None = field(
        default=None,
        metadata=_help(
            "PEM CA certificates: an executor then requires client certificates signed by "
            "them (mutual TLS); a scheduler checks executors' certificates against them "
            "(default: the system's roots) and, with --tls-client-auth, its own clients'"
        ),
    )
    tls_client_auth: bool = field(
        default=False,
        metadata=_help(
            "scheduler: its gRPC front door (and HTTP with --tls-http) also requires client "
            "certificates signed by --tls-ca"
        ),
    )
    tls_http: bool = field(
        default=False, metadata=_help("scheduler: serve the HTTP API over TLS with --tls-cert")
    )
    tls_server_name: str | None = field(
        default=None,
        metadata=_help(
            "scheduler: the name executors' certificates must carry (default: the host "
            "dialled; set it where executors register by IP)"
        ),
    )

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if (self.tls_client_auth or self.tls_http) and self.tls_cert is None:
            raise ValueError("--tls-client-auth and --tls-http need --tls-cert and --tls-key")
        if self.tls_client_auth and self.tls_ca is None:
            raise ValueError("--tls-client-auth needs --tls-ca")

    @property
    def dials_tls(self) -> bool:
        """Whether executors are dialled over TLS: with a certificate or a CA to check."""
        return self.tls_cert is not None or self.tls_ca is not None


# What an executor takes of TlsOptions: it always requires client certificates given a CA.
SCHEDULER_ONLY_TLS = ("tls_client_auth", "tls_http", "tls_server_name")


@dataclass(frozen=True)
class SchedulerOptions:
    """The scheduler process: where its executors and its state are, and how it leads."""

    executors: tuple[str, ...] = field(
        default=(),
        metadata=_help(
            "executor HOST:PORT, repeatable; default: the executors registered in "
            "--state-store, else 127.0.0.1:50051",
            flag="executor",
        ),
    )
    tokenizer: str | None = field(default=None, metadata=_help("default: the executor's model"))
    chat_template: str | None = field(
        default=None,
        metadata=_help("a Jinja chat template file, instead of the one the tokenizer ships"),
    )
    generation_config: str = field(
        default="auto",
        metadata=_help(
            "defaults for the sampling fields a request leaves out: 'auto' takes the "
            "generation_config.json beside the tokenizer (as vLLM does), 'vllm' only the "
            "built-in ones, or a directory holding a generation_config.json"
        ),
    )
    routing: str = field(
        default="prefix",
        metadata=_help(
            "how a new request picks among several executors: the one holding the longest "
            "prefix of its prompt, then the most free blocks; or each in turn",
            choices=("prefix", "round-robin"),
        ),
    )
    state_store: str | None = field(
        default=None,
        metadata=_help("Redis to survive restarts; default: in this process. A " + REDIS_URL_HELP),
    )
    namespace: str = field(default="pagedserve", metadata=_help("Redis key prefix"))
    lease_ttl: float = field(
        default=3.0,
        metadata=_help(
            "with --state-store: seconds before a standby replica takes over from a silent "
            "engine leader"
        ),
    )
    finished_ttl_s: float = field(
        default=3600.0,
        metadata=_help(
            "seconds a finished request's events and record stay in the state store, for "
            "Last-Event-ID resumes and retries of its id: the store holds this many seconds' "
            "worth of finished requests",
            flag="finished_ttl",
        ),
    )
    store_budget_s: float = field(
        default=30.0,
        metadata=_help(
            "seconds a stream waits out an unreachable --state-store before it ends with an "
            "error event (the request goes on; resume it with Last-Event-ID)",
            flag="store_budget",
        ),
    )
    grpc_port: int | None = field(
        default=None, metadata=_help("also serve the gRPC Generate front door on this port")
    )
    max_waiting_requests: int = field(
        default=1024,
        metadata=_help("requests that may wait for a first step; beyond, 429 with Retry-After"),
    )
    max_waiting_tokens: int = field(
        default=1 << 20,
        metadata=_help("prompt tokens that may wait for a first step; beyond, 429"),
    )
    max_queue_wait_s: float = field(
        default=60.0,
        metadata=_help(
            "seconds a new request may expect to wait for its first step, at the rate "
            "requests leave the queue; beyond, 429 with Retry-After (0: no bound)",
            flag="max_queue_wait",
        ),
    )
    connect_timeout_s: float = field(
        default=600.0,
        metadata=_help(
            "seconds to wait for an executor to answer (it may still be loading its model)",
            flag="connect_timeout",
        ),
    )
    engine: EngineOptions = field(default_factory=EngineOptions)
    tls: TlsOptions = field(default_factory=TlsOptions)

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1 or self.max_waiting_tokens < 1:
            raise ValueError("max_waiting_requests and max_waiting_tokens must be >= 1")
        if not self.max_queue_wait_s >= 0:
            raise ValueError("max_queue_wait must be >= 0")
        if not self.finished_ttl_s > 0:
            raise ValueError("finished_ttl must be > 0")
        if self.state_store is not None:
            check_redis_url(self.state_store)


@dataclass(frozen=True)
class RegistrationOptions:
    """Where and how an executor registers for schedulers to find it."""

    state_store: str = field(
        metadata=_help(
            "Redis to register in for schedulers to find (and drain on SIGTERM); default: "
            "no registration, schedulers dial --executor. A " + REDIS_URL_HELP
        )
    )
    namespace: str = field(default="pagedserve", metadata=_help("Redis key prefix"))
    advertise_address: str = field(
        default="", metadata=_help("HOST:PORT schedulers dial; default: --host:--port")
    )
    drain_timeout_s: float = field(
        default=60.0,
        metadata=_help(
            "seconds a SIGTERM'd executor keeps serving its requests before it exits",
            flag="drain_timeout",
        ),
    )
    heartbeat_ttl_s: float = 3.0

    def __post_init__(self) -> None:
        check_redis_url(self.state_store)

    def address(self, host: str, port: int) -> str:
        """The address to register: the advertised one, else the listen address (a
        wildcard listen address is replaced by this host's IP)."""
        if self.advertise_address:
            return self.advertise_address
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = socket.gethostbyname(socket.gethostname())
        return f"{host}:{port}"


CRASH_POINTS = ("before_persist", "after_send", "after_persist", "after_execute")


def crash_point() -> tuple[str, int] | None:
    """``PAGEDSERVE_CRASH_AT=where:step`` (tests only): kill -9 the scheduler at a step
    boundary — ``before_persist``, ``after_send`` (sent to the executor, not journaled),
    ``after_persist`` or ``after_execute`` of step N (``after_persist``: of the first step
    from N on that commits, when calls share commits)."""
    value = os.environ.get("PAGEDSERVE_CRASH_AT")
    if not value:
        return None
    where, _, step = value.partition(":")
    if where not in CRASH_POINTS or not step.isdigit():
        raise ValueError(f"PAGEDSERVE_CRASH_AT must be WHERE:STEP, got {value!r}")
    return where, int(step)
