"""In-process generation: executor and engine in one process, no services.

It wires both services, as the CLI does, so it imports them only when an OfflineLLM is
built: `pagedserve/` stays the base that the services import, never the other way round.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm import tqdm

from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import EngineOptions, ExecutorConfig
from pagedserve.step import PromptLogprob

if TYPE_CHECKING:
    from scheduler_svc.core.sequence import SequenceGroup


@dataclass(slots=True)
class Request:
    """One prompt, as text (optionally through the chat template) or token ids."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    chat: bool = False
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(slots=True)
class Completion:
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str | None
    top_logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]
    # Prompt tokens 1, 2, ... as the model scored them, when params.prompt_logprobs asks.
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)


class OfflineLLM:
    """Loads the model once; ``generate`` runs a batch of requests to completion."""

    def __init__(
        self,
        executor_config: ExecutorConfig,
        engine: EngineOptions | None = None,
        online: bool = False,
    ) -> None:
        """Args:
        online: requests will arrive while others run (a replay of a serving load): keep
            the serving quiet period before decode steps in a row, and the pace admission
            keeps for the running streams.
        """
        from executor_svc.executor import Executor
        from pagedserve.model_files import load_tokenizer
        from scheduler_svc.engine.detokenizer import Detokenizer
        from scheduler_svc.engine.engine import LLMEngine

        self.executor = Executor(executor_config)
        self.tokenizer = load_tokenizer(self.executor.model_path)  # None: token ids only
        info = self.executor.init_cache()
        self.info = info
        options = engine or EngineOptions()
        if not online:  # every request is here from the start: no arrival to wait for,
            # and only the throughput of the whole batch counts, not each stream's pace
            options = dataclasses.replace(
                options, decode_steps_quiet_s=0.0, decode_steps_span_s=0.0, max_token_slowdown=0.0
            )
        cache_config, scheduler_config = options.configs(info)
        detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.engine = LLMEngine(
            self.executor, cache_config, scheduler_config, info.eos_token_id, detokenizer
        )

    def close(self) -> None:
        """Stop the executor's tensor-parallel workers, if any (also done at exit)."""
        self.executor.close()

    def encode(self, request: Request) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.prompt is None:
            raise ValueError(f"request {request.request_id}: give prompt or prompt_token_ids")
        if self.tokenizer is None:
            raise ValueError(f"model {self.executor.config.model} has no tokenizer: send token ids")
        if request.chat:
            messages = [{"role": "user", "content": request.prompt}]
            encoded = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        return self.tokenizer.encode(request.prompt)

    def generate(self, requests: Iterable[Request], progress: bool = True) -> list[RequestOutput]:
        """Run every request to completion; results come back in input order."""
        groups = [
            self.engine.add_request(r.request_id, self.encode(r), r.params, arrival_time=i)
            for i, r in enumerate(requests)
        ]
        with tqdm(
            total=len(groups), desc="generating", unit="req", file=sys.stderr, disable=not progress
        ) as bar:
            while self.engine.has_unfinished():
                bar.update(len(self.engine.step().finished))
        return [self._result(group) for group in groups]

    def _result(self, group: SequenceGroup) -> RequestOutput:
        completions = [
            Completion(
                text=str(seq.output_text),  # detokenized as it grew: cut at a stop string
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                finish_reason=seq.status.finish_reason,
                top_logprobs=list(seq.output_top_logprobs),
            )
            for seq in group.outputs()
        ]
        prompt_ids = list(group.seqs[0].prompt_token_ids)
        return RequestOutput(group.request_id, prompt_ids, completions, group.prompt_logprobs)
