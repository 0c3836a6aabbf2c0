"""No NaN or infinity reaches a response: both doors render a non-finite logprob as a
finite number, and the JSON encoder refuses what slips past."""

from __future__ import annotations

import json
import math

import pytest

from pagedserve.sampling_params import SamplingParams
from scheduler_svc.api.grpc_frontdoor import _Reply
from scheduler_svc.api.protocol import ParsedRequest
from scheduler_svc.api.render import Renderer
from scheduler_svc.api.wire import LOGPROB_FLOOR, to_json
from scheduler_svc.state.streams import Choice, RequestDelta, SeqDelta

NON_FINITE = [-math.inf, math.nan, math.inf]
TOPS = [{1: -math.inf, 2: math.nan}, {3: math.inf}, {4: -0.5}]


class Letters:
    """A tokenizer that decodes token id i as the i-th lowercase letter."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def renderer(chat: bool) -> Renderer:
    parsed = ParsedRequest("m", ["x"], None, SamplingParams(), False, 2, None, False)
    return Renderer("m", Letters(), parsed, "r-1", [[0, 1, 2]], chat)


@pytest.mark.parametrize("chat", [False, True])
def test_the_http_door_renders_non_finite_logprobs_as_numbers(chat):
    choice = Choice(["bcd"], [1, 2, 3], NON_FINITE, TOPS, "length")
    body = json.loads(to_json(renderer(chat).final([choice])))  # no NaN: to_json refuses it
    logprobs = body["choices"][0]["logprobs"]
    if chat:
        values = [t["logprob"] for t in logprobs["content"]]
        tops = [e["logprob"] for t in logprobs["content"] for e in t["top_logprobs"]]
    else:
        values = logprobs["token_logprobs"]
        tops = [v for top in logprobs["top_logprobs"] for v in top.values()]
    assert values == [LOGPROB_FLOOR, LOGPROB_FLOOR, 0.0]
    assert sorted(tops) == [LOGPROB_FLOOR, LOGPROB_FLOOR, -0.5, 0.0]


def test_the_grpc_door_renders_non_finite_logprobs_as_numbers():
    out = SeqDelta(0, "bcd", [1, 2, 3], NON_FINITE, TOPS, "length")
    response = _Reply("r-1", 3, Letters()).response(RequestDelta("r-1", 3, 1, [out], True))
    choice = response.choices[0]
    assert list(choice.logprobs) == [LOGPROB_FLOOR, LOGPROB_FLOOR, 0.0]
    assert [e.logprob for e in choice.top_logprobs[0].entries] == [LOGPROB_FLOOR] * 2


def test_the_json_encoder_refuses_nan():
    with pytest.raises(ValueError):
        to_json({"logprob": math.nan})
