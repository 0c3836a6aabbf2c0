"""The executor's side of the registry: heartbeat while serving, drain on SIGTERM.

A draining executor stays registered (marked draining, so no new requests come) and keeps
serving until the engine leader releases it — nothing of the leader's runs on it any more —
or until its drain budget is spent, whichever comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import structlog

from pagedserve.registry import ExecutorRecord, ExecutorRegistry, drain_deadline
from pagedserve.settings import RegistrationOptions

log = structlog.get_logger("executor_svc.registration")


class Registration:
    """Keeps one executor's record alive in Redis until it is released or stops."""

    def __init__(self, options: RegistrationOptions, record: ExecutorRecord) -> None:
        self.options = options
        self.record = record
        self.registry = ExecutorRegistry(
            options.state_store, options.namespace, options.heartbeat_ttl_s
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Heartbeat every ttl/3 until ``stop``; a Redis outage is logged, not fatal."""
        await asyncio.to_thread(self.registry.clear_release, self.record.address)
        period = self.options.heartbeat_ttl_s / 3
        warned = False
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.registry.announce, self.record)
                warned = False
            except Exception as e:  # keep serving; the leader treats us as gone meanwhile
                if not warned:
                    log.warning("executor.heartbeat_failed", error=str(e))
                    warned = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period)

    async def drain(self) -> None:
        """Mark this executor draining, then wait to be released or for the budget to end."""
        deadline = drain_deadline(self.options.drain_timeout_s)
        self.record = dataclasses.replace(self.record, draining=True, drain_deadline=deadline)
        log.info("executor.draining", budget_s=self.options.drain_timeout_s)
        loop = asyncio.get_running_loop()
        end = loop.time() + self.options.drain_timeout_s
        while loop.time() < end:
            try:
                await asyncio.to_thread(self.registry.announce, self.record)
                if await asyncio.to_thread(self.registry.is_released, self.record.address):
                    log.info("executor.released")
                    break
            except Exception as e:
                log.warning("executor.heartbeat_failed", error=str(e))
            await asyncio.sleep(0.2)
        else:
            log.warning("executor.drain_budget_spent")
        await asyncio.to_thread(self.registry.withdraw, self.record.address)
