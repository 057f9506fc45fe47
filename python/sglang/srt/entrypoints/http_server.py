"""The FastAPI app: SGLang-native endpoints, OpenAI-compatible endpoints, health and metrics.

Errors are JSON in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a
4xx status for requests the server will not run (bad types, bad values, empty or too-long
prompts, unknown model, unsupported parameters, unknown paths and methods); the server keeps
serving. An exception while serving one request fails that request alone (a JSON 500 naming it).
A client that disconnects has its request aborted. Shutdown and a dying scheduler rank are
handled by :mod:`serving_server`; the API key, body-size limit and last-resort error handling
by :mod:`middleware`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglang.srt.entrypoints.errors import error_response
from sglang.srt.entrypoints.json_body import JSONBodyError, parse_json
from sglang.srt.entrypoints.middleware import GuardMiddleware
from sglang.srt.entrypoints.openai_common import error_event, sse
from sglang.srt.entrypoints.openai_serving import OpenAIServing
from sglang.srt.entrypoints.protocol import (
    AbortReqInput,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateReqInput,
    _Body,
)
from sglang.srt.entrypoints.startup import start_engine
from sglang.srt.managers.generate_request import GenerateRequest
from sglang.srt.managers.prompts import build_requests
from sglang.srt.managers.tokenizer_manager import RequestError, TokenizerManager
from sglang.srt.parsers.reasoning import ReasoningFormat, ReasoningParser
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.sampling.thinking_budget import ReasoningControl
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.srt.utils.log import get_logger
from sglang.version import __version__

logger = get_logger(__name__)

T = TypeVar("T")
B = TypeVar("B", bound=_Body)
OpenAIBody = TypeVar("OpenAIBody", CompletionRequest, ChatCompletionRequest)
# Bodies up to this size are parsed on the event loop; larger ones in a worker thread.
_INLINE_PARSE_BYTES = 256 * 1024

__all__ = ["create_app", "error_response", "launch_server"]


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


async def parse_body(request: Request, model: type[B], tm: TokenizerManager) -> B:
    """The JSON body as ``model``, whatever the Content-Type header says (curl -d sends form
    encoding by default): depth-limited, valid Unicode, only parameters the server implements.
    Raises RequestError / ValidationError, both answered with a 400."""
    raw = await request.body()
    depth = tm.args.max_json_depth
    try:
        if not raw:
            data = None
        elif len(raw) <= _INLINE_PARSE_BYTES:
            data = parse_json(raw, depth)
        else:
            data = await tm.run_blocking(parse_json, raw, depth)
    except JSONBodyError as exc:
        raise RequestError(str(exc)) from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    body = model.model_validate(data)
    problems = body.unsupported()
    if problems:
        raise RequestError(
            "unsupported parameter(s): " + "; ".join(problems) + ". Remove them, or see the docs "
            "for what this server implements"
        )
    return body


def _check_model(tm: TokenizerManager, name: str | None) -> None:
    """OpenAI's ``model`` must name what this server serves (the served name or the path)."""
    if name is None or name in _served_names(tm):
        return
    raise RequestError(
        f"the model {name!r} does not exist here; this server serves {tm.served_model_name!r} "
        "(see /v1/models)",
        404,
        param="model",
    )


def _served_names(tm: TokenizerManager) -> set[str]:
    names = {tm.served_model_name, tm.info.model_path}
    if tm.args.model_path:
        names.add(tm.args.model_path)
    return {n for n in names if n}


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
    tm: TokenizerManager = request.app.state.tokenizer_manager
    body = await parse_body(request, model, tm)
    _check_model(tm, body.model)
    if body.stream:
        return _sse_response(await stream(body))
    return JSONResponse(await _until_done_or_disconnect(request, unary(body)))


