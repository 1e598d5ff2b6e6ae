"""The HTTP API (FastAPI): embedding, K-NN classification, verification, identification, enrollment.

Every POST takes JSON or a form upload (:mod:`.inputs`); samples are a batch ``[B, ...]``
of raw ``inputs`` (preprocessed like the training data) or of ``embeddings`` ``[B, D]``.
Every refusal is a 4xx with ``{"detail": message}``: 401 (token), 404 (unknown identity),
409 (empty gallery), 413 (body, batch or image too large), 415 (unreadable file), 422 (bad
field, shape, NaN). Work on samples runs in the thread pool, off the event loop.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import torch
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from marginkit.knn._search import prepare
from marginkit.serve.inputs import BadInput, Limits, Payload, parse_form, parse_json
from marginkit.serve.limits import BodyLimit, Recorder, RequestStats

__all__ = ["create_app"]

Samples = Field(None, description="a batch [B, ...] of raw samples (nested lists)")
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


def _body_doc(model: type[BaseModel], fields: str) -> dict[str, Any]:
    form = {
        "type": "object",
        "properties": {
            "file": {
                "type": "string",
                "format": "binary",
                "description": "an .npz with 'x' or 'embeddings', or one image",
            }
        },
        "description": f"form fields: {fields} (objects and lists as JSON text)",
    }
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": model.model_json_schema()},
                "multipart/form-data": {"schema": form},
            },
        }
    }


def create_app(
    bundle: Any,
    gallery: Any,
    *,
    token: str | None = None,
    limits: Limits | None = None,
) -> Any:
    """The FastAPI application serving ``bundle`` (a loaded :class:`~marginkit.export.Bundle`)
    and ``gallery`` (a :class:`~marginkit.gallery.Gallery` opened with that bundle).

    ``token``: when given, every endpoint but ``GET /health`` and the docs needs the header
    ``Authorization: Bearer <token>``.
    """
    from marginkit import __version__
    from marginkit.gallery import GalleryError, UnknownIdentityError

    limits = limits or Limits()
    recorder = Recorder()
    bundle.knn()  # load and check the K-NN index now, not in the first request
    app = FastAPI(
        title="marginkit",
        version=__version__,
        description="Embeddings, K-NN classification, verification at a calibrated FAR and open-set "
        "identification over a persistent gallery.",
    )
    app.state.recorder, app.state.bundle, app.state.gallery = recorder, bundle, gallery

    @app.exception_handler(BadInput)
    async def _bad_input(request: Request, exc: BadInput) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    @app.exception_handler(UnknownIdentityError)
    async def _unknown(request: Request, exc: UnknownIdentityError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(GalleryError)
    async def _gallery(request: Request, exc: GalleryError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _validation_message(exc.errors())}, status_code=422)

    def authorize(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), token.encode()):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    async def payload(request: Request, model: type[BaseModel]) -> tuple[Payload, BaseModel]:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == "multipart/form-data":
            try:
                form = await request.form(max_files=1, max_fields=16, max_part_size=limits.max_body_bytes)
            except Exception as exc:  # Starlette's MultiPartException and parser errors
                raise BadInput(f"malformed form upload: {exc}", 400) from None
            try:
                data = parse_form(form, bundle.input_shape, limits)
            finally:
                await form.close()
        elif ctype in ("application/json", ""):
            data = parse_json(await request.body())
        else:
            raise BadInput(
                f"unsupported content type {ctype!r}; send application/json or multipart/form-data", 415
            )
        try:
            fields = model.model_validate(data.fields)
        except ValidationError as exc:
            raise BadInput(_validation_message(exc.errors())) from None
        if data.array is not None and data.kind == "embeddings" and model is EmbedRequest:
            raise BadInput("/embed takes raw 'inputs', not embeddings")
        return data, fields

    def probes(data: Payload) -> torch.Tensor:
        """Unit embeddings ``[B, D]`` of the payload's samples."""
        if data.array is None:
            raise BadInput("no samples: give 'inputs' or 'embeddings' (JSON), or a file (form upload)")
        array = data.array
        if data.kind == "embeddings":
            d = bundle.embedding_dim
            if array.ndim == 1:
                array = array[None]
            if array.ndim != 2 or array.shape[1] != d:
                raise BadInput(f"embeddings must have shape [B, {d}], got {list(data.array.shape)}")
            _check_batch(array.shape[0])
            with np.errstate(over="ignore"):
                emb = torch.from_numpy(array.astype(np.float32))
            if not bool(torch.isfinite(emb).all()):
                raise BadInput("embeddings exceed float32's range (|value| above 3.4e38)")
        else:
            emb = embed_inputs(array)
        if bool((emb == 0).all(dim=1).any()):
            raise BadInput("an embedding is all zeros: its cosine is undefined")
        return prepare(emb, "cosine", "embeddings", torch.float32)  # (any scale: no overflow)

    def embed_inputs(array: np.ndarray) -> torch.Tensor:
        """Raw samples (a batch; one vector sample may come unbatched) -> embeddings."""
        if array.ndim == len(bundle.input_shape) and bundle.input_kind != "image":
            array = array[None]
        _check_batch(array.shape[0])
        try:
            return bundle.embed(array.astype(np.float32) if array.dtype.kind == "f" else array)
        except ValueError as exc:
            raise BadInput(f"inputs: {exc}") from None

    def _check_batch(n: int) -> None:
        if n > limits.max_batch:
            raise BadInput(f"batch of {n} samples exceeds the limit of {limits.max_batch}", 413)
        if n == 0:
            raise BadInput("the batch holds no sample")

    guarded = [Depends(authorize)]

    @app.get("/health", summary="liveness, model and gallery facts")
    def health() -> dict[str, Any]:  # sync: FastAPI runs it in the thread pool (the gallery lock)
        return {
            "status": "ok",
            "model": {
                "format": bundle.format, "model_fingerprint": bundle.model_fingerprint,
                "input_shape": list(bundle.input_shape), "input_kind": bundle.input_kind,
                "embedding_dim": bundle.embedding_dim, "classes": len(bundle.class_names),
            },
            "gallery": {"identities": len(gallery), "templates": gallery.num_templates},
            "threshold": gallery.threshold, "far": gallery.far,
        }  # fmt: skip

    @app.get("/metrics", summary="request counts and latencies per route", dependencies=guarded)
    def metrics() -> dict[str, Any]:
        return recorder.snapshot()

    def post(path: str, model: type[BaseModel], summary: str, form_fields: str) -> Any:
        """Register ``work(data, fields) -> dict`` as ``POST path``; it runs in the thread pool,
        and a ``ValueError``/``TypeError`` it raises (a library input check) is a 422."""

        def register(work: Any) -> Any:
            def guarded_work(data: Payload, fields: BaseModel) -> dict[str, Any]:
                try:
                    return work(data, fields)
                except (BadInput, GalleryError):  # their own status codes
                    raise
                except (ValueError, TypeError) as exc:
                    raise BadInput(str(exc)) from None

            async def endpoint(request: Request) -> dict[str, Any]:
                data, fields = await payload(request, model)
                return await run_in_threadpool(guarded_work, data, fields)

            app.post(
                path, summary=summary, dependencies=guarded, openapi_extra=_body_doc(model, form_fields),
                name=work.__name__,
            )(endpoint)  # fmt: skip
            return work

        return register

    @post("/embed", EmbedRequest, "embeddings of raw inputs", "file")
    def embed(data: Payload, fields: Any) -> dict[str, Any]:
        if data.array is None:
            raise BadInput("no samples: give 'inputs' (JSON) or a file (form upload)")
        emb = embed_inputs(data.array)
        return {
            "embeddings": emb.tolist(),
            "dim": bundle.embedding_dim,
            "model_fingerprint": bundle.model_fingerprint,
        }

    @post("/classify", ClassifyRequest, "K-NN class of each sample", "index, file")
    def classify(data: Payload, fields: Any) -> dict[str, Any]:
        emb = probes(data)
        if fields.index == "gallery":
            found = gallery.classify(emb, kind="embeddings")
            return {"results": [{"label": None, "name": c.identity, "share": c.share} for c in found]}
        knn = bundle.knn()
        share, column = knn.predict_proba(emb).max(dim=1)
        labels = knn.classes_[column.numpy()].tolist()  # the columns are the sorted labels (classes_)
        names = bundle.class_names
        results = [
            {
                "label": c if isinstance(c, int) else None,
                "name": names[c] if isinstance(c, int) and 0 <= c < len(names) else str(c),
                "share": float(v),
            }
            for c, v in zip(labels, share, strict=True)
        ]
        return {"results": results}

    @post(
        "/verify",
        VerifyRequest,
        "score and decision of probes against claimed identities",
        "identity or identities, file",
    )
    def verify(data: Payload, fields: Any) -> dict[str, Any]:
        if (fields.identity is None) == (fields.identities is None):
            raise BadInput("give exactly one of 'identity' (all probes) or 'identities' (one per probe)")
        claims = fields.identity if fields.identities is None else fields.identities
        res = gallery.verify(probes(data), claims, kind="embeddings")
        res = res if isinstance(res, list) else [res]
        return {
            "results": [
                {"identity": v.identity, "score": v.score, "match": v.match, "threshold": v.threshold}
                for v in res
            ]
        }

    @post(
        "/identify",
        IdentifyRequest,
        "ranked identities of each probe, 'unknown' below the threshold",
        "k, file",
    )
    def identify(data: Payload, fields: Any) -> dict[str, Any]:
        res = gallery.identify(probes(data), k=fields.k, kind="embeddings")
        return {
            "results": [
                {
                    "identity": r.identity,
                    "decision": "unknown" if r.unknown else "match",
                    "score": r.score,
                    "threshold": r.threshold,
                    "candidates": [{"identity": c.identity, "score": c.score} for c in r.candidates],
                }
                for r in res
            ]
        }

    @post(
        "/enroll",
        EnrollRequest,
        "add samples as templates of an identity (or one identity per sample)",
        "identity or identities, metadata, file",
    )
    def enroll(data: Payload, fields: Any) -> dict[str, Any]:
        one, many = fields.identity, fields.identities
        if (one is None) == (many is None):
            raise BadInput("give exactly one of 'identity' (all samples) or 'identities' (one per sample)")
        if many is not None and fields.metadata is not None:
            raise BadInput("'metadata' goes with a single 'identity'")
        emb = probes(data)
        if one is not None:
            done = [gallery.enroll(one, emb, fields.metadata, kind="embeddings")]
        else:
            done = gallery.enroll_many(many, emb, kind="embeddings")
        return {
            "enrolled": [{"identity": e.identity, "added": e.added, "templates": e.templates} for e in done]
        }

    @app.delete(
        "/identities/{identity}", summary="remove an identity and its templates", dependencies=guarded
    )
    async def remove(identity: str) -> dict[str, Any]:
        try:
            await run_in_threadpool(gallery.remove, identity)
        except (ValueError, TypeError) as exc:
            raise BadInput(str(exc)) from None
        return {"removed": identity}

    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(RequestStats, recorder=recorder)
    return app


def _validation_message(errors: Any) -> str:
    parts = []
    for e in list(errors)[:5]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)
