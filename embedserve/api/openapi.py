"""What `/openapi.json` says about each route: its real request body and every status it can
answer, each error in OpenAI's envelope.

The routes read their bodies themselves (`common.parse_body`: JSON whatever the Content-Type,
our own error messages), so FastAPI cannot see the schemas; `route_doc` declares them and
`complete` adds the body models to the document's components.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_DESCRIPTIONS = {
    400: "Invalid request: the message names the field and what to change",
    401: "Missing or wrong API key",
    404: "Unknown model, index or route",
    409: "The index was built with another model than the one asked for",
    413: "Request body over --max-body-bytes",
    429: "Queue full, too many requests in flight, or --rate-limit passed; retry after `Retry-After` seconds",
    503: "Loading, draining for shutdown, or an engine not running; retry after `Retry-After` seconds",
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


def route_doc(body: type[BaseModel] | None = None, *statuses: int,
              ok: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for a route decorator: the request body `body` (required JSON), the
    error `statuses` the route itself may answer besides the guard's, and the success
    response's content types (`ok`, default JSON)."""
    codes = set(statuses) | set(_GUARDED) | ({400, 413} if body is not None else set())
    responses: dict[int | str, dict] = {code: {"model": ErrorEnvelope, "description": _DESCRIPTIONS[code]}
                                        for code in sorted(codes)}
    if ok is not None:
        responses[200] = {"description": "Success", "content": ok}
    doc: dict[str, Any] = {"responses": responses}
    if body is not None:
        _BODIES[body.__name__] = body
        doc["openapi_extra"] = {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}}
    return doc


def complete(document: dict) -> dict:
    """Add the body models (and the models they use) to the document's components."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name, model in _BODIES.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for sub, sub_schema in schema.pop("$defs", {}).items():
            schemas.setdefault(sub, sub_schema)
        schemas[name] = schema
    return document