def _generate_requests(
    body: GenerateReqInput, tm: TokenizerManager
) -> tuple[list[GenerateRequest], bool]:
    """Split a (possibly batched) /generate body into one request per prompt and choice; also
    whether the body was a batch (the answer is then a list). With ``separate_reasoning`` the
    output is read as starting inside the reasoning (its end ends a thinking budget and starts
    a grammar)."""
    template = GenerateRequest(
        return_logprob=body.return_logprob,
        top_logprobs_num=body.top_logprobs_num,
        logprob_start_len=body.logprob_start_len,
        stream=body.stream,
        rid=body.rid,
    )
    built = build_requests(
        body.text,  # type: ignore[arg-type]
        body.input_ids,  # type: ignore[arg-type]
        body.sampling_params,
        template,
    )
    reqs = built.requests
    fmt = None if tm.chat_format is None else tm.chat_format.reasoning
    thinking = body.separate_reasoning or any(r.sampling_params.thinking_budget for r in reqs)
    if thinking:
        if fmt is None:
            raise RequestError(
                "separate_reasoning and thinking_budget need a reasoning parser "
                "(--reasoning-parser)"
            )
        end = tm.reasoning_end_ids(fmt.end)
        reqs = [
            dataclasses.replace(
                r,
                reasoning=ReasoningControl(end, r.sampling_params.thinking_budget),
                keep_tokens=fmt.markers,
            )
            for r in reqs
        ]
    return reqs, built.batch


