"""The FastAPI app: SGLang-native endpoints, OpenAI-compatible endpoints, health and metrics.

Errors are JSON in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a
4xx status for requests the server will not run (bad types, bad values, empty or too-long
prompts); the server keeps serving. A client that disconnects has its request aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from sglang import __version__
from sglang.srt.entrypoints.openai_serving import OpenAIServing, sse
from sglang.srt.entrypoints.protocol import (
    AbortReqInput,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateReqInput,
)
from sglang.srt.managers.tokenizer_manager import (
    GenerateRequest,
    RequestError,
    TokenizerManager,
    load_server_tokenizer,
)
from sglang.srt.sampling.sampling_params import SamplingParams, SamplingParamsError
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

T = TypeVar("T")
B = TypeVar("B", bound=BaseModel)
OpenAIBody = TypeVar("OpenAIBody", CompletionRequest, ChatCompletionRequest)
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}  # fmt: skip


def error_response(message: str, status_code: int = 400, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status_code,
        content={
            "object": "error",
            "error": {
                "message": message,
                "type": _ERROR_TYPES.get(status_code, "Error"),
                "param": param,
                "code": status_code,
            },
        },
    )


class ClientDisconnected(Exception):
    pass


async def _until_done_or_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it (which aborts its generation) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()


def _validation_response(errors: list[Any]) -> JSONResponse:
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    first = errors[0].get("loc", ()) if errors else ()
    param = ".".join(str(x) for x in first if x != "body") or None
    return error_response("invalid request: " + "; ".join(parts), 400, param)


async def parse_body(request: Request, model: type[B]) -> B:
    """The JSON body as ``model``, whatever the Content-Type header says (curl -d sends form
    encoding by default). Raises RequestError / ValidationError, both answered with a 400."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    return model.model_validate(data)


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _openai_response(
    request: Request,
    model: type[OpenAIBody],
    stream: Callable[[OpenAIBody], Awaitable[AsyncIterator[str]]],
    unary: Callable[[OpenAIBody], Awaitable[dict[str, Any]]],
) -> Response:
    """An OpenAI endpoint: server-sent events when the body asks to stream, else one JSON answer
    whose generation is aborted if the client goes away first."""
    body = await parse_body(request, model)
    if body.stream:
        return _sse_response(await stream(body))
    return JSONResponse(await _until_done_or_disconnect(request, unary(body)))


def _generate_requests(body: GenerateReqInput) -> list[GenerateRequest]:
    """Split a (possibly batched) /generate body into one request per prompt."""
    if body.text is not None and body.input_ids is not None:
        raise RequestError("give either text or input_ids, not both")
    prompts: list[tuple[str | None, list[int] | None]]
    if isinstance(body.text, list):
        prompts = [(t, None) for t in body.text]
    elif body.text is not None:
        prompts = [(body.text, None)]
    elif body.input_ids and isinstance(body.input_ids[0], list):
        prompts = [(None, list(ids)) for ids in body.input_ids]  # type: ignore[arg-type]
    elif body.input_ids is not None:
        prompts = [(None, list(body.input_ids))]  # type: ignore[arg-type]
    else:
        raise RequestError("the request has no prompt: give text or input_ids")
    if not prompts:
        raise RequestError("the prompt list is empty")
    raw = body.sampling_params
    if isinstance(raw, list):
        if len(raw) != len(prompts):
            raise RequestError(f"{len(raw)} sampling_params for {len(prompts)} prompts")
        raws = raw
    else:
        raws = [raw] * len(prompts)
    try:
        params = [SamplingParams.from_dict(r) for r in raws]
    except SamplingParamsError as exc:
        raise RequestError(str(exc)) from None
    if len(prompts) > 1 and body.rid is not None:
        raise RequestError("rid names one request; leave it out for a batch")
    return [
        GenerateRequest(
            text=text,
            input_ids=ids,
            sampling_params=p,
            return_logprob=body.return_logprob,
            top_logprobs_num=body.top_logprobs_num,
            logprob_start_len=body.logprob_start_len,
            stream=body.stream,
            rid=body.rid,
        )
        for (text, ids), p in zip(prompts, params)
    ]


