"""The serving benchmark: Poisson arrivals send fresh requests at every rate, and a real
`pagedserve serve` answers every streamed request within the bounds."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import serving, vllm_client
from bench.common import load_trace, percentile, poisson_arrivals, round_orders
from bench.serving import RequestRecord, parse_args, rate_traces, summarize

ROOT = Path(__file__).resolve().parents[2]


def test_arrivals_scale_with_the_rate() -> None:
    slow, fast = poisson_arrivals(50, 1.0, seed=3), poisson_arrivals(50, 4.0, seed=3)
    assert fast == pytest.approx([t / 4 for t in slow])
    assert all(b > a for a, b in itertools.pairwise(slow))
    assert 30 < slow[-1] < 75  # 50 unit-mean gaps


def test_each_rate_sends_prompts_of_its_own() -> None:
    """A rate replaying the prompts of the one before would find them in the prefix cache."""
    args = parse_args(["--preset=alpaca", "--rates=2,0.5,1", "--num-requests=6"])
    traces = rate_traces(args)
    assert list(traces) == [0.5, 1.0, 2.0]
    prompts = [tuple(map(tuple, t.prompts)) for t in traces.values()]
    assert len(set(prompts)) == 3 and rate_traces(args)[1.0].prompts == traces[1.0].prompts


def test_summary_of_one_rate() -> None:
    records = [
        RequestRecord(True, output_tokens=11, ttft=0.5, e2e=1.5, finished_at=2.0),
        RequestRecord(True, output_tokens=5, ttft=0.2, e2e=1.0, finished_at=4.0),
        RequestRecord(False, error="timed out (cancelled after --drain)"),
    ]
    s = summarize(records, elapsed=4.0, num_planned=3)
    assert (s["sent"], s["completed"], s["failed"], s["timed_out"]) == (3, 2, 1, 1)
    assert s["throughput_req_s"] == 0.5 and s["output_tokens_per_s"] == 4.0
    assert s["tpot_s"]["p50"] == pytest.approx((0.1 + 0.2) / 2)
    assert s["normalized_latency_s_per_token"] == pytest.approx((1.5 / 11 + 1.0 / 5) / 2, 1e-3)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def test_serving_sweep_end_to_end(tmp_path: Path, tiny_chat_model_dir: Path) -> None:
    out = tmp_path / "serving.json"
    cmd = [sys.executable, str(ROOT / "bench/serving.py"), f"--model={tiny_chat_model_dir}"]
    cmd += ["--preset=alpaca", "--rates=2,8", "--num-requests=4", "--max-model-len=64"]
    cmd += ["--duration=20", "--drain=60", "--num-gpu-blocks=128", "--swap-space=0.05"]
    cmd.append(f"--json={out}")
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pagedserve @2" in done.stdout and "in-process @8" in done.stdout
    assert "norm. s/tok" in done.stdout
    systems = json.loads(out.read_text())["systems"]
    assert "--vllm-python" in systems["vllm"]["skipped"]
    assert (
        list(systems["pagedserve"]["rates"]) == list(systems["in-process"]["rates"]) == ["2", "8"]
    )
    for r in [*systems["pagedserve"]["rates"].values(), *systems["in-process"]["rates"].values()]:
        assert (r["completed"], r["failed"]) == (4, 0)
        assert 0 < r["ttft_s"]["p50"] <= r["e2e_s"]["p99"]
        assert r["tpot_s"]["p50"] > 0 and r["output_tokens_per_s"] > 0
        assert 0 < r["normalized_latency_s_per_token"] < r["e2e_s"]["p99"]
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_vllm_client_result_summary() -> None:
    result = {"duration": 61.2, "completed": 80, "failed": 0, "output_throughput": 167.281}
    result |= {"mean_ttft_ms": 810.78, "p99_ttft_ms": 2136.2, "mean_tpot_ms": 307.561}
    result |= {"p99_tpot_ms": 338.67, "p50_itl_ms": 300.28, "p99_itl_ms": 910.78}
    s = vllm_client.summarize(result)
    assert (s["completed"], s["failed"], s["output_tokens_per_s"]) == (80, 0, 167.28)
    assert s["ttft_ms"] == {"mean": 810.78, "p99": 2136.2}
    assert s["tpot_ms"] == {"mean": 307.56, "p99": 338.67}
    dataset = vllm_client.random_dataset(256, 128)
    flags = vllm_client.client_args("http://h:1", "m", Path("/t"), 2.0, 80, dataset, 3)
    assert flags[flags.index("--request-rate") + 1] == "2"
    assert flags[flags.index("--seed") + 1] == "3"
    assert "--ignore-eos" in flags and flags[flags.index("--random-input-len") + 1] == "256"
    assert flags[flags.index("--num-warmups") + 1] == str(vllm_client.WARMUPS)
    assert flags[flags.index("--random-prefix-len") + 1] == "0"
    shared = vllm_client.random_dataset(64, 128, prefix_len=192)
    assert shared[shared.index("--random-prefix-len") + 1] == "192"
    assert "errors" not in s


def test_a_failed_request_says_why(capsys) -> None:
    """vLLM's client keeps each failed request's error (a traceback, or the HTTP reason):
    the summary keeps each distinct one's last line, and the table shows them."""
    traceback = "Traceback (most recent call last):\n  File ...\naiohttp.ServerDisconnectedError: x"
    result = {"duration": 60.0, "completed": 78, "failed": 2, "output_throughput": 100.0}
    result |= {"errors": ["", traceback, traceback, "Too Many Requests"]}
    s = vllm_client.summarize(result)
    assert s["errors"] == ["Too Many Requests", "aiohttp.ServerDisconnectedError: x"]
    serving.print_client_results({"pagedserve": {"rates": {"1": s}}})
    assert "failed: Too Many Requests; aiohttp.ServerDisconnectedError" in capsys.readouterr().out


