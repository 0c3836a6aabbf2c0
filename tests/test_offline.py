"""OfflineLLM (`pagedserve generate`) ends a completion at a stop string as the server does,
and its text is the decoded tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pagedserve.offline import OfflineLLM, Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import ExecutorConfig


def test_a_stop_string_cuts_the_text_and_ends_the_completion(tiny_chat_model_dir: Path) -> None:
    llm = OfflineLLM(ExecutorConfig(model=str(tiny_chat_model_dir), num_gpu_blocks=64))
    tokenizer = llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    free = llm.generate([Request("free", prompt="The harbour", params=params)], progress=False)
    text = free[0].outputs[0].text
    assert text == tokenizer.decode(free[0].outputs[0].token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2 :][:3]
    cut = dataclasses.replace(params, stop=(stop,))
    done = llm.generate([Request("cut", prompt="The harbour", params=cut)], progress=False)
    completion = done[0].outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.text == text[: text.index(stop)]
    assert len(completion.token_ids) < len(free[0].outputs[0].token_ids)
