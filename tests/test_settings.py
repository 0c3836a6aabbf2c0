"""Settings: validation, and the flags and environment variables derived from them."""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys

import pytest

from pagedserve.cli import build_parser
from pagedserve.flags import add_flags, env_name, from_args, to_flags
from pagedserve.model_info import ModelInfo
from pagedserve.settings import (
    CHUNKED_PREFILL_BUDGET,
    SERVING_COMMIT_INTERVAL_S,
    SERVING_DECODE_STEPS_QUIET_S,
    SERVING_MAX_TOKEN_SLOWDOWN,
    ApiConfig,
    EngineOptions,
    ExecutorConfig,
    PreemptionMode,
    RegistrationOptions,
    SchedulerConfig,
    SchedulerOptions,
    TlsOptions,
)

INFO = ModelInfo("m", 100, 16384, 2, block_size=16, num_gpu_blocks=64, num_cpu_blocks=8)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_decode_steps", 0),
        ("decode_steps_quiet_s", -1.0),
        ("decode_steps_quiet_s", math.nan),
        ("decode_steps_span_s", -0.1),
        ("decode_steps_span_s", math.nan),
        ("max_token_slowdown", 0.5),
        ("max_token_slowdown", -1.0),
        ("max_token_slowdown", math.nan),
        ("commit_interval_s", -0.01),
        ("commit_interval_s", math.nan),
        ("ahead_min_share", -0.1),
        ("ahead_min_share", math.nan),
    ],
)
def test_scheduler_config_refuses_a_bad_setting(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan])
def test_finished_requests_must_stay_a_while(value: float) -> None:
    with pytest.raises(ValueError, match="finished_ttl"):
        SchedulerOptions(finished_ttl_s=value)


def test_offline_engines_look_ahead_at_once_and_servers_after_a_quiet_spell() -> None:
    assert SchedulerConfig().decode_steps_quiet_s == 0.0  # every request is there from the start
    for command in ("serve", "scheduler"):
        args = build_parser().parse_args([command])
        quiet = from_args(SchedulerOptions, args).engine.decode_steps_quiet_s
        assert quiet == SERVING_DECODE_STEPS_QUIET_S
        args = build_parser().parse_args([command, "--decode-steps-quiet", "0.5"])
        assert from_args(SchedulerOptions, args).engine.decode_steps_quiet_s == 0.5


def test_offline_engines_admit_at_once_and_servers_pace_the_running_streams() -> None:
    assert SchedulerConfig().max_token_slowdown == 0.0  # only the batch's throughput counts
    for command in ("serve", "scheduler"):
        args = build_parser().parse_args([command])
        engine = from_args(SchedulerOptions, args).engine
        assert engine.max_token_slowdown == SERVING_MAX_TOKEN_SLOWDOWN
        assert engine.configs(INFO)[1].max_token_slowdown == SERVING_MAX_TOKEN_SLOWDOWN
        args = build_parser().parse_args([command, "--max-token-slowdown", "0"])
        assert from_args(SchedulerOptions, args).engine.max_token_slowdown == 0.0


def test_offline_engines_commit_every_call_and_servers_share_commits_of_fast_calls() -> None:
    assert SchedulerConfig().commit_interval_s == 0.0
    for command in ("serve", "scheduler"):
        args = build_parser().parse_args([command])
        engine = from_args(SchedulerOptions, args).engine
        assert engine.configs(INFO)[1].commit_interval_s == SERVING_COMMIT_INTERVAL_S
        args = build_parser().parse_args([command, "--commit-interval", "0"])
        assert from_args(SchedulerOptions, args).engine.configs(INFO)[1].commit_interval_s == 0


def test_the_engine_config_follows_the_executor_and_the_options() -> None:
    cache, scheduler = EngineOptions(max_num_seqs=7, enable_prefix_caching=True).configs(INFO)
    assert (cache.block_size, cache.num_gpu_blocks, cache.num_cpu_blocks) == (16, 64, 8)
    assert cache.enable_prefix_caching and scheduler.max_num_seqs == 7
    # Chunked prefill (the default) splits long prompts: the budget stays one chunk.
    assert scheduler.enable_chunked_prefill
    assert scheduler.max_num_batched_tokens == CHUNKED_PREFILL_BUDGET < INFO.max_model_len
    # Without it a step must hold the longest prompt: the budget grows with the model's limit.
    whole = EngineOptions(enable_chunked_prefill=False)
    assert whole.configs(INFO)[1].max_num_batched_tokens == 16384
    short = dataclasses.replace(INFO, max_model_len=2048)
    assert whole.configs(short)[1].max_num_batched_tokens == 8192


def test_the_window_reaches_the_block_manager_unless_freeing_is_off() -> None:
    sliding = dataclasses.replace(INFO, sliding_window=512)
    assert EngineOptions().configs(sliding)[0].sliding_window == 512
    assert EngineOptions(free_outside_window=False).configs(sliding)[0].sliding_window == 0
    args = build_parser().parse_args(["serve", "--no-free-outside-window"])
    assert not from_args(SchedulerOptions, args).engine.free_outside_window
    with pytest.raises(ValueError, match="without chunked prefill"):
        SchedulerConfig(max_num_batched_tokens=512, enable_chunked_prefill=False)


