"""API keys: several, from flags, the environment and a file; each its own owner."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.settings import ApiConfig
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
