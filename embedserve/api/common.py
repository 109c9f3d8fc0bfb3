"""Request helpers every router uses: body parsing, waiting for a client to leave, and
awaiting the embedding engine (model work stays on the engine thread)."""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError as PydanticValidationError

from ..embedders import token_batches
from ..engine.batch_queue import EmbedRequest
from ..errors import EmbedServeError, UnavailableError, ValidationError
from .state import AppState

logger = logging.getLogger(__name__)


async def parse_body(request: Request, schema):
    """JSON whatever the Content-Type says (curl's default is form-encoded), then the schema."""
    return validate_body(await read_json(request), schema)


async def read_json(request: Request) -> dict:
    """The body as a JSON object (a route that picks its schema by the keys reads it once)."""
    raw = await request.body()
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValidationError(f"request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(obj, dict):
        raise ValidationError(f"request body must be a JSON object, not {type(obj).__name__}")
    return obj


def validate_body(obj: dict, schema):
    try:
        return schema.model_validate(obj)
    except PydanticValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def check_unicode(text: str, where: str, param: str) -> str:
    """`text` if it is valid Unicode (JSON's `\\ud800` escapes decode to lone surrogates, which
    no tokenizer takes): a 400 naming `where` otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(f"{where} contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff); "
                              "send valid Unicode text", param=param) from None
    return text


async def wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (uvicorn sends http.disconnect once the body is read)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def embed_via_engine(state: AppState, inputs: list[list[int]], want: set[str],
                           request: Request | None = None, engine=None,
                           segments: list[int | None] | None = None) -> EmbedRequest | None:
    """Submit token-id inputs to `engine` (default: the default model's) and wait; None if the
    client went away first (its queued inputs are then dropped before the model runs them).
    `segments`: a cross-encoder's pairs, where each one's document segment starts."""
    engine = engine or state.require_embedder()
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def on_done(r):
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(r))

    req = EmbedRequest(inputs=inputs, want=frozenset(want), on_done=on_done, segments=segments)
    engine.submit(req)
    state.metrics.tokens.inc(req.num_tokens)
    waiters = {done}
    gone = asyncio.ensure_future(wait_disconnect(request)) if request is not None else None
    if gone is not None:
        waiters.add(gone)
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        engine.abort(req)
        raise
    finally:
        if gone is not None:
            gone.cancel()
    if not done.done():
        engine.abort(req)
        logger.info("client went away; dropped a request of %d inputs", len(inputs))
        return None
    if req.error is not None:
        if isinstance(req.error, EmbedServeError):
            raise req.error
        raise UnavailableError("the model failed on this batch; retry", retry_after=1)
    return req


async def through_batcher(state: AppState, request, engine, inputs: list[list[int]], want: set[str],
                           segments: list | None = None) -> list | None:
    """The outputs of `inputs`, in order, in several engine requests where they hold more tokens
    than the queue may take at once; None if the client went away."""
    budget = max(state.config.embed.max_batch_tokens, state.config.embed.max_queued_tokens // 4)
    outputs: list = []
    for chunk in token_batches([len(x) for x in inputs], budget):
        req = await embed_via_engine(state, [inputs[i] for i in chunk], want, request, engine,
                                     [segments[i] for i in chunk] if segments else None)
        if req is None:
            return None
        outputs.extend(req.outputs)
    return outputs
