"""The HTTP API (FastAPI): embedding, K-NN classification, verification, identification, enrollment.

Every POST takes JSON, a form upload or a binary ``.npy`` body (:mod:`.inputs`); samples are
a batch ``[B, ...]`` of raw ``inputs`` (preprocessed like the training data) or of
``embeddings`` ``[B, D]``. Every refusal is a 4xx with ``{"detail": message}``: 401 (token),
404 (unknown identity), 409 (empty gallery), 413 (body, batch or image too large), 415
(unreadable file), 422 (bad field, shape, NaN). Answers are written by orjson and documented
by the models of :mod:`.schemas`.

Where the time goes: a one-probe search of a small gallery costs less than a hop to the
thread pool, so requests whose work is a search over at most :data:`INLINE_SCORES` cosines
run on the event loop; model inference, enrollment (a synchronous disk write) and larger
searches run in the thread pool, off the event loop.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import orjson
import torch
from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from marginkit.serve.inputs import (
    AUDIO_TYPES,
    BadInput,
    Limits,
    Payload,
    parse_audio,
    parse_form,
    parse_json,
    parse_npy,
)
from marginkit.serve.limits import BodyLimit, Recorder, RequestStats
from marginkit.serve.schemas import (
    ClassifyRequest,
    ClassifyResponse,
    EmbedRequest,
    EmbedResponse,
    EnrollRequest,
    EnrollResponse,
    ErrorResponse,
    HealthResponse,
    IdentifyRequest,
    IdentifyResponse,
    MetricsResponse,
    RemoveResponse,
    VerifyRequest,
    VerifyResponse,
)

__all__ = ["INLINE_SCORES", "create_app"]

#: Probe-template cosines a request may compute on the event loop (about a millisecond).
INLINE_SCORES = 2**17

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what}
    for code, what in (
        (401, "missing or wrong bearer token"),
        (404, "unknown identity"),
        (409, "the gallery cannot answer (e.g. classify on an empty gallery)"),
        (413, "body, batch or image too large"),
        (415, "unsupported content type or unreadable file"),
        (422, "invalid field, shape or value"),
    )
}

_NPY_PARAMETERS = [
    {
        "name": "kind",
        "in": "query",
        "required": False,
        "schema": {"type": "string", "enum": ["inputs", "embeddings"]},
        "description": "binary (application/x-npy) bodies only, and then required: what the array holds",
    }
]


class _RawRoute(APIRoute):
    """A route whose endpoint takes the raw request and answers a ``Response`` itself.

    FastAPI's per-request machinery (dependency solving, body and response validation) is
    skipped: the endpoint parses the hostile body its own way (:mod:`.inputs`), checks the
    token and writes its answer with orjson. ``response_model``, ``responses`` and
    ``openapi_extra`` still document the route in ``/openapi.json``.
    """

    def get_route_handler(self) -> Any:
        return self.endpoint


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
    npy = {
        "type": "string",
        "format": "binary",
        "description": f"one numpy.save array of samples; query parameters: kind, {fields}"
        " (objects and lists as JSON text)",
    }
    return {
        "parameters": _NPY_PARAMETERS,
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": model.model_json_schema()},
                "multipart/form-data": {"schema": form},
                "application/x-npy": {"schema": npy},
            },
        },
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
    ``Authorization: Bearer <token>``. The docs (``/docs``: Swagger UI, ``/redoc``: ReDoc)
    load their scripts and styles from this server (``fastapi-offline``), never from a CDN.
    """
    from fastapi_offline import FastAPIOffline

    from marginkit import __version__
    from marginkit.gallery import GalleryError, UnknownIdentityError

    limits = limits or Limits()
    recorder = Recorder()
    bundle.knn()  # load and check the K-NN index now, not in the first request
    app = FastAPIOffline(
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

    expected = None if token is None else token.encode()

    security = {} if token is None else {"security": [{"bearer": []}]}

    async def authorize(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), expected):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    audio_rate = getattr(bundle, "sample_rate", None) if bundle.input_kind == "audio" else None

    async def payload(request: Request, model: type[BaseModel]) -> tuple[Payload, BaseModel]:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == "multipart/form-data":
            try:
                form = await request.form(max_files=1, max_fields=16, max_part_size=limits.max_body_bytes)
            except Exception as exc:  # Starlette's MultiPartException and parser errors
                raise BadInput(f"malformed form upload: {exc}", 400) from None
            try:
                data = parse_form(form, bundle.input_shape, limits, audio_rate)
            finally:
                await form.close()
        elif ctype in ("application/json", ""):
            data = parse_json(await request.body())
        elif ctype == "application/x-npy":
            data = parse_npy(await request.body(), request.query_params, limits)
        elif ctype in AUDIO_TYPES:
            data = parse_audio(await request.body(), request.query_params, limits, audio_rate)
        else:
            raise BadInput(
                f"unsupported content type {ctype!r}; send application/json, multipart/form-data "
                "or application/x-npy" + (" or audio/wav / audio/flac" if audio_rate else ""),
                415,
            )
        try:
            fields = model.model_validate(data.fields)
        except ValidationError as exc:
            raise BadInput(_validation_message(exc.errors())) from None
        if data.array is not None and data.kind == "embeddings" and model is EmbedRequest:
            raise BadInput("/embed takes raw 'inputs', not embeddings")
        return data, fields

    def probes(data: Payload) -> torch.Tensor:
        """Embeddings ``[B, D]`` (float32) of the payload's samples, each with a direction.

        Not normalised here: the gallery and the K-NN index normalise what they are given
        (``prepare``, which also takes float64 rows beyond float32's range as directions), so
        doing it twice would only cost time. The parsers have refused non-finite numbers.
        """
        if data.array is None:
            raise BadInput(
                "no samples: give 'inputs' or 'embeddings' (JSON), a file (form upload) or a .npy body"
            )
        array = data.array
        if data.kind == "embeddings":
            d = bundle.embedding_dim
            if array.ndim == 1:
                array = array[None]
            if array.ndim != 2 or array.shape[1] != d:
                raise BadInput(f"embeddings must have shape [B, {d}], got {list(data.array.shape)}")
            _check_batch(array.shape[0])
            if bool((array == 0).all(axis=1).any()):
                raise BadInput("an embedding is all zeros: its cosine is undefined")
            # float64 (JSON's numbers) stays float64: `prepare` casts after checking the range
            wide = np.promote_types(array.dtype, np.float32)
            return torch.from_numpy(np.ascontiguousarray(array, dtype=wide))
        emb = embed_inputs(array)
        if bool((emb == 0).all(dim=1).any()):
            raise BadInput("an embedding is all zeros: its cosine is undefined")
        return emb

    def embed_inputs(array: np.ndarray) -> torch.Tensor:
        """Raw samples (a batch; one vector sample may come unbatched) -> embeddings."""
        if array.ndim == len(bundle.input_shape) and bundle.input_kind != "image":
            array = array[None]
        _check_batch(array.shape[0])
        try:
            return bundle.embed(_model_inputs(array, bundle.input_kind))
        except ValueError as exc:
            raise BadInput(f"inputs: {exc}") from None

    def _check_batch(n: int) -> None:
        if n > limits.max_batch:
            raise BadInput(f"batch of {n} samples exceeds the limit of {limits.max_batch}", 413)
        if n == 0:
            raise BadInput("the batch holds no sample")

    def light(data: Payload, references: int) -> bool:
        """Whether the request is a search small enough to run on the event loop."""
        if data.kind != "embeddings" or data.array is None:
            return False
        rows = data.array.shape[0] if data.array.ndim > 1 else 1
        return rows * max(references, 1) <= INLINE_SCORES

    @app.get("/health", summary="liveness, model and gallery facts", response_model=HealthResponse)
    def health() -> dict[str, Any]:  # sync: FastAPI runs it in the thread pool (the gallery lock)
        return {
            "status": "ok",
            "model": {
                "format": bundle.format, "model_fingerprint": bundle.model_fingerprint,
                "input_shape": list(bundle.input_shape), "input_kind": bundle.input_kind,
                "embedding_dim": bundle.embedding_dim, "classes": len(bundle.class_names),
                "sample_rate": audio_rate,
            },
            "gallery": {"identities": len(gallery), "templates": gallery.num_templates},
            "threshold": gallery.threshold, "far": gallery.far,
        }  # fmt: skip

    @app.get(
        "/metrics", summary="request counts and latencies per route (this worker process)",
        response_model=MetricsResponse, responses={401: _ERRORS[401]}, openapi_extra=security,
    )  # fmt: skip
    async def metrics(request: Request) -> dict[str, Any]:
        await authorize(request)
        return recorder.snapshot()

    direct: dict[str, Any] = {}  # POST path -> its route, dispatched by _Direct

    def post(
        path: str, model: type[BaseModel], answer: type[BaseModel], summary: str, form_fields: str,
        references: Any = None,
    ) -> Any:  # fmt: skip
        """Register ``work(data, fields) -> dict`` as ``POST path`` answering ``answer``. It runs on
        the event loop when ``references(fields)`` (the references one probe is scored against)
        makes it :func:`light`, else in the thread pool; a ``ValueError``/``TypeError`` it raises
        (a library input check) is a 422."""

        def register(work: Any) -> Any:
            def guarded_work(data: Payload, fields: BaseModel) -> dict[str, Any]:
                try:
                    return work(data, fields)
                except (BadInput, GalleryError):  # their own status codes
                    raise
                except (ValueError, TypeError) as exc:
                    raise BadInput(str(exc)) from None

            async def endpoint(request: Request) -> Response:
                await authorize(request)
                data, fields = await payload(request, model)
                if references is not None and light(data, references(fields)):
                    result = guarded_work(data, fields)
                else:
                    result = await run_in_threadpool(guarded_work, data, fields)
                headers = {"X-Marginkit-Input": "; ".join(data.notes)} if data.notes else None
                return Response(
                    orjson.dumps(result, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json",
                    headers=headers,
                )  # fmt: skip

            app.router.add_api_route(
                path, endpoint, methods=["POST"], route_class_override=_RawRoute, summary=summary,
                openapi_extra={**_body_doc(model, form_fields), **security}, name=work.__name__,
                response_model=answer, responses=_ERRORS,
            )  # fmt: skip
            direct[path] = app.router.routes[-1]
            return work

        return register

    @post("/embed", EmbedRequest, EmbedResponse, "embeddings of raw inputs", "file")
    def embed(data: Payload, fields: Any) -> dict[str, Any]:
        if data.array is None:
            raise BadInput("no samples: give 'inputs' (JSON), a file (form upload) or a .npy body")
        emb = embed_inputs(data.array)
        return {
            "embeddings": emb.numpy(),
            "dim": bundle.embedding_dim,
            "model_fingerprint": bundle.model_fingerprint,
        }

    def classify_references(fields: Any) -> int:
        return gallery.size_hint() if fields.index == "gallery" else bundle.knn().num_references

    @post(
        "/classify", ClassifyRequest, ClassifyResponse, "K-NN class of each sample", "index, file",
        classify_references,
    )  # fmt: skip
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
            for c, v in zip(labels, share.tolist(), strict=True)
        ]
        return {"results": results}

    @post(
        "/verify", VerifyRequest, VerifyResponse, "score and decision of probes against claimed identities",
        "identity or identities, file", lambda fields: gallery.size_hint(),
    )  # fmt: skip
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
        "/identify", IdentifyRequest, IdentifyResponse,
        "ranked identities of each probe, 'unknown' below the threshold", "k, file",
        lambda fields: gallery.size_hint(),
    )  # fmt: skip
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
        "/enroll", EnrollRequest, EnrollResponse,
        "add samples as templates of an identity (or one identity per sample)",
        "identity or identities, metadata, file",
    )  # fmt: skip
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
        "/identities/{identity}", summary="remove an identity and its templates",
        response_model=RemoveResponse, responses={c: _ERRORS[c] for c in (401, 404, 422)},
        openapi_extra=security,
    )  # fmt: skip
    async def remove(identity: str, request: Request) -> dict[str, Any]:
        await authorize(request)
        try:
            await run_in_threadpool(gallery.remove, identity)
        except (ValueError, TypeError) as exc:
            raise BadInput(str(exc)) from None
        return {"removed": identity}

    if token is not None:
        _document_bearer(app)
    app.add_middleware(_Direct, routes=direct, handlers=app.exception_handlers)  # (innermost)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(RequestStats, recorder=recorder)
    return app


