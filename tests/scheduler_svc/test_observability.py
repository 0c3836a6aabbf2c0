"""Observability over real processes (`pagedserve serve` on the tiny model, a pool small
enough to preempt): the scheduler's /metrics, its request log lines, the executor's own
metrics port, and the block map as headless Chromium draws it while requests run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.services import free_port, serve

KEY = "obs-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NUM_GPU_BLOCKS = 32  # 8 requests (12 sequences) of ~110 tokens need ~84 blocks of 16
NUM_REQUESTS = 8
MAX_TOKENS = 100
HISTOGRAMS = ("time_to_first_token", "time_per_output_token", "e2e_request_latency")

Samples = dict[tuple[str, frozenset], float]


def scrape(url: str, headers: dict[str, str] | None = None) -> Samples:
    text = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def get(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels} missing"
    return samples[key]


@dataclass
class LoadRun:
    """What one load against the server produced, for the tests below to check."""

    url: str
    executor_metrics: str
    log_path: Path
    before: Samples = field(default_factory=dict)
    after: Samples = field(default_factory=dict)
    during: list[Samples] = field(default_factory=list)
    usages: dict[str, dict[str, int]] = field(default_factory=dict)  # request id -> usage
    dom: str | None = None  # the block map, while requests ran

    def delta(self, name: str, **labels: str) -> float:
        return get(self.after, name, **labels) - get(self.before, name, **labels)


def complete(run: LoadRun, model: str, i: int) -> None:
    body = {
        "model": model,
        "prompt": f"Write a long letter about harbour number {i}",
        "max_tokens": MAX_TOKENS,
        "n": 1 + i % 2,  # sampled groups of two are swapped, single sequences recomputed
        "temperature": 1.0,
        "seed": i,
        "ignore_eos": True,
    }
    r = httpx.post(f"{run.url}/v1/completions", json=body, headers=AUTH, timeout=300)
    r.raise_for_status()
    run.usages[r.headers["x-request-id"]] = r.json()["usage"]


def dump_dom(url: str, profile: Path) -> str:
    """The page's DOM after a few seconds of (virtual) time: several polls drawn."""
    cmd = [
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=3000",
        "--dump-dom",
        url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def map_state(url: str) -> dict:
    """What the block map draws (asking for it also keeps the map's snapshots fresh)."""
    return httpx.get(f"{url}/dashboard/state", headers=AUTH, timeout=10).json()


def pid_with_arg(arg: str) -> int:
    """The process whose command line holds ``arg``."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if arg in (entry / "cmdline").read_bytes().decode(errors="replace").split("\0"):
                    return int(entry.name)
    raise LookupError(f"no process with {arg}")


def running(samples: Samples) -> float:
    return get(samples, "pagedserve_num_requests", state="running")


def wait_drained(url: str, timeout: float = 120.0) -> Samples:
    """Metrics once every queue is empty (the engine's last step was observed)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url, AUTH)
        states = ("running", "waiting", "swapped")
        if sum(get(samples, "pagedserve_num_requests", state=s) for s in states) == 0:
            return samples
        assert time.monotonic() < deadline, "the load did not drain"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def load(tiny_chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadRun:
    metrics_port = free_port()
    flags = [
        *("--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--swap-space", "0.002"),
        *("--api-key", KEY, "--executor-metrics-port", str(metrics_port)),
    ]
    with serve(tiny_chat_model_dir, *flags) as url:
        port = url.rsplit(":", 1)[1]
        run = LoadRun(
            url,
            f"http://127.0.0.1:{metrics_port}/metrics",
            Path(os.environ.get("TMPDIR", "/tmp"))
            / f"pagedserve-serve-{port}.log",  # services.start
        )
        run.before = scrape(url, AUTH)
        model = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["id"]
        threads = [
            threading.Thread(target=complete, args=(run, model, i)) for i in range(NUM_REQUESTS)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not running(run.during[-1] if run.during else run.before):
            assert time.monotonic() < deadline, "no request started"
            time.sleep(0.05)
            run.during.append(scrape(url, AUTH))
        if shutil.which("chromium"):
            # Once the map shows held blocks the executor is paused: the requests keep
            # them while the page draws, however fast the load would otherwise end.
            executor = pid_with_arg(f"--metrics-port={metrics_port}")
            while not any(o >= 0 for ex in map_state(url)["executors"] for o in ex["gpu"]["owner"]):
                assert any(t.is_alive() for t in threads), "the load ended before the map showed it"
            os.kill(executor, signal.SIGSTOP)
            try:
                profile = tmp_path_factory.mktemp("chromium")
                run.dom = dump_dom(f"{url}/dashboard#key={KEY}", profile)
            finally:
                os.kill(executor, signal.SIGCONT)
        while any(t.is_alive() for t in threads):
            run.during.append(scrape(url, AUTH))
            time.sleep(0.5)
        for t in threads:
            t.join()
        run.after = wait_drained(url)
        yield run


def test_metrics_under_a_load_that_preempts(load: LoadRun):
    assert len(load.usages) == NUM_REQUESTS
    preempted = sum(
        load.delta("pagedserve_preemptions_total", mode=m) for m in ("recompute", "swap")
    )
    assert preempted > 0
    for samples in load.during:
        for device in ("gpu", "cpu"):
            assert 0 <= get(samples, "pagedserve_kv_cache_usage_ratio", device=device) <= 1
        assert 0 <= get(samples, "pagedserve_kv_slot_utilization_ratio") <= 1
    assert max(get(s, "pagedserve_kv_blocks_used", device="gpu") for s in load.during) > 0
    for device in ("gpu", "cpu"):
        assert get(load.after, "pagedserve_kv_blocks_used", device=device) == 0
    assert get(load.after, "pagedserve_kv_blocks_total", device="gpu") == NUM_GPU_BLOCKS
    prompt = sum(u["prompt_tokens"] for u in load.usages.values())
    generated = sum(u["completion_tokens"] for u in load.usages.values())
    assert load.delta("pagedserve_prompt_tokens_total") == prompt
    assert load.delta("pagedserve_generation_tokens_total") == generated
    assert load.delta("pagedserve_requests_total", finish_reason="length") == NUM_REQUESTS
    assert load.delta("pagedserve_requests_total", finish_reason="stop") == 0
    for histogram in HISTOGRAMS:
        assert load.delta(f"pagedserve_{histogram}_seconds_count") == NUM_REQUESTS
    assert load.delta("pagedserve_swapped_blocks_total", direction="out") > 0


def test_executor_metrics_port_counts_the_same_cache_operations(load: LoadRun):
    executor = scrape(load.executor_metrics.removesuffix("/metrics"))
    assert get(executor, "pagedserve_executor_kv_blocks_total", device="gpu") == NUM_GPU_BLOCKS
    assert get(executor, "pagedserve_executor_kv_blocks_total", device="cpu") > 0
    assert get(executor, "pagedserve_executor_step_seconds_count") > 0
    for part in ("overhead", "read"):
        assert get(executor, f"pagedserve_executor_step_{part}_seconds_total") > 0
    prompt = sum(u["prompt_tokens"] for u in load.usages.values())
    assert get(executor, "pagedserve_executor_forward_tokens_total") >= prompt
    scheduler = load.after  # both processes started with this server: totals compare
    for direction in ("in", "out"):
        assert get(
            executor, "pagedserve_executor_swapped_blocks_total", direction=direction
        ) == get(scheduler, "pagedserve_swapped_blocks_total", direction=direction)
    assert get(executor, "pagedserve_executor_copied_blocks_total") == get(
        scheduler, "pagedserve_cow_copies_total"
    )


def log_events(path: Path) -> list[dict]:
    """JSON log lines of both processes (a line may follow a progress bar's output)."""
    events = []
    for line in path.read_text().splitlines():
        start = line.find("{")
        if start >= 0:
            try:
                events.append(json.loads(line[start:]))
            except json.JSONDecodeError:
                continue
    return events


def test_one_log_line_per_finished_request_and_per_preemption(load: LoadRun):
    ours = [e for e in log_events(load.log_path) if e.get("request_id") in load.usages]
    finished = [e for e in ours if e["event"] == "request finished"]
    preempted = [e for e in ours if e["event"] == "request preempted"]
    assert len(ours) == len(finished) + len(preempted), "other lines name the requests"
    assert sorted(e["request_id"] for e in finished) == sorted(load.usages)
    for line in finished:
        usage = load.usages[line["request_id"]]
        assert line["level"] == "info" and line["finish_reason"] == "length"
        assert line["prompt_tokens"] == usage["prompt_tokens"]
        assert line["generation_tokens"] == usage["completion_tokens"]
        assert 0 < line["ttft_s"] <= line["e2e_s"] and line["tpot_s"] > 0
    modes = {m: load.delta("pagedserve_preemptions_total", mode=m) for m in ("recompute", "swap")}
    assert len(preempted) == sum(modes.values()) > 0
    assert {e["mode"] for e in preempted} <= set(modes)
    assert sum(e["num_preemptions"] for e in finished) == len(preempted)


class _Cells(HTMLParser):
    """Collects the block map's cells by pool: ``data-*`` attributes of each cell."""

    def __init__(self) -> None:
        super().__init__()
        self.pools: dict[str, list[dict[str, str]]] = {}
        self._device: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = a.get("class", "").split()
        if "grid" in classes:
            self._device = a["data-device"]
            self.pools[self._device] = []
        elif "cell" in classes and self._device is not None:
            self.pools[self._device].append(a)


def test_block_map_draws_every_block_with_owners_while_requests_run(load: LoadRun):
    if load.dom is None:
        pytest.skip("chromium is not installed (.ci/run installs it)")
    assert httpx.get(f"{load.url}/dashboard").status_code == 200  # the page: open
    assert httpx.get(f"{load.url}/dashboard/state").status_code == 401  # the data: keyed
    cells = _Cells()
    cells.feed(load.dom)
    num_cpu_blocks = int(get(load.after, "pagedserve_kv_blocks_total", device="cpu"))
    assert len(cells.pools["gpu"]) == NUM_GPU_BLOCKS
    assert len(cells.pools["cpu"]) == num_cpu_blocks
    owned = [c for c in cells.pools["gpu"] if c.get("data-state") == "owned"]
    assert owned and all(c["data-owner"].startswith("cmpl-") for c in owned)
    assert all(int(c["data-ref"]) >= 1 and c["style"] for c in owned)
    states = {c.get("data-state") for pool in cells.pools.values() for c in pool}
    assert states <= {"owned", "free", "cached"}
