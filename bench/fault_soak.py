"""The soak: one deployment under open-loop load at a fraction of the baseline's request
rate for many minutes; resident memory of every process after warm-up and at the end, the
pools back to 0 used blocks, and the Redis keys left behind."""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.fault_cluster import Cluster, ClusterConfig
from bench.fault_load import Client, Outcome, Spec, judge, run_paced, specs
from tests.cluster import model_of

WARM_UP_S = 60.0  # at most; a fifth of a shorter soak
DRAIN_S = 60.0


def soak(args: argparse.Namespace, reference: dict[Spec, str], baseline: Any) -> dict[str, Any]:
    """Run the soak and print its figures; returns them for the JSON."""
    rate = args.soak_fraction * baseline.correct / args.duration
    load = specs(args.num_specs, args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="faults-soak-") as data_dir:
        cluster = Cluster(ClusterConfig(model_dir=args.model_dir), Path(data_dir))
        try:
            cluster.start()
            client = Client(cluster.urls, model_of(cluster.urls()[0]), args.deadline)
            warm = run_paced(client, load, rate, min(WARM_UP_S, args.soak_minutes * 12))
            rss_start, keys_start = cluster.rss_mib(), cluster.redis_keys()
            records = run_paced(client, load, rate, args.soak_minutes * 60)
            rss_end, keys_end = cluster.rss_mib(), cluster.redis_keys()
            leaked = cluster.wait_drained(DRAIN_S)
            time.sleep(1)
            keys_idle = cluster.redis_keys()
        finally:
            cluster.stop()
    judge(warm + records, reference)
    unfinished = [r for r in warm + records if r.outcome is not Outcome.CORRECT]
    result = {
        "rate_req_s": round(rate, 3),
        "outcomes": dict(Counter(r.outcome.value for r in warm + records)),
        "error_kinds": dict(Counter(e for r in warm + records for e in r.errors)),
        "unfinished": [  # what each request that did not finish correctly went through
            {"outcome": r.outcome.value, "seconds": round(r.ended - r.started, 1)}
            | {"started_s": round(r.started - warm[0].started, 1), "errors": r.errors}
            for r in unfinished
        ],
        "rss_mib_start": rss_start,
        "rss_mib_end": rss_end,
        "blocks_leaked": leaked,
        "redis_keys": {"after_warm_up": keys_start, "end": keys_end, "idle": keys_idle},
    }
    print_soak(result)
    return result


def print_soak(result: dict[str, Any]) -> None:
    print(f"\nSoak at {result['rate_req_s']} req/s: {result['outcomes']}")
    for record in result["unfinished"]:
        print(f"  {record}")
    for name, start in result["rss_mib_start"].items():
        end = result["rss_mib_end"].get(name, float("nan"))
        print(f"  RSS {name}: {start:.1f} -> {end:.1f} MiB ({(end / start - 1) * 100:+.1f} %)")
    print(f"  blocks leaked: {result['blocks_leaked']}; Redis keys: {result['redis_keys']}")