@pytest.mark.parametrize(
    ("command", "options"),
    [
        ("generate", (ExecutorConfig, EngineOptions)),
        ("executor", (ExecutorConfig, RegistrationOptions)),
        ("scheduler", (ApiConfig, SchedulerOptions, EngineOptions)),
        ("serve", (ApiConfig, SchedulerOptions, EngineOptions, ExecutorConfig)),
    ],
)
def test_every_option_with_a_help_is_a_flag_with_its_default(command: str, options) -> None:
    skipped = {
        # --seed is the requests' own there; the rest apply to requests arriving later
        "generate": {"seed", "decode_steps_quiet_s", "decode_steps_span_s", "max_token_slowdown"},
        "serve": {"executors", "tokenizer", "routing"},  # one executor, started by serve
    }.get(command, set())
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    by_dest = {a.dest: a for a in sub._actions}
    flagged = [f for cls in options for f in dataclasses.fields(cls) if "help" in f.metadata]
    assert {f.name for f in flagged if f.name not in by_dest} == skipped - {"seed"}
    for f in flagged:
        if f.name in skipped or f.name not in by_dest:
            continue
        action = by_dest[f.name]
        assert action.help.replace("%%", "%") == f.metadata["help"]
        if f.default not in (dataclasses.MISSING, ()):
            assert action.default == f.default, f"{command} --{f.name}"


@pytest.mark.parametrize("command", ["generate", "executor", "scheduler", "serve"])
def test_every_command_prints_its_help(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([command, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: pagedserve {command}")


def test_flags_build_the_options() -> None:
    argv = ["scheduler", "--executor", "a:1", "--executor", "b:2", "--store-budget", "5"]
    argv += ["--preemption-mode", "swap", "--enable-prefix-caching", "--max-num-seqs", "9"]
    argv += ["--api-key", "k", "--max-n", "4"]
    args = build_parser().parse_args(argv)
    options = from_args(SchedulerOptions, args)
    assert options.executors == ("a:1", "b:2") and options.store_budget_s == 5.0
    assert options.engine == EngineOptions(
        max_num_seqs=9, preemption_mode=PreemptionMode.SWAP, enable_prefix_caching=True
    )
    assert from_args(ApiConfig, args) == ApiConfig(api_keys=("k",), max_n=4)


@pytest.mark.parametrize(
    "options",
    [
        ExecutorConfig(model="m", dtype="bfloat16", num_gpu_blocks=7),
        EngineOptions(free_outside_window=False),
        EngineOptions(preemption_mode=PreemptionMode.SWAP, enable_prefix_caching=False),
        EngineOptions(decode_steps_quiet_s=0.5, enable_chunked_prefill=True),
        SchedulerOptions(
            executors=("a:1", "b:2"), store_budget_s=5.0, max_queue_wait_s=0.0, finished_ttl_s=90
        ),
        TlsOptions("c.pem", "k.pem", "ca.pem", tls_client_auth=True, tls_http=False),
    ],
)
def test_to_flags_is_read_back_as_the_same_options(options) -> None:
    """What `serve` hands its executor: switches, renamed flags, tuples and enums survive."""
    parser = argparse.ArgumentParser()
    add_flags(parser, type(options))
    assert from_args(type(options), parser.parse_args(to_flags(options))) == options


def test_the_environment_sets_what_the_command_line_leaves(monkeypatch) -> None:
    env = {
        "PAGEDSERVE_API_KEY": "secret,second",
        "PAGEDSERVE_MAX_NUM_SEQS": "12",
        "PAGEDSERVE_ENABLE_PREFIX_CACHING": "true",
        "PAGEDSERVE_EXECUTOR": "a:1,b:2",
        "PAGEDSERVE_PREEMPTION_MODE": "recompute",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["scheduler", "--max-num-seqs", "3"])
    options = from_args(SchedulerOptions, args)
    assert from_args(ApiConfig, args).api_keys == ("secret", "second")
    assert options.executors == ("a:1", "b:2")
    assert options.engine.max_num_seqs == 3  # the command line wins
    assert options.engine.enable_prefix_caching
    assert options.engine.preemption_mode is PreemptionMode.RECOMPUTE
    args = build_parser().parse_args(["scheduler", "--no-enable-prefix-caching"])
    assert not from_args(SchedulerOptions, args).engine.enable_prefix_caching


def test_an_environment_value_that_does_not_parse_is_a_usage_error() -> None:
    env = {"PAGEDSERVE_MAX_NUM_SEQS": "many", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "scheduler", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "PAGEDSERVE_MAX_NUM_SEQS='many'" in done.stderr


def test_env_names_follow_the_flags() -> None:
    assert env_name("--store-budget") == "PAGEDSERVE_STORE_BUDGET"
    assert env_name("--api-key") == "PAGEDSERVE_API_KEY"