class _Direct:
    """ASGI middleware: a ``POST`` to one of the raw routes goes straight to its endpoint.

    What FastAPI's stack would do for these routes, in one step: match the path, call the
    endpoint with the request, and turn an exception into the answer of the handler registered
    for it (``BadInput`` → its 4xx, ``HTTPException`` → FastAPI's; one without a handler
    propagates to the server-error middleware outside, as before). The endpoints and handlers
    are the app's own, so every answer and refusal is the same; the router's matching of every
    route and the exception and exit-stack middlewares are skipped (about a fifth of a one-probe
    ``/verify``'s time in the server). Everything else passes on to the app.
    """

    def __init__(self, app: Any, routes: dict[str, Any], handlers: dict[Any, Any]) -> None:
        self.app, self.routes, self.handlers = app, routes, handlers

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        route = self.routes.get(scope.get("path")) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        scope["route"] = route  # what the router records, read by RequestStats
        request = Request(scope, receive, send)
        try:
            response = await route.endpoint(request)
        except Exception as exc:
            handler = next((self.handlers[c] for c in type(exc).__mro__ if c in self.handlers), None)
            if handler is None:
                raise
            response = await handler(request, exc)
        await response(scope, receive, send)


def _document_bearer(app: Any) -> None:
    """Declare the bearer scheme in ``/openapi.json`` (Swagger UI's "Authorize" button); the
    routes name it in their ``security`` and check the token themselves."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()  # FastAPI's, cached in app.openapi_schema
        schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
        schemes["bearer"] = {"type": "http", "scheme": "bearer"}
        return schema

    app.openapi = openapi


def _model_inputs(array: np.ndarray, input_kind: str) -> np.ndarray:
    """Raw samples as the bundle takes them: integer images are 8-bit levels (``uint8``, checked
    to lie in 0..255), every other array float32."""
    if array.dtype.kind in "iu" and input_kind == "image":
        if array.min() < 0 or array.max() > 255:
            raise BadInput(
                f"inputs: integer pixel values are 8-bit levels and must lie in 0..255, got "
                f"{array.min()}..{array.max()} (send floats in [0, 1] otherwise)"
            )
        return array.astype(np.uint8)
    return array if array.dtype == np.uint8 and input_kind == "image" else array.astype(np.float32)


def _validation_message(errors: Any) -> str:
    parts = []
    for e in list(errors)[:5]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)
