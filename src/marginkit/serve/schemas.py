"""The server's request and response bodies as pydantic models: they validate the fields of a
request and document every answer in ``/openapi.json`` (``response_model=``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ClassifyRequest",
    "ClassifyResponse",
    "EmbedRequest",
    "EmbedResponse",
    "EnrollRequest",
    "EnrollResponse",
    "ErrorResponse",
    "HealthResponse",
    "IdentifyRequest",
    "IdentifyResponse",
    "MetricsResponse",
    "RemoveResponse",
    "VerifyRequest",
    "VerifyResponse",
]

Samples = Field(
    None,
    description="a batch [B, ...] of raw samples (nested lists); images as floats in [0, 1] or as "
    "integers 0..255 (8-bit levels: an array of integers only is read as 8-bit)",
)
Embeddings = Field(None, description="a batch [B, D] of embeddings (nested lists)")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbedRequest(_Body):
    inputs: list[Any] | None = Samples


class ClassifyRequest(_Body):
    inputs: list[Any] | None = Samples
    embeddings: list[Any] | None = Embeddings
    index: str = Field(
        "bundle",
        pattern="^(bundle|gallery)$",
        description="the bundle's training classes, or the gallery's identities",
    )


class VerifyRequest(_Body):
    inputs: list[Any] | None = Samples
    embeddings: list[Any] | None = Embeddings
    identity: str | None = Field(None, description="the claimed identity of every probe")
    identities: list[str] | None = Field(None, description="one claimed identity per probe")


class IdentifyRequest(_Body):
    inputs: list[Any] | None = Samples
    embeddings: list[Any] | None = Embeddings
    k: int = Field(5, ge=1, le=100, description="candidates returned per probe")


class EnrollRequest(_Body):
    inputs: list[Any] | None = Samples
    embeddings: list[Any] | None = Embeddings
    identity: str | None = Field(None, description="every sample becomes a template of this identity")
    identities: list[str] | None = Field(None, description="one identity per sample (batch enrollment)")
    metadata: dict[str, Any] | None = Field(None, description="JSON object stored with the identity")


# ---------------------------------------------------------------------------------- answers
class ErrorResponse(BaseModel):
    """Every refusal (4xx)."""

    detail: str = Field(description="what was wrong with the request")


class EmbedResponse(BaseModel):
    embeddings: list[list[float]] = Field(description="[B, D] embeddings (not normalised)")
    dim: int = Field(description="D")
    model_fingerprint: str


class ClassResult(BaseModel):
    label: int | None = Field(description="class id (index 'bundle'), null for gallery identities")
    name: str = Field(description="class name, or the identity (index 'gallery')")
    share: float = Field(description="share of the k nearest neighbours' votes for it")


class ClassifyResponse(BaseModel):
    results: list[ClassResult] = Field(description="one per sample")


class VerifyResult(BaseModel):
    identity: str = Field(description="the claimed identity")
    score: float = Field(description="largest cosine between the probe and the identity's templates")
    match: bool = Field(description="score > threshold")
    threshold: float


class VerifyResponse(BaseModel):
    results: list[VerifyResult] = Field(description="one per probe")


class Candidate(BaseModel):
    identity: str
    score: float = Field(description="largest cosine between the probe and the identity's templates")


class IdentifyResult(BaseModel):
    identity: str | None = Field(description="the best candidate if its score > threshold, else null")
    decision: Literal["match", "unknown"]
    score: float | None = Field(description="the best candidate's score (null: empty gallery)")
    threshold: float
    candidates: list[Candidate] = Field(description="the k best identities, best first")


class IdentifyResponse(BaseModel):
    results: list[IdentifyResult] = Field(description="one per probe")


class Enrolled(BaseModel):
    identity: str
    added: int = Field(description="templates added by this request")
    templates: int = Field(description="templates the identity holds now")


class EnrollResponse(BaseModel):
    enrolled: list[Enrolled] = Field(description="one per identity of the request")


class RemoveResponse(BaseModel):
    removed: str = Field(description="the identity removed with its templates")


class ModelFacts(BaseModel):
    format: str = Field(description="onnx or torchscript")
    model_fingerprint: str
    input_shape: list[int]
    input_kind: str = Field(description="image, vector or audio")
    sample_rate: int | None = Field(
        default=None, description="audio: the rate (Hz) waveforms are resampled to; else null"
    )
    embedding_dim: int
    classes: int = Field(description="training classes of the bundle's K-NN index")


class GalleryFacts(BaseModel):
    identities: int
    templates: int


class HealthResponse(BaseModel):
    status: Literal["ok"]
    model: ModelFacts
    gallery: GalleryFacts
    threshold: float | None = Field(description="decision threshold: accept iff score > threshold")
    far: float | None = Field(description="target false-accept rate the threshold was calibrated at")


class Latency(BaseModel):
    window: int = Field(description="requests the percentiles are over (the last ones)")
    mean: float
    p50: float
    p99: float
    max: float


class RouteStats(BaseModel):
    count: int
    status: dict[str, int] = Field(description="requests per HTTP status code")
    latency_ms: Latency


class MetricsResponse(BaseModel):
    uptime_s: float
    requests: dict[str, RouteStats] = Field(description="per 'METHOD /route' of this worker process")