class _ReasoningSplit:
    """/generate's ``separate_reasoning``: ``text`` without the reasoning, which goes to
    ``reasoning_text`` (streamed results grow both)."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.parser = ReasoningParser(fmt, in_reasoning=True)
        self.seen = 0
        self.reasoning = self.content = ""

    def __call__(self, result: dict[str, Any]) -> dict[str, Any]:
        text = result["text"]
        final = result["meta_info"]["finish_reason"] is not None
        reasoning, content = self.parser.feed(text[self.seen :])
        self.seen = len(text)
        if final:
            held, _ = self.parser.finish()
            reasoning += held
        self.reasoning += reasoning
        self.content += content
        return {**result, "text": self.content, "reasoning_text": self.reasoning}


def create_app(tm: TokenizerManager) -> FastAPI:
    openai = OpenAIServing(tm)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tm.start(asyncio.get_running_loop())  # requests run on the server's event loop
        yield

    app = FastAPI(title="sglang", version=__version__, lifespan=lifespan)
    app.state.tokenizer_manager = tm
    app.add_middleware(
        GuardMiddleware, max_body_bytes=tm.args.max_request_bytes, api_key=tm.args.api_key
    )

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
        return error_response(exc.message, exc.status_code, exc.param)

    # Unknown paths (404) and methods (405) in the same shape as every other error.
    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        resp = error_response(message, exc.status_code)
        for key, value in (exc.headers or {}).items():
            resp.headers[key] = value
        return resp

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    # --- health and info ---------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        try:
            tm.check_admitting()
        except RequestError as exc:
            return error_response(exc.message, 503)
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
            return error_response(f"generation failed: {exc!r}", 503)
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
        args = tm.args.to_dict()
        if args.get("api_key"):
            args["api_key"] = "<redacted>"
        return {
            "version": __version__,
            "server_args": args,
            "scheduler_pids": [p.pid for p in tm.handle.procs],
            "model_info": dataclasses.asdict(tm.info),
            "scheduler": dataclasses.asdict(stats),
            "num_requests_in_flight": len(tm.states),
        }

    app.get("/server_info")(server_info)
    app.get("/get_server_info")(server_info)

    def model_card() -> dict[str, Any]:
        return {
            "id": tm.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": tm.info.model_path,
            "max_model_len": tm.info.context_length,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(tm, model_id)
        return model_card()

    @app.get("/metrics")
    async def metrics() -> Response:
        if tm.metrics is None:
            return error_response("metrics are off; start the server with --enable-metrics", 404)
        try:
            await tm.get_stats()
        except (RequestError, asyncio.TimeoutError):
            pass  # serve the counters anyway; the gauges keep their last values
        return Response(tm.metrics.render(), media_type="text/plain; version=0.0.4")

    async def flush_cache() -> Response:
        """Drop every cached prefix: 200 when done, 400 while requests run or wait."""
        result = await tm.flush_cache()
        if not result.ok:
            return error_response(result.message, 400)
        return JSONResponse({"status": "ok", "message": result.message})

    app.post("/flush_cache")(flush_cache)
    app.get("/flush_cache")(flush_cache)  # SGLang serves both

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body = await parse_body(request, AbortReqInput, tm)
        return {"aborted": tm.abort(body.rid)}

    # --- native generation -------------------------------------------------------------------

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await parse_body(request, GenerateReqInput, tm)
        reqs, is_batch = _generate_requests(body, tm)
        fmt = None if tm.chat_format is None else tm.chat_format.reasoning

        def split() -> Callable[[dict[str, Any]], dict[str, Any]]:
            if not body.separate_reasoning or fmt is None:
                return lambda result: result
            return _ReasoningSplit(fmt)

        if body.stream:
            if len(reqs) != 1:
                raise RequestError(
                    "streaming takes one prompt and n = 1; send a batch or n > 1 without stream"
                )
            prepared = await tm.prepare(reqs[0])
            shown = split()

            async def events() -> AsyncIterator[str]:
                try:
                    async for result in tm.generate(prepared):
                        yield sse(shown(result))
                except Exception as exc:
                    if not isinstance(exc, RequestError):
                        logger.exception("a /generate stream failed")
                    yield error_event(exc)
                yield sse("[DONE]")

            return _sse_response(events())
        prepared_all = await asyncio.gather(*(tm.prepare(r) for r in reqs))
        results = await _until_done_or_disconnect(
            request, asyncio.gather(*(tm.generate_one(p) for p in prepared_all))
        )
        results = [split()(r) for r in results]
        return JSONResponse(list(results) if is_batch or len(results) > 1 else results[0])

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


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum} during startup")


def _preflight(args: ServerArgs) -> None:
    _check_port_free(args.host, args.port)
    # Until uvicorn installs its handlers, SIGTERM interrupts the startup like Ctrl-C (the ranks
    # started so far are stopped on the way out) instead of killing this process outright.
    signal.signal(signal.SIGTERM, _raise_interrupt)


def launch_server(args: ServerArgs) -> int:
    """Start the schedulers, then serve HTTP until SIGTERM/SIGINT (a drain, see
    :mod:`serving_server`) or until a scheduler rank dies; stop the schedulers on the way out.
    ``args`` as parsed; resolved and validated here (a bad combination or a bad SGLANG_* value
    raises :class:`ServerArgsError` before anything starts). Returns the exit code: 0 after a
    shutdown by signal, 1 when a rank died."""
    import uvicorn

    from sglang.srt.entrypoints.serving_server import ServingServer

    started = start_engine(args, preflight=_preflight)
    args, tm = started.server_args, started.tokenizer_manager
    server: ServingServer | None = None
    try:
        app = create_app(tm)
        logger.info(f"serving {tm.served_model_name} on http://{args.host}:{args.port}")
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning" if args.log_level == "info" else args.log_level,
            timeout_keep_alive=30,
            # The drain has ended every request by now; this only bounds closing connections.
            timeout_graceful_shutdown=5,
        )
        server = ServingServer(config, tm, grace_s=args.shutdown_timeout)
        server.run()
    finally:
        # After a rank died the others may be stuck in a collective: do not wait long for them.
        dead = server is not None and server.exit_code != 0
        started.shutdown(timeout_s=2.0 if dead else 10.0)
    if server.exit_code != 0:
        logger.error(f"exiting with code {server.exit_code}: {tm.fatal_error}")
    else:
        logger.info("shut down cleanly")
    return server.exit_code
