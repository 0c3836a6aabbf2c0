"""Shapes a request's deltas as OpenAI completion or chat responses, whole or as SSE events."""

from __future__ import annotations

import importlib.metadata
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedserve.step import PromptLogprob
from scheduler_svc.api.errors import client_error
from scheduler_svc.api.protocol import ParsedRequest
from scheduler_svc.api.wire import finite_logprob, to_json
from scheduler_svc.state.streams import Choice, RequestDelta


def _version() -> str:
    """The installed distribution's version; a source tree run without installing (its
    directory on PYTHONPATH) has none."""
    try:
        return importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+source"


VERSION = _version()
# Which build answered, as OpenAI's responses say it; a new version may answer differently.
SYSTEM_FINGERPRINT = f"pagedserve-{VERSION}"


class Renderer:
    """Shapes deltas and finished choices as OpenAI completion or chat responses."""

    def __init__(
        self,
        model: str,
        tokenizer: Any,
        parsed: ParsedRequest,
        request_id: str,
        prompts: list[list[int]],
        chat: bool,
    ) -> None:
        self.model, self.tokenizer, self.parsed = model, tokenizer, parsed
        self.request_id, self.chat = request_id, chat
        # Echo and prompt scores come with one prompt (a list of several is refused).
        self.prompt_ids = prompts[0]
        self.prompt_len = sum(map(len, prompts))
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def final(
        self, choices: list[Choice], prompt_logprobs: list[PromptLogprob] | None = None
    ) -> dict[str, Any]:
        """The whole response; ``prompt_logprobs``: the prompt's scores, when asked for."""
        completion_tokens = sum(len(c.token_ids) for c in choices)
        body = {
            "id": self.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [
                self._choice(i, c, True, self.parsed.echo, prompt_logprobs)
                for i, c in enumerate(choices)
            ],
            "usage": self._usage(completion_tokens),
        }
        if self.chat and self.parsed.prompt_logprobs is not None:  # vLLM's place for it
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt_logprobs)
        return body

    async def sse(
        self,
        first: RequestDelta | None,
        deltas: AsyncIterator[RequestDelta],
        resume: tuple[int, int] | None,
        event_ids: bool = False,
    ) -> AsyncIterator[str]:
        """The events of ``first`` and then of ``deltas``, ended by ``[DONE]``, each output's
        with id ``EVENT.OUTPUT`` when ``event_ids``. A failure mid-stream is sent as an error
        event before ``[DONE]``, as vLLM sends it: the 200 is out by then, and a silent close
        would look like a finished stream."""
        try:
            async for event in self._events(_prepend(first, deltas), resume, event_ids):
                yield event
        except Exception as e:
            yield f"data: {to_json(client_error(e, self.request_id).body())}\n\n"
        finally:
            await deltas.aclose()
        yield "data: [DONE]\n\n"

    async def _events(
        self, deltas: AsyncIterator[RequestDelta], resume: tuple[int, int] | None, ids: bool
    ) -> AsyncIterator[str]:
        """One SSE event per output of each delta; a resumed stream skips what the client's
        Last-Event-ID says it has."""
        completion_tokens = 0
        if self.chat and resume is None:
            roles = [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(self.parsed.params.n)
            ]
            yield _event(None, self._chunk(roles))
        held = _HeldCalls(self) if self.parsed.tools is not None else None
        async for delta in deltas:
            for out in delta.outputs:
                if resume is not None and (delta.event, out.index) <= resume:
                    continue
                completion_tokens += len(out.token_ids)
                choice = Choice(
                    [out.text], out.token_ids, out.logprobs, out.top_logprobs, out.finish_reason
                )
                echo = self.parsed.echo and delta.event == 1  # the prompt, as vLLM streams it
                if held:
                    sent = held.delta(out.index, choice)
                else:
                    sent = self._choice(out.index, choice, False, echo, delta.prompt_logprobs)
                if sent is not None:
                    chunk = self._chunk([sent])
                    yield _event(f"{delta.event}.{out.index}" if ids else None, chunk)
        if self.parsed.include_usage:
            yield _event(None, self._chunk([]) | {"usage": self._usage(completion_tokens)})

    def _chunk(self, choices: list[dict]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
        }

    def _choice(
        self,
        index: int,
        c: Choice,
        final: bool = False,
        echo: bool = False,
        prompt_logprobs: list[PromptLogprob] | None = None,
    ) -> dict[str, Any]:
        """One choice; with ``echo`` (completions) the prompt's text, and with logprobs its
        tokens, come first; a finished chat choice that is a tool call comes as one."""
        body: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason}
        if not self.chat:
            body["logprobs"] = None
            if self.parsed.logprobs is not None:
                body["logprobs"] = self._completion_logprobs(c, echo, prompt_logprobs)
            body["text"] = self._prompt_text() + c.text if echo else c.text
            if final and self.parsed.prompt_logprobs is not None:
                body["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt_logprobs)
            return body
        body["logprobs"] = self._chat_logprobs(c) if self.parsed.logprobs is not None else None
        if not final:
            return body | {"delta": {"content": c.text}}
        # No refusals here: the field is there, null, as OpenAI's schema requires.
        message = {"role": "assistant", "content": c.text, "refusal": None}
        calls = self.tool_calls(c)
        if calls is not None:
            message |= {"content": None, "tool_calls": calls}
            body["finish_reason"] = "tool_calls"
        return body | {"message": message}

    def tool_calls(self, c: Choice) -> list[dict[str, Any]] | None:
        """The finished choice's text as OpenAI's ``tool_calls``, when it is a call."""
        if self.parsed.tools is None or c.finish_reason != "stop":
            return None
        return self.parsed.tools.calls(c.text)

    def _prompt_text(self) -> str:
        """The prompt as the client sent it (token ids decoded)."""
        prompt = self.parsed.prompts[0]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(self.prompt_ids)

    def _decoded(self, top: dict[int, float]) -> dict[str, float]:
        return {self.tokenizer.decode([t]): finite_logprob(lp) for t, lp in top.items()}

    def _completion_logprobs(
        self, c: Choice, echo: bool, prompt_logprobs: list[PromptLogprob] | None
    ) -> dict[str, Any]:
        """OpenAI's legacy shape; with ``echo`` the prompt's tokens first, the first one's
        logprob and alternatives null (nothing comes before it)."""
        token_ids = c.token_ids
        logprobs: list[float | None] = [finite_logprob(lp) for lp in c.logprobs]
        tops: list[dict[str, float] | None] = [self._decoded(top) for top in c.top_logprobs]
        if echo:
            k = self.parsed.logprobs or 0
            scores = _aligned(self.prompt_ids, prompt_logprobs)
            token_ids = self.prompt_ids + token_ids
            logprobs = [p if p is None else finite_logprob(p.logprob) for p in scores] + logprobs
            prompt_tops = [
                p if p is None else self._decoded(_first(p.top_logprobs, k)) for p in scores
            ]
            tops = prompt_tops + tops
        tokens = [self.tokenizer.decode([t]) for t in token_ids]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": tops,
            "text_offset": offsets if tokens else [],
        }

    def _vllm_prompt_logprobs(
        self, prompt_logprobs: list[PromptLogprob] | None
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token (null for the first), the token and
        the top alternatives by id, each with its logprob, rank and text."""
        k = self.parsed.prompt_logprobs or 0
        shaped: list[dict[str, dict[str, Any]] | None] = []
        scores = _aligned(self.prompt_ids, prompt_logprobs)
        for token_id, p in zip(self.prompt_ids, scores, strict=True):
            if p is None:
                shaped.append(None)
                continue
            entries = {str(token_id): self._vllm_logprob(token_id, p.logprob, p.rank)}
            for rank, (t, lp) in enumerate(_first(p.top_logprobs, k).items(), start=1):
                entries.setdefault(str(t), self._vllm_logprob(t, lp, rank))
            shaped.append(entries)
        return shaped

    def _vllm_logprob(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        decoded = self.tokenizer.decode([token_id])
        return {"logprob": finite_logprob(logprob), "rank": rank, "decoded_token": decoded}

    def _chat_logprobs(self, c: Choice) -> dict[str, Any]:
        tokens = [self.tokenizer.decode([t]) for t in c.token_ids]
        logprobs = [finite_logprob(lp) for lp in c.logprobs]
        tops = [self._decoded(top) for top in c.top_logprobs]
        content = []
        for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            top = [
                {"token": t, "logprob": v, "bytes": list(t.encode())}
                for t, v in (tops[i].items() if i < len(tops) else [])
            ]
            content.append(
                {"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": top}
            )
        return {"content": content, "refusal": None}

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_len,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_len + completion_tokens,
        }


def _aligned(
    prompt_ids: list[int], prompt_logprobs: list[PromptLogprob] | None
) -> list[PromptLogprob | None]:
    """One entry per prompt token: None for the first (nothing before it) and for any the
    engine did not score (a request it ended before its prompt ran)."""
    scored = prompt_logprobs or []
    return [None, *scored, *[None] * (len(prompt_ids) - 1 - len(scored))][: len(prompt_ids)]


def _first(top: dict[int, float], k: int) -> dict[int, float]:
    """The ``k`` most likely of ``top`` (which holds them most likely first)."""
    return dict(itertools.islice(top.items(), k))


class _HeldCalls:
    """A stream's choices that may be tool calls are held back until they end, then sent
    as one ``tool_calls`` delta (OpenAI's shape: the call's id, type, name and arguments,
    ``finish_reason: "tool_calls"``). With ``tool_choice: "auto"`` a choice whose text
    starts otherwise than a JSON object is an answer: what was held goes out as content,
    and the rest streams as usual."""

    def __init__(self, renderer: Renderer) -> None:
        self.renderer = renderer
        self.held: dict[int, Choice] = {}
        self.answers: set[int] = set()

    def delta(self, index: int, c: Choice) -> dict[str, Any] | None:
        """The chunk choice to send for ``c``, or None while it is held."""
        if index in self.answers:
            return self.renderer._choice(index, c)
        held = self.held.setdefault(index, Choice())
        held.add(c)
        text = held.text.lstrip()
        if self.renderer.parsed.tools.choice == "auto" and text and not text.startswith("{"):
            self.answers.add(index)
            return self.renderer._choice(index, self.held.pop(index))
        if c.finish_reason is None:
            return None
        calls = self.renderer.tool_calls(self.held.pop(index))
        if calls is None:
            return self.renderer._choice(index, held)
        call = {"index": 0, **calls[0]}
        delta = {"role": "assistant", "content": None, "tool_calls": [call]}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": "tool_calls"}


def _event(event_id: str | None, payload: dict[str, Any]) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {to_json(payload)}\n\n"


async def _prepend(
    first: RequestDelta | None, rest: AsyncIterator[RequestDelta]
) -> AsyncIterator[RequestDelta]:
    if first is not None:
        yield first
    async for delta in rest:
        yield delta