def test_a_client_run_that_fails_or_overruns_says_why(tmp_path: Path, capsys) -> None:
    """Its rate is reported as skipped with the reason; the rates measured before it stay."""
    with pytest.raises(RuntimeError, match="vLLM's client failed"):
        vllm_client.run_client(sys.executable, ["--no-such-flag"], timeout=60)
    sleeper = tmp_path / "python"
    sleeper.write_text("#!/bin/sh\nsleep 30\n")
    sleeper.chmod(0o755)
    with pytest.raises(RuntimeError, match="still running after 1 s"):
        vllm_client.run_client(str(sleeper), [], timeout=1)
    measured = {"completed": 80, "failed": 0, "elapsed_s": 61.2, "output_tokens_per_s": 167.3}
    measured |= {"ttft_ms": {"mean": 810.8, "p99": 2136.2}, "itl_ms": {"p99": 910.8}}
    measured |= {"tpot_ms": {"mean": 307.6, "p99": 338.7}}
    rates = {"1": measured, "2": {"skipped": "failed: still running", "failed": True}}
    systems = {"pagedserve": {"rates": rates | {"3": {"skipped": "not run: 2 req/s failed"}}}}
    serving.print_client_results(systems)
    table = capsys.readouterr().out
    assert "167.3" in table and "failed: still running" in table and "not run: 2 req/s" in table
    serving.plot_client(systems, tmp_path / "plot.png", "client")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_a_client_run_keeps_its_whole_result_when_asked(tmp_path: Path) -> None:
    """--client-details: the client is asked for every request's timings, and its result
    file is kept whole beside the summary."""
    client = tmp_path / "python"  # writes what vLLM's client would, where it is told
    client.write_text(
        "#!/bin/sh\n"
        'while [ "$1" != --result-dir ]; do shift; done\n'
        'case "$*" in *--save-detailed*) ttfts=\'"ttfts": [0.25, 0.5], \';; esac\n'
        'echo "{$ttfts\\"duration\\": 2.0, \\"completed\\": 2, \\"output_throughput\\": 10.0}" '
        '> "$2/result.json"\n'
    )
    client.chmod(0o755)
    details = tmp_path / "details" / "pagedserve-1.json"
    summary = vllm_client.run_client(str(client), [], timeout=60, details=details)
    assert (summary["completed"], summary["output_tokens_per_s"]) == (2, 10.0)
    assert json.loads(details.read_text())["ttfts"] == [0.25, 0.5]
    assert "ttfts" not in vllm_client.summarize(json.loads(details.read_text()))


