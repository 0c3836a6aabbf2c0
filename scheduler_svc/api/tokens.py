"""vLLM's tokenizer endpoints and its /version, shaped as vLLM's OpenAI server shapes them:
clients written for vLLM (its benchmark client among them) ask for them."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from pagedserve.settings import ApiConfig
from scheduler_svc.api.admission import (
    ModelCard,
    chat_prompt_ids,
    check_model,
    check_vocabulary,
)
from scheduler_svc.api.protocol import parse_detokenize, parse_tokenize
from scheduler_svc.api.render import VERSION
from scheduler_svc.api.wire import decode_body, read_body


def add_token_routes(app: FastAPI, tokenizer: Any, card: ModelCard, config: ApiConfig) -> None:
    """POST /tokenize (a prompt or chat messages to token ids), POST /detokenize (token ids
    to text) and GET /version; behind the API key like every route with data."""

    async def body(request: Request) -> dict[str, Any]:
        return decode_body(await read_body(request, config.max_body_bytes))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        parsed = parse_tokenize(await body(request), config.max_messages)
        check_model(card.name, parsed.model)
        if parsed.messages is not None:
            ids = chat_prompt_ids(
                tokenizer,
                parsed.messages,
                parsed.add_generation_prompt,
                parsed.add_special_tokens,
            )
        else:
            ids = tokenizer.encode(parsed.prompt, add_special_tokens=parsed.add_special_tokens)
        strs = tokenizer.convert_ids_to_tokens(ids) if parsed.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": card.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        model, ids = parse_detokenize(await body(request))
        check_model(card.name, model)
        return {"prompt": tokenizer.decode(check_vocabulary(ids, card.vocab_size, "tokens"))}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}
