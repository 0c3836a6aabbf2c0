#!/usr/bin/env python3
"""The fault suite: one deployment (redis-server, an executor, scheduler replicas that reach
both through fault-injecting proxies) takes each scenario's fault in turn under steady load
(streaming and not, greedy and seeded); one table reports what the clients saw, judged
against a reference run of the same requests undisturbed. Lost or hung requests, wrong
texts and leaked KV blocks must be 0 in every row (the exit status says whether they were).

    python bench/faults.py                          # every scenario, the tiny model
    python bench/faults.py --scenarios redis-kill,leader-kill --model SmolLM2-135M-Instruct
    python bench/faults.py --scenarios baseline --soak-minutes 30
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import RESULTS, percentile, print_table, write_json
from bench.fault_cluster import Cluster, ClusterConfig
from bench.fault_load import Client, Outcome, Record, Spec, judge, run_load, specs
from bench.fault_scenarios import SCENARIOS, Scenario
from bench.fault_soak import soak
from tests.cluster import model_of

DRAIN_S = 30.0  # how long the pools get to reach 0 used blocks once the load ends


@dataclass(slots=True)
class Row:
    """One scenario's line of the report."""

    scenario: str
    sent: int
    correct: int
    failed_clearly: int
    lost_or_hung: int
    wrong_text: int
    retried: int
    dropped: int
    unclear_errors: int
    latency_p50_s: float
    recovery_s: float | None
    blocks_leaked: float
    note: str
    error_kinds: dict[str, int]  # what the failed tries got, by kind (the JSON only)
    wrong_kinds: dict[str, int]  # the requests with wrong text, by kind (the JSON only)

    @property
    def ok(self) -> bool:
        return self.lost_or_hung == 0 and self.wrong_text == 0 and self.blocks_leaked == 0


HEADERS = ["scenario", "sent", "correct", "failed clearly", "lost/hung", "wrong text"]
HEADERS += ["retried", "dropped", "unclear errors", "p50 s", "recovery s", "blocks leaked"]
HEADERS += ["note"]


def summarize(scenario: Scenario, records: list[Record], fault_at: float, **extra) -> Row:
    """Count outcomes. Recovery runs from the fault's start to the first correct finish
    after it: how long the clients saw nothing complete (a fault that stops nothing scores
    about the gap between two finishes)."""
    count = {o: sum(r.outcome is o for r in records) for o in Outcome}
    recovered = [
        r.ended - fault_at for r in records if r.ended >= fault_at and r.outcome is Outcome.CORRECT
    ]
    return Row(
        scenario=scenario.name,
        sent=len(records),
        correct=count[Outcome.CORRECT],
        failed_clearly=count[Outcome.FAILED],
        lost_or_hung=count[Outcome.LOST],
        wrong_text=count[Outcome.WRONG],
        retried=sum(r.retries > 0 for r in records),
        dropped=sum(r.dropped for r in records),
        unclear_errors=sum(r.unclear_errors for r in records),
        latency_p50_s=percentile([r.ended - r.started for r in records], 50) or 0.0,
        recovery_s=min(recovered) if recovered and scenario.key != "baseline" else None,
        error_kinds=dict(Counter(e for r in records for e in r.errors)),
        wrong_kinds=dict(Counter(r.spec.kind for r in records if r.outcome is Outcome.WRONG)),
        **extra,
    )


def run_scenario(
    cluster: Cluster,
    client: Client,
    scenario: Scenario,
    args: argparse.Namespace,
    reference: dict[Spec, str],
) -> Row:
    """Load the running cluster, inject the fault, judge what the clients got, and wait
    for the pools to drain."""
    load, replicas = cluster.load, len(cluster.urls())
    concurrency = scenario.streams or args.concurrency
    if scenario.streams:
        load = [spec for spec in load if spec.stream]
    with ThreadPoolExecutor(1) as pool:
        loaded = pool.submit(run_load, client, load, concurrency, args.duration)
        time.sleep(args.fault_at)
        fault_at = time.monotonic()
        note, extra = scenario.fault(cluster), []
        if isinstance(note, tuple):
            note, extra = note
        records = loaded.result() + extra
    judge(records, reference)
    leaked = cluster.wait_drained(DRAIN_S)
    if exited := replicas - len(cluster.urls()):
        note += f"; {exited} of {replicas} scheduler replicas exited"
    return summarize(scenario, records, fault_at, blocks_leaked=leaked, note=note)