def test_vllm_client_sharegpt_file_keeps_the_trace_lengths(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from pagedserve.model_files import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("SmolLM2-135M-Instruct"))
    trace = load_trace("sharegpt", 12, 992, 0)
    flags = vllm_client.sharegpt_dataset(trace, tokenizer, tmp_path / "sharegpt.json")
    assert flags[flags.index("--dataset-name") + 1] == "sharegpt"
    entries = json.loads(Path(flags[flags.index("--dataset-path") + 1]).read_text())
    assert len(entries) == trace.num_requests
    for entry, prompt_len, output_len in zip(
        entries, trace.prompt_lens, trace.output_lens, strict=True
    ):
        human, gpt = (turn["value"] for turn in entry["conversations"])
        # Text tokenizes back to at most, and about, as many tokens as the trace's ids.
        for text, length in ((human, prompt_len), (gpt, output_len)):
            tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
            assert length - max(4, length // 10) <= tokens <= length


def test_vllm_client_without_its_venv_skips_every_system(tmp_path: Path) -> None:
    out = tmp_path / "serving_vllm_client.json"
    cmd = [sys.executable, str(ROOT / "bench/serving.py"), "--client=vllm", f"--json={out}"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    systems = json.loads(out.read_text())["systems"]
    assert all("--vllm-python" in s["skipped"] for s in systems.values())
    assert "TPOT p99 ms" in done.stdout and out.with_suffix(".png").exists()


def test_systems_are_chosen_by_name() -> None:
    assert serving.parse_args(["--systems", "pagedserve"]).systems == ["pagedserve"]
    with pytest.raises(SystemExit):
        serving.parse_args(["--systems", "pagedserve,tgi"])


def test_a_shared_prefix_is_for_random_prompts_only() -> None:
    assert serving.parse_args(["--client", "vllm", "--prefix-len", "192"]).prefix_len == 192
    with pytest.raises(SystemExit):
        serving.parse_args(["--client-dataset", "sharegpt", "--prefix-len", "192"])


def _figures(tok_s: float, ttft_p99: float, tpot: float, failed: int = 0) -> dict:
    return {
        "completed": 80 - failed,
        "failed": failed,
        "elapsed_s": 60.0,
        "output_tokens_per_s": tok_s,
        "ttft_ms": {"mean": ttft_p99 / 2, "p99": ttft_p99},
        "tpot_ms": {"mean": tpot, "p99": tpot * 1.5},
        "itl_ms": {"p50": tpot, "p99": tpot * 4, "extra": None},
    }


def test_rounds_take_turns_and_combine_into_medians() -> None:
    """--rounds: the order reverses each round; each figure is the median of the rounds
    that measured its rate, failures are all counted, and every round is kept."""
    assert round_orders(["pagedserve", "vllm"], 3) == [
        ["pagedserve", "vllm"],
        ["vllm", "pagedserve"],
        ["pagedserve", "vllm"],
    ]
    failed_rate = {"skipped": "failed: still running", "failed": True}
    rounds = [
        {"rates": {"1": _figures(100.0, 1000.0, 40.0), "3": _figures(200.0, 4000.0, 250.0)}},
        {
            "rates": {
                "1": _figures(120.0, 1400.0, 50.0, failed=1) | {"errors": ["Disconnected"]},
                "3": failed_rate,
            }
        },
        {"rates": {"1": _figures(110.0, 1100.0, 60.0), "3": _figures(210.0, 5000.0, 270.0)}},
    ]
    combined = serving.combine_rounds(rounds)
    one, three = combined["rates"]["1"], combined["rates"]["3"]
    assert (one["output_tokens_per_s"], one["ttft_ms"]["p99"], one["tpot_ms"]["mean"]) == (
        110.0,
        1100.0,
        50.0,
    )
    assert (one["failed"], one["rounds"], one["itl_ms"]["extra"]) == (1, 3, None)
    assert one["errors"] == ["Disconnected"] and "errors" not in three
    assert (one["completed"], three["completed"], three["failed"]) == (239, 160, 0)
    assert (three["output_tokens_per_s"], three["tpot_ms"]["p99"], three["rounds"]) == (
        205.0,
        390.0,
        2,
    )
    assert combined["rounds"] == rounds
    assert serving.combine_rounds(rounds[:1]) is rounds[0]
    skipped = [{"skipped": "no venv"}, {"skipped": "no venv"}]
    assert serving.combine_rounds(skipped)["skipped"] == "no venv"


def test_ratios_pair_each_round_side_by_side() -> None:
    ours = [{"rates": {"3": _figures(220.0, 4000.0, 240.0)}}, {"skipped": "failed: boom"}]
    theirs = [{"rates": {"3": _figures(200.0, 5000.0, 300.0)}}, {"rates": {"3": _figures(1, 1, 1)}}]
    rows = serving.ratio_rows({"pagedserve": ours, "vllm": theirs})
    assert rows == [["3 req/s, round 1", "1.10x", "0.80x", "0.80x", "0.80x", "0.80x"]]
    assert serving.ratio_rows({"pagedserve": ours}) == []
    no_itl = _figures(200.0, 5000.0, 300.0)
    no_itl["itl_ms"]["p99"] = None  # the client reports none for one-token answers
    rows = serving.ratio_rows({"pagedserve": ours[:1], "vllm": [{"rates": {"3": no_itl}}]})
    assert rows[0][-1] == "-"
    with pytest.raises(SystemExit):
        serving.parse_args(["--rounds", "2"])  # our client: one pass of each system
    assert serving.parse_args(["--client", "vllm", "--rounds", "2"]).rounds == 2