def create_app(tm: TokenizerManager) -> FastAPI:
    openai = OpenAIServing(tm)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tm.start(asyncio.get_running_loop())  # requests run on the server's event loop
        yield

    app = FastAPI(title="sglang", version=__version__, lifespan=lifespan)
    app.state.tokenizer_manager = tm

    # --- errors ------------------------------------------------------------------------------

    # FastAPI's request-model errors and pydantic's own (parse_body validates by hand) read alike.
    @app.exception_handler(RequestValidationError)
    @app.exception_handler(ValidationError)
    async def _validation_error(
        _: Request, exc: RequestValidationError | ValidationError
    ) -> JSONResponse:
        return _validation_response(list(exc.errors()))

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.message, exc.status_code)

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    # --- health and info ---------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if not tm.scheduler_alive:
            return error_response("the scheduler process exited", 503)
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        ids = [tm.tokenizer.bos_token_id] if tm.tokenizer and tm.tokenizer.bos_token_id else [0]
        req = GenerateRequest(
            input_ids=ids, sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0)
        )
        try:
            await asyncio.wait_for(tm.generate_one(req), timeout=60)
        except (RequestError, asyncio.TimeoutError) as exc:
            return error_response(f"generation failed: {exc}", 503)
        return JSONResponse({"status": "ok"})

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        info = tm.info
        return {
            "model_path": info.model_path,
            "tokenizer_path": tm.args.tokenizer_path or info.model_path,
            "served_model_name": tm.served_model_name,
            "is_generation": True,
            "architecture": info.architecture,
            "context_length": info.context_length,
            "vocab_size": info.vocab_size,
        }

    async def server_info() -> dict[str, Any]:
        stats = await tm.get_stats()
        return {
            "version": __version__,
            "server_args": tm.args.to_dict(),
            "model_info": dataclasses.asdict(tm.info),
            "scheduler": dataclasses.asdict(stats),
            "num_requests_in_flight": len(tm.states),
        }

    app.get("/server_info")(server_info)
    app.get("/get_server_info")(server_info)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": tm.served_model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "sglang",
                    "root": tm.info.model_path,
                    "max_model_len": tm.info.context_length,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        if tm.metrics is None:
            return error_response("metrics are off; start the server with --enable-metrics", 404)
        try:
            await tm.get_stats()
        except (RequestError, asyncio.TimeoutError):
            pass  # serve the counters anyway; the gauges keep their last values
        return Response(tm.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, str]:
        # There is no shared prefix cache: per-request caches are freed when requests end.
        return {"status": "ok", "message": "nothing to flush (no prefix cache)"}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body = await parse_body(request, AbortReqInput)
        return {"aborted": tm.abort(body.rid)}

    # --- native generation -------------------------------------------------------------------

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await parse_body(request, GenerateReqInput)
        reqs = _generate_requests(body)
        if body.stream:
            if len(reqs) != 1:
                raise RequestError("streaming takes one prompt; send a batch without stream")
            prepared = tm.prepare(reqs[0])

            async def events() -> AsyncIterator[str]:
                try:
                    async for result in tm.generate(prepared):
                        yield sse(result)
                except RequestError as exc:
                    yield sse({"error": {"message": exc.message, "code": exc.status_code}})
                yield sse("[DONE]")

            return _sse_response(events())
        prepared_all = [tm.prepare(r) for r in reqs]
        results = await _until_done_or_disconnect(
            request, asyncio.gather(*(tm.generate_one(p) for p in prepared_all))
        )
        is_batch = isinstance(body.text, list) or (
            bool(body.input_ids) and isinstance(body.input_ids[0], list)  # type: ignore[index]
        )
        return JSONResponse(list(results) if is_batch else results[0])

    # --- OpenAI ------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _openai_response(
            request, CompletionRequest, openai.completions_stream, openai.completions
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _openai_response(
            request, ChatCompletionRequest, openai.chat_stream, openai.chat
        )

    return app


def _check_port_free(host: str, port: int) -> None:
    """Fail before loading anything if the port is taken (uvicorn would only say so after the
    model is up)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ServerArgsError(
                f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port or stop "
                "the process that holds it"
            ) from None


def launch_server(args: ServerArgs) -> None:
    """Start the schedulers, then serve HTTP until interrupted; stop the schedulers on the way
    out. ``args`` as parsed; resolved and validated here (a bad combination raises
    :class:`ServerArgsError` before anything starts)."""
    import uvicorn

    from sglang.srt.managers.launcher import launch_schedulers, resolve_model_path

    args = args.resolved()
    args.validate()
    _check_port_free(args.host, args.port)
    args = resolve_model_path(args)
    tokenizer = load_server_tokenizer(args)
    handle = launch_schedulers(args)
    tm = TokenizerManager(args, handle, tokenizer)
    try:
        app = create_app(tm)
        logger.info(f"serving {tm.served_model_name} on http://{args.host}:{args.port}")
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level="warning" if args.log_level == "info" else args.log_level,
            timeout_keep_alive=30,
            # Ctrl-C must not wait for a long stream to end; its request is aborted instead.
            timeout_graceful_shutdown=5,
        )
    finally:
        tm.close()
        handle.shutdown()
