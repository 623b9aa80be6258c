"""The HTTP application: OpenAI's chat completions and completions (whole or streamed as
server-sent events), the model list, health and Prometheus metrics, over one
:class:`~paged_attention.server.engine_owner.EngineOwner`.

A client that disconnects before its answer is complete has its request aborted at once (its
KV blocks go back to the pool at the owner's next turn); every error is answered in OpenAI's
shape, and none of them disturbs the requests of other clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from paged_attention.engine import RequestOutput
from paged_attention.server import protocol, tokenization
from paged_attention.server.answers import Answer, PromptJob
from paged_attention.server.client_watch import ClientDisconnected, ClientWatch
from paged_attention.server.engine_owner import (
    EngineClosedError,
    EngineOwner,
    EngineStepError,
    ServerStream,
)
from paged_attention.server.logprobs import TokenPieces
from paged_attention.server.metrics import ServerMetrics
from paged_attention.server.prompts import PromptBuilder
from paged_attention.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from paged_attention.server.security import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from paged_attention.server.tool_calls import DEFAULT_PARSER, HERMES, call_format

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_MAX_WAITING_REQUESTS = 256
ENGINE_FAILURE = "the engine failed while serving this request (it was aborted; the server goes on)"

logger = logging.getLogger("paged_attention.server")


def create_app(
    engine,
    tokenizer,
    model_name: str,
    *,
    max_n: int = 8,
    max_model_len: int | None = None,
    api_key: str | None = None,
    allowed_origins: list[str] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
    tool_call_parser: str = DEFAULT_PARSER,
) -> Starlette:
    """The server's application over ``engine`` (built with ``tokenizer``), serving it as
    ``model_name``. ``max_n``: the most samples one request may ask for (at most the engine's
    ``max_num_seqs``); ``max_model_len``: the context a request may fill (default and upper
    bound: the engine's). ``api_key``: the Bearer key every route but ``/health`` requires
    (None: open); ``allowed_origins``: the web origins whose pages may call it (CORS; None:
    none); ``max_request_bytes``: the largest request body; ``max_waiting_requests``: how many
    requests may wait to start before the next ones get 429; ``tool_call_parser``: the format
    tool calls are read in (:data:`~paged_attention.server.tool_calls.PARSER_NAMES`; ``auto``:
    the chat template's). Starting the application (its
    lifespan) starts the engine's owner thread; stopping it aborts what is left and stops the
    thread."""
    if max_waiting_requests < 1:
        raise ValueError(f"max_waiting_requests must be at least 1, got {max_waiting_requests}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be at least 1, got {max_request_bytes}")
    if api_key is not None and not api_key:
        raise ValueError("api_key must not be empty (None: no key)")
    tool_format = call_format(tool_call_parser, getattr(tokenizer, "chat_template", None))
    limits = _limits(engine, max_n, max_model_len)
    server = _Server(engine, tokenizer, model_name, limits, WaitingRoom(max_waiting_requests))
    server.tool_call_format = tool_format

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.owner.start()
        server.prompts.warm_up()
        # anyio imports its asyncio backend at its first use, which is the first streamed
        # response's task group: tens of milliseconds of that request's first token
        await anyio.sleep(0)
        try:
            yield
        except asyncio.CancelledError:
            # a second Ctrl+C: uvicorn quits without the lifespan's shutdown and cancels it;
            # the engine stops all the same, below, and the quit prints no traceback
            pass
        finally:
            server.prompts.close()
            await asyncio.to_thread(server.owner.stop)

    routes = server.routes()
    json_paths = frozenset(r.path for r in routes if "POST" in r.methods)
    app = Starlette(
        routes=routes,
        middleware=_middleware(api_key, allowed_origins, max_request_bytes, json_paths),
        lifespan=lifespan,
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _unexpected_error,
        },
    )
    app.state.server = server
    app.state.owner = server.owner
    return app


def _limits(engine, max_n: int, max_model_len: int | None) -> protocol.Limits:
    """What one request may ask of ``engine``, checked."""
    if not 1 <= max_n <= engine.max_num_seqs:
        raise ValueError(
            f"max_n must be between 1 and the engine's max_num_seqs ({engine.max_num_seqs}), "
            f"got {max_n}"
        )
    # a model that sets no context is bounded by the KV pool
    context = engine.max_model_len or engine.block_manager.num_device_blocks * engine.block_size
    if max_model_len is not None:
        if not 2 <= max_model_len <= context:
            raise ValueError(
                f"max_model_len must be between 2 and the engine's max_model_len ({context}), "
                f"got {max_model_len}"
            )
        context = max_model_len
    return protocol.Limits(
        max_model_len=context,
        max_n=max_n,
        kv_blocks=engine.block_manager.num_device_blocks,
        block_size=engine.block_size,
    )


def _middleware(api_key, allowed_origins, max_request_bytes: int, json_paths) -> list[Middleware]:
    """CORS outside (a browser's preflight is answered before any key is asked for), then the
    request guard."""
    middleware = []
    if allowed_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(allowed_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type"],
            )
        )
    guard = dict(api_key=api_key, max_request_bytes=max_request_bytes, json_paths=json_paths)
    middleware.append(Middleware(RequestGuard, **guard))
    return middleware


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    """A bug: logged with its traceback, answered without it."""
    logger.error("an unexpected error answering %s", request.url.path, exc_info=error)
    failure = APIError(
        "the server failed to answer this request", status=500, code="internal_error"
    )
    return JSONResponse(failure.body(), status_code=500)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    if error.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif error.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(error.detail)
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
    return JSONResponse(
        APIError(message, status=error.status_code, code=code).body(),
        status_code=error.status_code,
        headers=error.headers,
    )


class WaitingRoom:
    """Counts the requests that wait to start (read, tokenized, queued in the engine, until
    their first token); beyond ``limit`` of them a request is refused with 429 and
    ``Retry-After``. Used on the event loop only."""

    RETRY_AFTER_SECONDS = 1

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.waiting = 0

    def enter(self) -> _Seat:
        if self.waiting >= self.limit:
            raise APIError(
                f"the server is overloaded: {self.waiting} requests wait to start; retry later",
                status=429,
                code="rate_limit_exceeded",
                type="requests",
                headers={"retry-after": str(self.RETRY_AFTER_SECONDS)},
            )
        self.waiting += 1
        return _Seat(self)


class _Seat:
    """A request's place in the waiting room, left once (when it starts or ends)."""

    def __init__(self, room: WaitingRoom) -> None:
        self._room: WaitingRoom | None = room

    def leave(self) -> None:
        if self._room is not None:
            self._room.waiting -= 1
            self._room = None


class _Server:
    def __init__(
        self,
        engine,
        tokenizer,
        model_name: str,
        limits: protocol.Limits,
        waiting: WaitingRoom,
    ) -> None:
        self.model_name = model_name
        self.limits = limits
        self.max_model_len = limits.max_model_len
        self.waiting = waiting
        self.created = int(time.time())
        self.metrics = ServerMetrics()
        self.prompts = PromptBuilder(tokenizer, model_name)
        self.pieces = TokenPieces(tokenizer)
        self.owner = EngineOwner(engine, on_step=self.metrics.on_step)
        self.tool_call_format = HERMES

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
        ]

    # ------------------------------------------------------------------ routes

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, self._prepare_chat, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, self._prepare_completion, chat=False)

    async def tokenize(self, request: Request) -> Response:
        limit = self.max_model_len
        return await self._tokenizer_work(request, tokenization.tokenize, self._check_model, limit)

    async def detokenize(self, request: Request) -> Response:
        return await self._tokenizer_work(request, tokenization.detokenize, self._check_model)

    async def _tokenizer_work(self, request: Request, function, *args) -> Response:
        """``function(renderer, body, *args)`` in the tokenizer's thread, answered as JSON; it
        waits in the waiting room like a generation (the thread is shared)."""
        seat = self.waiting.enter()
        try:
            raw = await request.body()
            renderer = self.prompts.renderer
            return JSONResponse(await self.prompts.run(function, renderer, raw, *args))
        finally:
            seat.leave()

    async def models(self, request: Request) -> Response:
        card = protocol.model_card(self.model_name, self.created, self.max_model_len)
        return JSONResponse({"object": "list", "data": [card]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model_name:
            raise APIError(
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )
        return JSONResponse(protocol.model_card(self.model_name, self.created, self.max_model_len))

    async def health(self, request: Request) -> Response:
        if not self.owner.alive:
            raise APIError("the engine is not running", status=503, code="engine_stopped")
        return JSONResponse({"status": "ok"})

    async def metrics_route(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ generation

    async def _serve(self, request: Request, prepare, chat: bool) -> Response:
        """A generation request: a seat in the waiting room first (or 429), then its body
        parsed and tokenized by ``prepare`` in the tokenizer's thread, then the engine."""
        seat = self.waiting.enter()
        try:
            body, jobs = await self.prompts.run(prepare, await request.body())
            answer = Answer(body, self.pieces, jobs, self.tool_call_format)
            return await self._generate(request, body, answer, seat)
        finally:
            seat.leave()

    def _prepare_chat(self, raw: bytes):
        """Tokenizer thread: the request and its prompt (ids, text, the engine's parameters)."""
        body = protocol.parse(ChatCompletionRequest, raw)
        self._check_model(body.model)
        ids = self.prompts.renderer.chat_ids(body.chat_prompt(), argument="messages")
        params = protocol.sampling_params(body, len(ids), self.limits, None, self.tool_call_format)
        return body, [PromptJob(ids, "", params)]

    def _prepare_completion(self, raw: bytes):
        """Tokenizer thread: the request and its prompts (a text's ids; token ids' text, which
        ``echo`` shows)."""
        body = protocol.parse(CompletionRequest, raw)
        self._check_model(body.model)
        jobs = []
        for prompt in body.prompts:
            if isinstance(prompt, str):
                ids, text = self.prompts.renderer.text_ids(prompt, argument="prompt"), prompt
            else:
                ids = prompt
                text = self.prompts.renderer.text(ids, argument="prompt") if body.echo else ""
            default = COMPLETIONS_DEFAULT_MAX_TOKENS
            params = protocol.sampling_params(body, len(ids), self.limits, default)
            jobs.append(PromptJob(ids, text, params))
        return body, jobs

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def _generate(self, request: Request, body, answer: Answer, seat: _Seat) -> Response:
        """The engine's answer to ``answer``'s prompts (submitted together), whole or streamed;
        every one of them is aborted when the client leaves or one of them is refused."""
        streams = []
        try:
            for job in answer.prompts:
                streams.append(self.owner.submit(job.ids, job.params))
        except EngineClosedError as error:
            for stream in streams:
                self.owner.abort(stream)
            raise APIError(str(error), status=503, code="shutting_down") from None
        client = ClientWatch(request)
        handed_off = False  # to the event stream, which then ends the requests itself
        try:
            firsts = [await self._first_output(client, stream, body) for stream in streams]
            seat.leave()  # it started
            request_id = protocol.completion_id(answer.chat)
            if body.stream:
                options = body.stream_options
                include_usage = options is not None and options.include_usage
                events = self._events(client, streams, firsts, answer, request_id, include_usage)
                handed_off = True
                return StreamingResponse(events, media_type="text/event-stream")
            finals = []
            for stream, output in zip(streams, firsts):
                while not output.finished:
                    output = await client.next(stream)
                finals.append(output)
            return JSONResponse(answer.response(request_id, self.model_name, finals))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it
        except EngineStepError:
            raise APIError(ENGINE_FAILURE, status=500, code="engine_error") from None
        finally:
            if not handed_off:
                for stream in streams:
                    self.owner.abort(stream)  # a no-op when the request already ended
                client.close()

    async def _first_output(self, client: ClientWatch, stream: ServerStream, body) -> RequestOutput:
        """The request's first output, once the engine took it and it got tokens; the APIError
        a client gets when the engine refused it (when queued, or when scheduled)."""
        try:
            await client.next(stream)  # None: the engine queued it
        except EngineClosedError as error:
            raise APIError(str(error), status=503, code="shutting_down") from None
        except ValueError as error:
            raise _engine_refusal(error, body) from None
        output = await client.next(stream)
        if output.rejected is not None:
            raise APIError(
                f"the engine could not serve the request: {output.rejected}",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                code="request_rejected",
            )
        return output

    async def _events(
        self,
        client: ClientWatch,
        streams: list[ServerStream],
        firsts: list[RequestOutput],
        answer: Answer,
        request_id: str,
        include_usage: bool,
    ):
        """The server-sent events of a streamed answer, from its prompts' first outputs on
        (the prompts run together; each output's chunks are sent as it comes). A client that
        goes away (the response is cancelled, or the watch sees it leave) aborts the
        requests."""
        created = int(time.time())
        chat = answer.chat
        extra = {"usage": None} if include_usage else {}

        def event(choices: list[dict], **fields) -> str:
            data = protocol.chunk(chat, request_id, created, self.model_name, choices)
            return f"data: {json.dumps({**data, **extra, **fields})}\n\n"

        finished = False
        try:
            if chat:
                for index in range(answer.n):
                    yield event([protocol.chunk_choice(True, index, None, None)])
            running: dict[int, ServerStream] = {}
            finals: dict[int, RequestOutput] = {}
            for p, (stream, output) in enumerate(zip(streams, firsts)):
                for choice in answer.deltas(p, output):
                    yield event([choice])
                if output.finished:
                    finals[p] = output
                else:
                    running[p] = stream
            while running:
                try:
                    p, output = await client.next_of(running)
                except EngineStepError:  # the batch's other prompts are aborted below
                    failure = APIError(ENGINE_FAILURE, status=500, code="engine_error")
                    yield f"data: {json.dumps(failure.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                for choice in answer.deltas(p, output):
                    yield event([choice])
                if output.finished:
                    finals[p] = output
                    del running[p]
            finished = True
            if include_usage:
                yield event([], usage=answer.usage(list(finals.values())))
            yield "data: [DONE]\n\n"
        except ClientDisconnected:
            return
        finally:
            if not finished:
                for stream in streams:
                    self.owner.abort(stream)
            client.close()


def _engine_refusal(error: ValueError, request) -> APIError:
    """The engine's refusal of a request (``RequestError``) as a 400 naming the request's
    field: the engine names its own argument (its ``max_new_tokens`` is the request's
    ``max_tokens`` or ``max_completion_tokens``, its ``prompt`` the ``messages`` or ``prompt``)."""
    prompt_param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    argument = getattr(error, "argument", "prompt")
    renamed = {
        "max_new_tokens": request.max_tokens_param,
        "prompt": prompt_param,
        "structured_output": request.structured_param,  # a grammar that did not compile
    }
    param = renamed.get(argument, argument)
    code = {"context": "context_length_exceeded", "kv_cache": "kv_cache_exceeded"}.get(
        getattr(error, "limit", None)
    )
    message = str(error)
    if code == "kv_cache_exceeded" and param != prompt_param:
        message += f": ask for fewer {param}"
    return APIError(message, param=param, code=code)
