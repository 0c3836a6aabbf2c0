"""Engine settings: validation, and the CLI flags that reach them."""

from __future__ import annotations

import math

import pytest

from pagedserve.cli import _scheduler_options, build_parser
from pagedserve.settings import SERVING_DECODE_STEPS_QUIET_S, SchedulerConfig


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_decode_steps", 0), ("decode_steps_quiet_s", -1.0), ("decode_steps_quiet_s", math.nan)],
)
def test_scheduler_config_refuses_a_bad_decode_steps_setting(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


def test_offline_engines_look_ahead_at_once_and_servers_after_a_quiet_spell() -> None:
    assert SchedulerConfig().decode_steps_quiet_s == 0.0  # every request is there from the start
    for command in ("serve", "scheduler"):
        args = build_parser().parse_args([command])
        assert _scheduler_options(args, []).decode_steps_quiet_s == SERVING_DECODE_STEPS_QUIET_S
        args = build_parser().parse_args([command, "--decode-steps-quiet", "0.5"])
        assert _scheduler_options(args, []).decode_steps_quiet_s == 0.5
