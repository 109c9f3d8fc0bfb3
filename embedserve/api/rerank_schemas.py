"""The request and response bodies of the rerank routes (`api.rerank`): Jina / Cohere v1, TEI,
Cohere v2 and vLLM's score, each as its clients send it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, StrictBool, StrictFloat, StrictInt

from ..models.scoring import M3_METHODS

M3_DEFAULT_METHOD = "colbert+sparse+dense"
_DOCS_SCHEMA = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "string"}, {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}]}}


class _Rerank(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    query: str = Field(..., min_length=1)
    top_n: StrictInt | None = Field(default=None, description="return the best `top_n` (default: all)")
    raw_scores: StrictBool = Field(default=False, description="a cross-encoder's logits instead of their sigmoid")
    scoring: Literal[M3_METHODS] | None = Field(   # type: ignore[valid-type]
        default=None, description=f"a BGE-M3 model's score (default {M3_DEFAULT_METHOD}, FlagEmbedding's names)")
    weights: list[StrictFloat | StrictInt] | None = Field(
        default=None, min_length=3, max_length=3,
        description="[dense, sparse, colbert] weights of the BGE-M3 sums (FlagEmbedding's default [1, 1, 1])")


class RerankRequest(_Rerank):
    """POST /v1/rerank and /rerank: Jina's and Cohere v1's shape (plus `raw_scores`, `scoring`, `weights`)."""

    documents: Any = Field(..., description="strings, or objects with `text` (Cohere's `rank_fields` picks others)",
                           json_schema_extra=_DOCS_SCHEMA)
    return_documents: StrictBool = False
    rank_fields: list[str] | None = Field(default=None, min_length=1,
                                          description="with object documents: the fields ranked on, in order")
    max_chunks_per_doc: StrictInt | None = Field(default=None, description="Cohere v1's; not supported (400)")
    max_tokens_per_doc: StrictInt | None = Field(default=None, description="cut each document to this many tokens")


class RerankRequestV2(_Rerank):
    """POST /v2/rerank: Cohere v2's shape."""

    model: str | None = None
    documents: list[str] = Field(..., min_length=1)
    max_tokens_per_doc: StrictInt | None = Field(default=None, description="cut each document to this many tokens")
    return_documents: StrictBool = False
    priority: StrictInt | None = Field(default=None, description="accepted, not used")
    relevant_spans: Any = Field(default=None, description="Cohere v2's; not supported (400)")


class TEIRerankRequest(BaseModel):
    """POST /rerank with `texts`: text-embeddings-inference's shape."""

    model_config = ConfigDict(extra="forbid", strict=True)

    query: str = Field(..., min_length=1)
    texts: list[str] = Field(..., min_length=1)
    raw_scores: StrictBool = False
    return_text: StrictBool = False
    truncate: StrictBool = False
    truncation_direction: Literal["right", "Right"] = "right"
    model: str | None = None


class ScoreRequest(BaseModel):
    """POST /v1/score and /score: vLLM's shape (one `text_1` against each `text_2`, or pairwise lists)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: StrictInt | None = Field(default=None, description="cut each pair's document side "
                                                     "to at most this many tokens")
    raw_scores: StrictBool = False
    user: str | None = Field(default=None, max_length=256)


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int = Field(description="the document's position in the request")
    relevance_score: float
    document: RerankDocument | dict | None = None


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    truncated_documents: list[int] | None = Field(default=None, description="documents cut to fit")
    truncated_tokens: int | None = Field(default=None, description="document tokens cut in all")


class RerankResponse(BaseModel):
    """200 of POST /v1/rerank, /rerank and /v2/rerank: results sorted by score, best first."""

    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
    meta: dict = Field(description="Cohere's billed units")


class TEIRank(BaseModel):
    index: int
    score: float
    text: str | None = None


class TEIRerankResponse(RootModel[list[TEIRank]]):
    """200 of POST /rerank with `texts`: TEI's list, best first."""


class AnyRerankRequest(RootModel[RerankRequest | TEIRerankRequest]):
    """POST /rerank: Jina's / Cohere v1's shape, or TEI's (a body with `texts`)."""


class AnyRerankResponse(RootModel[RerankResponse | TEIRerankResponse]):
    """200 of POST /rerank: Cohere's object, or TEI's list for a body with `texts`."""


class ScoreData(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(BaseModel):
    """200 of POST /v1/score: one score per pair, in request order."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: RerankUsage
