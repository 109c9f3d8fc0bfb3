"""Request schemas and input validation for the OpenAI-compatible API.

`input` is validated by hand rather than by a pydantic union, so each error names the
offending index and says what to change instead of listing four union branches.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from ..errors import ValidationError


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI's fields plus embedserve's extensions)."""

    model_config = ConfigDict(extra="ignore")

    input: Any = Field(..., description="a string, a list of strings, a list of token ids, or a list of such lists")
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = Field(default=None, max_length=256)
    # extensions
    embedding_types: list[Literal["dense", "sparse", "colbert"]] | None = Field(default=None, min_length=1)
    input_type: Literal["query", "passage"] | None = None
    truncate: StrictBool = False


def parse_inputs(raw: Any, max_inputs: int) -> tuple[list[str] | None, list[list[int]] | None]:
    """Split `input` into texts or token-id lists, refusing anything ambiguous or empty."""
    if isinstance(raw, str):
        raw = [raw]
        single = True
    else:
        single = False
    if not isinstance(raw, list):
        raise ValidationError("`input` must be a string, a list of strings, a list of token ids or a "
                              f"list of token-id lists, not {type(raw).__name__}", param="input")
    if not raw:
        raise ValidationError("`input` is an empty list; send at least one text", param="input")
    if len(raw) > max_inputs:
        raise ValidationError(f"`input` has {len(raw)} items; the limit (--max-client-batch-size) is "
                              f"{max_inputs}; split the request", param="input", code="too_many_inputs")
    if all(isinstance(x, str) for x in raw):
        for i, t in enumerate(raw):
            if not t.strip():
                where = "`input`" if single else f"input {i}"
                raise ValidationError(f"{where} is an empty string; every input needs text", param="input")
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                where = "`input`" if single else f"input {i}"
                raise ValidationError(f"{where} contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff); "
                                      "send valid Unicode text", param="input") from None
        return raw, None
    if all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        return None, [raw]
    if all(isinstance(x, list) for x in raw):
        for i, ids in enumerate(raw):
            if not ids:
                raise ValidationError(f"input {i} is an empty token list", param="input")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValidationError(f"input {i} must be a list of integer token ids", param="input")
        return None, raw
    odd = next((i for i, x in enumerate(raw) if not isinstance(x, (str, int, list)) or isinstance(x, bool)), None)
    if odd is not None:
        raise ValidationError(f"input {odd} is a {type(raw[odd]).__name__}; inputs are strings, integer token "
                              "ids or lists of token ids", param="input")
    raise ValidationError("`input` mixes types; send all strings, or all token ids, or all token-id lists",
                          param="input")
