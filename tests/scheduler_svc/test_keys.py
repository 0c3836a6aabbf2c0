"""API keys: several, from flags, the environment and a file; each its own owner."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pagedserve.settings import ApiConfig
from scheduler_svc.api.http import ApiKeyCheck
from scheduler_svc.api.keys import ApiKeys, owner_of


def test_every_key_is_accepted_and_is_its_own_owner(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated 2026-12\nfile-one\n\n  file-two  \n")
    keys = ApiKeys.from_config(ApiConfig(api_keys=("flag-key",), api_key_file=str(key_file)))
    owners = [keys.owner(f"Bearer {k}") for k in ("flag-key", "file-one", "file-two")]
    assert owners == [owner_of("flag-key"), owner_of("file-one"), owner_of("file-two")]
    assert len(set(owners)) == 3 and "" not in owners
    assert keys.owner(b"Bearer file-two") == owner_of("file-two")  # HTTP headers are bytes


@pytest.mark.parametrize("sent", ["", "flag-key", "Bearer", "Bearer flag-ke", "Bearer flag-keyy"])
def test_anything_but_an_accepted_key_has_no_owner(sent: str) -> None:
    assert ApiKeys(("flag-key", "other")).owner(sent) is None


def test_without_keys_everyone_is_let_in_as_the_one_owner() -> None:
    keys = ApiKeys(())
    assert not keys and keys.owner("") == "" and keys.owner("Bearer anything") == ""


def test_a_key_file_without_keys_or_a_bad_key_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "keys"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys.from_config(ApiConfig(api_key_file=str(empty)))
    for bad in ("", "a,b", " padded"):
        with pytest.raises(ValueError, match="API key"):
            ApiConfig(api_keys=(bad,))


def test_a_key_past_its_requests_in_flight_gets_a_429_until_one_ends() -> None:
    """The real key check before a completion route whose answers wait for a release (the
    requests a server would be streaming), over ASGI."""
    keys = ApiKeys(("busy", "idle"), max_requests_per_key=2)
    asyncio.run(_past_the_limit(keys))
    assert not keys._in_flight  # every request that ended gave its place back


async def _past_the_limit(keys: ApiKeys) -> None:
    release = asyncio.Event()

    async def completions(request: Request) -> PlainTextResponse:
        if (await request.json())["wait"]:
            await release.wait()
        return PlainTextResponse("done")

    route = Route("/v1/completions", completions, methods=["POST"])
    app = ApiKeyCheck(Starlette(routes=[route]), SimpleNamespace(keys=keys))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

        async def post(key: str, wait: bool) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"}
            return await client.post("/v1/completions", json={"wait": wait}, headers=headers)

        held = [asyncio.create_task(post("busy", True)) for _ in range(2)]
        while sum(keys._in_flight.values()) < 2:
            await asyncio.sleep(0.01)
        refused = await post("busy", False)
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "2"
        assert refused.json()["error"]["code"] == "too_many_requests_per_key"
        assert (await post("idle", False)).status_code == 200  # another key is not held back
        release.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
        assert (await post("busy", False)).status_code == 200


def test_without_keys_or_with_no_limit_nothing_is_counted_against_anyone() -> None:
    for keys, owner in (
        (ApiKeys((), max_requests_per_key=1), ""),
        (ApiKeys(("k",)), owner_of("k")),
    ):
        with keys.hold(owner), keys.hold(owner):
            pass