def take_reference(client: Client, load: list[Spec], concurrency: int) -> dict[Spec, str]:
    """Each spec once on the undisturbed cluster; any failure here stops the suite."""
    with ThreadPoolExecutor(concurrency) as pool:
        records = list(pool.map(client.run, load))
    bad = [r for r in records if r.outcome is not Outcome.CORRECT]
    if bad:
        raise RuntimeError(f"the reference run failed: {bad[0]}")
    return {r.spec: r.text for r in records}


def tiny_model_dir(path: Path) -> Path:
    """The tests' tiny random Llama with the default model's tokenizer: real text, toy cost."""
    from pagedserve.model_files import DEFAULT_MODEL, resolve_model
    from tests.conftest import save_tiny_llama

    shape = {"vocab_size": 49152, "tie_word_embeddings": True}
    save_tiny_llama(path, **shape, eos_token_id=2, pad_token_id=2)
    for name in resolve_model(DEFAULT_MODEL).iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (path / name.name).write_bytes(name.read_bytes())
    return path


def run(args: argparse.Namespace) -> list[Row]:
    """The chosen scenarios in turn on one deployment, after a reference run of every
    request on it undisturbed; prints the table and writes the JSON."""
    chosen = [s for key, s in SCENARIOS.items() if key in args.scenarios]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="faults-redis-") as data_dir:
        cluster = Cluster(ClusterConfig(args.model_dir, args.schedulers), Path(data_dir))
        try:
            cluster.start()
            client = Client(cluster.urls, model_of(cluster.urls()[0]), args.deadline)
            cluster.load = specs(args.num_specs, args.max_tokens)
            reference = take_reference(client, cluster.load, args.concurrency)
            for scenario in chosen:
                if len(cluster.urls()) < scenario.min_schedulers:
                    print(f"{scenario.name}: skipped, needs {scenario.min_schedulers} replicas")
                    continue
                rows.append(run_scenario(cluster, client, scenario, args, reference))
                row = rows[-1]
                if scenario.key == "baseline":
                    cluster.sustainable_rate_req_s = row.correct / args.duration
                print(f"{row.scenario}: {row.correct}/{row.sent} correct, {row.lost_or_hung} lost")
        finally:
            cluster.stop()
    body: dict = {"rows": [asdict(r) for r in rows]}
    if args.soak_minutes:
        body["soak"] = soak(args, reference, rows[0])
    print()
    cells = [list(asdict(r).values())[: len(HEADERS)] for r in rows]
    print_table(HEADERS, cells, title="Fault suite")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "model_dir"}  # a temp dir
        write_json(args.json, config, body)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (a random 2-layer Llama) or a model")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=", ".join(SCENARIOS))
    p.add_argument("--schedulers", type=int, default=3, help="scheduler replicas")
    p.add_argument("--concurrency", type=int, default=6, help="clients sending at once")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per scenario")
    p.add_argument("--fault-at", type=float, default=5.0, help="seconds into the load")
    p.add_argument("--deadline", type=float, default=120.0, help="s; a request past it is hung")
    p.add_argument("--num-specs", type=int, default=16, help="distinct requests in the load")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--soak-minutes", type=float, default=0.0, help="a soak this long after")
    p.add_argument("--soak-fraction", type=float, default=0.7, help="of the baseline's rate")
    p.add_argument("--json", type=Path, default=RESULTS / "faults.json")
    args = p.parse_args(argv)
    args.scenarios = list(dict.fromkeys(["baseline", *args.scenarios.split(",")]))
    unknown = set(args.scenarios) - set(SCENARIOS)  # the baseline is the soak's yardstick
    if unknown:
        p.error(f"unknown scenarios: {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="faults-model-") as model_dir:
        if args.model == "tiny":
            args.model_dir = tiny_model_dir(Path(model_dir))
        else:
            from pagedserve.model_files import resolve_model

            args.model_dir = resolve_model(args.model)
        rows = run(args)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
