"""Decode steps run in a row on the executor (``num_decode_steps``) give what one step per
executor call gives: the same tokens, logprobs, text and finish reasons, for every kind of
sampling, with fewer executor calls."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from executor_svc.executor import Executor
from pagedserve.model_files import load_tokenizer
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import CacheConfig, ExecutorConfig, SchedulerConfig
from pagedserve.step import ExecuteStep, StepResult
from scheduler_svc.engine.detokenizer import Detokenizer
from scheduler_svc.engine.engine import LLMEngine

PROMPTS = [
    "The harbour committee met",
    "A fisherman asked who would pay",
    "By noon the mayor",
    "Engineers argued that the old sea wall",
    "Nobody answered at first",
    "Write a report",
    "The storm",
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=21),
    SamplingParams(
        temperature=0.7, seed=3, max_tokens=25, repetition_penalty=1.3, frequency_penalty=0.5
    ),
    SamplingParams(temperature=0, max_tokens=11, logprobs=3, ignore_eos=True),
    SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=14),
    SamplingParams(temperature=1.0, seed=2, max_tokens=40),  # a stop string, below
    SamplingParams(temperature=1.0, seed=5, max_tokens=40),  # a stop token, below
]

Outputs = list[list[tuple]]


@pytest.fixture(scope="module")
def executor(tiny_chat_model_dir: Path) -> Executor:
    return Executor(ExecutorConfig(model=str(tiny_chat_model_dir), num_gpu_blocks=128))


@dataclasses.dataclass
class ArrivalsEveryOtherCall:
    """The executor, told before every other call of decode steps in a row to end it after
    its first step, as EndSteps does when a request arrives while a call runs."""

    executor: Executor
    num_ended: int = 0

    def execute(self, step: ExecuteStep) -> StepResult:
        if any(s.num_steps > 1 for s in step.seqs) and step.step_id % 2:
            self.executor.end_steps(step.step_id)
            self.num_ended += 1
        return self.executor.execute(step)

    def end_steps(self, step_id: int) -> None:
        self.executor.end_steps(step_id)


def generate(
    executor: Executor | ArrivalsEveryOtherCall, params: list[SamplingParams], num_decode_steps: int
):
    """The requests to the end through an engine that detokenizes (stop strings) and the
    number of executor calls it took; the block tables are checked after every call."""
    model = executor.executor if isinstance(executor, ArrivalsEveryOtherCall) else executor
    info = model.init_cache()
    tokenizer = load_tokenizer(model.model_path)
    engine = LLMEngine(
        executor,
        CacheConfig(block_size=info.block_size, num_gpu_blocks=info.num_gpu_blocks),
        SchedulerConfig(max_model_len=info.max_model_len, num_decode_steps=num_decode_steps),
        info.eos_token_id,
        Detokenizer(tokenizer),
    )
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(str(i), tokenizer.encode(prompt), p)
    finished = {}
    while engine.has_unfinished():
        finished |= {g.request_id: g for g in engine.step().finished}
        engine.scheduler.block_manager.check_integrity()
    assert not engine.scheduler.block_manager.block_tables
    outputs = [
        [
            (
                str(s.output_text),
                s.output_token_ids,
                s.cumulative_logprob,
                s.output_top_logprobs,
                s.status.finish_reason,
            )
            for s in finished[str(i)].seqs
        ]
        for i in range(len(PROMPTS))
    ]
    return outputs, engine.stats.num_steps


@pytest.fixture(scope="module")
def stopping_params(executor: Executor) -> list[SamplingParams]:
    """PARAMS with the last two cut short mid-output, by a piece of the text each would
    write and by one of its tokens."""
    outputs, _ = generate(executor, PARAMS, 1)
    text, token_ids = outputs[5][0][0], outputs[6][0][1]
    params = list(PARAMS)
    params[5] = dataclasses.replace(params[5], stop=(text[len(text) // 2 :][:2],))
    params[6] = dataclasses.replace(params[6], stop_token_ids=(token_ids[len(token_ids) // 2],))
    return params


@pytest.fixture(scope="module")
def one_at_a_time(executor: Executor, stopping_params: list[SamplingParams]):
    return generate(executor, stopping_params, 1)


@pytest.mark.parametrize("num_decode_steps", [2, 4, 8])
def test_steps_in_a_row_equal_one_step_at_a_time(
    executor: Executor,
    stopping_params: list[SamplingParams],
    one_at_a_time: tuple[Outputs, int],
    num_decode_steps: int,
) -> None:
    reference, reference_steps = one_at_a_time
    assert [r[0][4] for r in reference[5:]] == ["stop", "stop"]  # both cut mid-output
    outputs, steps = generate(executor, stopping_params, num_decode_steps)
    for index, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        assert [o[:2] + o[3:] for o in got] == [o[:2] + o[3:] for o in want], f"request {index}"
        assert [o[2] for o in got] == pytest.approx([o[2] for o in want], abs=1e-4)
    assert steps < reference_steps


def test_calls_ended_early_by_arrivals_equal_one_step_at_a_time(
    executor: Executor,
    stopping_params: list[SamplingParams],
    one_at_a_time: tuple[Outputs, int],
) -> None:
    """Half the calls of eight decode steps stop after one: the engine applies what came
    back and unmaps the slots it had mapped for the rest."""
    reference, _ = one_at_a_time
    arrivals = ArrivalsEveryOtherCall(executor)
    outputs, steps = generate(arrivals, stopping_params, 8)
    _, uncut_steps = generate(executor, stopping_params, 8)
    assert arrivals.num_ended > 0 and steps > uncut_steps
    for index, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        assert [o[:2] + o[3:] for o in got] == [o[:2] + o[3:] for o in want], f"request {index}"
        assert [o[2] for o in got] == pytest.approx([o[2] for o in want], abs=1e-4)
