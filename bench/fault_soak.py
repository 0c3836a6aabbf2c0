"""The soak: one deployment under open-loop load at a fraction of the baseline's request
rate for many minutes; resident memory of every process sampled throughout (the first
minutes after warm-up against the last), the pools back to 0 used blocks, and the Redis
keys left behind."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.fault_cluster import Cluster, ClusterConfig
from bench.fault_load import Client, Outcome, Spec, judge, run_paced, specs
from tests.cluster import model_of

# At most; a sixth of a shorter soak. A minute was too short: its sample caught the heap's
# peak, and memory then fell by a third over 30 minutes (bench/RESULTS.md, 2026-12-03).
WARM_UP_S = 300.0
DRAIN_S = 60.0
RSS_EVERY_S = 30.0
RSS_WINDOW = 3  # samples whose median is the start's (first) and the end's (last) figure


def sample_rss(cluster: Cluster, stop: threading.Event, samples: list[dict[str, Any]]) -> None:
    """Every process's resident memory every RSS_EVERY_S seconds until ``stop``."""
    start = time.monotonic()
    while True:
        samples.append({"t_s": round(time.monotonic() - start, 1), "mib": cluster.rss_mib()})
        if stop.wait(RSS_EVERY_S):
            return


def rss_summary(samples: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per process: the median of the first and of the last RSS_WINDOW samples, the lowest
    and the highest, and the change from start to end in percent."""
    summary = {}
    for name in samples[0]["mib"]:
        series = [s["mib"][name] for s in samples if name in s["mib"]]
        start = statistics.median(series[:RSS_WINDOW])
        end = statistics.median(series[-RSS_WINDOW:])
        summary[name] = {
            "start": start,
            "end": end,
            "min": min(series),
            "max": max(series),
            "change_pct": round((end / start - 1) * 100, 1),
        }
    return summary


def soak(args: argparse.Namespace, reference: dict[Spec, str], baseline: Any) -> dict[str, Any]:
    """Run the soak and print its figures; returns them for the JSON."""
    rate = args.soak_fraction * baseline.correct / args.duration
    load = specs(args.num_specs, args.max_tokens)
    warm_up_s = min(WARM_UP_S, args.soak_minutes * 10)
    # Finished requests stay in Redis this long (an hour by default): shorter than the
    # warm-up, the keys they hold have levelled off before the first count.
    config = ClusterConfig(model_dir=args.model_dir, finished_ttl_s=warm_up_s / 2)
    with tempfile.TemporaryDirectory(prefix="faults-soak-") as data_dir:
        cluster = Cluster(config, Path(data_dir))
        try:
            cluster.start()
            client = Client(cluster.urls, model_of(cluster.urls()[0]), args.deadline)
            warm = run_paced(client, load, rate, warm_up_s)
            keys_start, samples, stop = cluster.redis_keys(), [], threading.Event()
            sampler = threading.Thread(target=sample_rss, args=(cluster, stop, samples))
            sampler.start()
            try:
                records = run_paced(client, load, rate, args.soak_minutes * 60)
            finally:
                stop.set()
                sampler.join()
            keys_end = cluster.redis_keys()
            leaked = cluster.wait_drained(DRAIN_S)
            time.sleep(1)
            keys_idle = cluster.redis_keys()
        finally:
            cluster.stop()
    judge(warm + records, reference)
    unfinished = [r for r in warm + records if r.outcome is not Outcome.CORRECT]
    result = {
        "rate_req_s": round(rate, 3),
        "warm_up_s": warm_up_s,
        "finished_ttl_s": config.finished_ttl_s,
        "outcomes": dict(Counter(r.outcome.value for r in warm + records)),
        "error_kinds": dict(Counter(e for r in warm + records for e in r.errors)),
        "unfinished": [  # what each request that did not finish correctly went through
            {"outcome": r.outcome.value, "seconds": round(r.ended - r.started, 1)}
            | {"started_s": round(r.started - warm[0].started, 1), "errors": r.errors}
            for r in unfinished
        ],
        "rss_mib": rss_summary(samples),
        "rss_mib_samples": samples,
        "blocks_leaked": leaked,
        "redis_keys": {"after_warm_up": keys_start, "end": keys_end, "idle": keys_idle},
    }
    print_soak(result)
    return result


def print_soak(result: dict[str, Any]) -> None:
    print(f"\nSoak at {result['rate_req_s']} req/s: {result['outcomes']}")
    for record in result["unfinished"]:
        print(f"  {record}")
    print(f"  RSS, medians of the first and last {RSS_WINDOW} samples {RSS_EVERY_S:.0f} s apart:")
    for name, rss in result["rss_mib"].items():
        print(
            f"  {name}: {rss['start']:.1f} -> {rss['end']:.1f} MiB ({rss['change_pct']:+.1f} %),"
            f" between {rss['min']:.1f} and {rss['max']:.1f}"
        )
    print(f"  blocks leaked: {result['blocks_leaked']}; Redis keys: {result['redis_keys']}")
