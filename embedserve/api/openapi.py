"""What `/openapi.json` says about each route: its real request body and every status it can
answer, each error in OpenAI's envelope.

The routes read their bodies themselves (`common.parse_body`: JSON whatever the Content-Type,
our own error messages) and write their answers themselves (orjson, SSE), so FastAPI cannot
see either schema; `route_doc` declares both and `complete` adds the body models to the
document's components.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

_DESCRIPTIONS = {
    400: "Invalid request: the message names the field and what to change",
    401: "Missing or wrong API key",
    404: "Unknown model, index or route",
    409: "The index was built with another model than the one asked for",
    413: "Request body over --max-body-bytes",
    429: "Queue full, too many requests in flight, or --rate-limit passed; retry after `Retry-After` seconds",
    503: "Loading, draining for shutdown, or an engine not running; retry after `Retry-After` seconds",
    507: "The volume holding the indexes is full: the write was not applied; free space there and retry",
}
# Every /v1 route passes the guard (401, 429 of --rate-limit) and the drain (503); bodies also 413.
_GUARDED = (401, 429, 503)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorEnvelope(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


_BODIES: dict[str, type[BaseModel]] = {}


def route_doc(body: type[BaseModel] | None = None, *statuses: int, ok: type[BaseModel] | None = None,
              stream: type[BaseModel] | None = None, text: bool = False, status: int = 200) -> dict[str, Any]:
    """Keyword arguments for a route decorator: the request body `body` (required JSON), the
    error `statuses` the route itself may answer besides the guard's, and the success response
    (`status`): the JSON body model `ok`, server-sent events of `stream` chunks as well, or
    plain text (`text`, the Prometheus exposition)."""
    codes = set(statuses) | set(_GUARDED) | ({400, 413} if body is not None else set())
    responses: dict[int | str, dict] = {code: {"model": ErrorEnvelope, "description": _DESCRIPTIONS[code]}
                                        for code in sorted(codes)}
    content: dict[str, dict] = {}
    if ok is not None:
        content["application/json"] = {"schema": _ref(ok)}
    if stream is not None:
        # OpenAPI 3.1: the schema of an event stream describes each event
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"],
            "description": "with `stream: true`: one event per chunk, then `data: [DONE]`",
            "properties": {"data": {"oneOf": [
                {"const": "[DONE]"},
                {"type": "string", "contentMediaType": "application/json", "contentSchema": _ref(stream)}]}}}}
    if text:
        content["text/plain"] = {"schema": {"type": "string"}}
    if content:
        responses[status] = {"description": "Success", "content": content}
    doc: dict[str, Any] = {"responses": responses}
    if text:
        doc["response_class"] = PlainTextResponse       # not FastAPI's default JSON
    if body is not None:
        doc["openapi_extra"] = {"requestBody": {"required": True, "content": {"application/json": {
            "schema": _ref(body)}}}}
    return doc


def _ref(model: type[BaseModel]) -> dict[str, str]:
    """A reference to `model`, which `complete` adds to the document's components."""
    _BODIES[model.__name__] = model
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def complete(document: dict) -> dict:
    """Add the request and response body models (and the models they use) to the document's
    components."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    # FastAPI documents a 422 for path parameters; a request it refuses gets our 400 (api.app)
    for ops in document.get("paths", {}).values():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    for name, model in _BODIES.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for sub, sub_schema in schema.pop("$defs", {}).items():
            schemas.setdefault(sub, sub_schema)
        schemas[name] = schema
    return document
