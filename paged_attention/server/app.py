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
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from paged_attention.engine import RequestOutput
from paged_attention.server import protocol
from paged_attention.server.engine_owner import (
    EngineClosedError,
    EngineOwner,
    EngineStepError,
    RequestStream,
)
from paged_attention.server.metrics import ServerMetrics
from paged_attention.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ClientDisconnected(Exception):
    pass


def create_app(
    engine,
    tokenizer,
    model_name: str,
    *,
    max_n: int = 8,
    max_model_len: int | None = None,
) -> Starlette:
    """The server's application over ``engine`` (built with ``tokenizer``), serving it as
    ``model_name``. ``max_n``: the most samples one request may ask for (at most the engine's
    ``max_num_seqs``); ``max_model_len``: the context a request may fill (default and upper
    bound: the engine's). Starting the application (its lifespan) starts the engine's owner
    thread; stopping it aborts what is left and stops the thread."""
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
    limits = protocol.Limits(
        max_model_len=context,
        max_n=max_n,
        kv_blocks=engine.block_manager.num_device_blocks,
        block_size=engine.block_size,
    )
    server = _Server(engine, tokenizer, model_name, limits)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.owner.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.owner.stop)

    routes = [
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_route, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={APIError: _api_error, HTTPException: _http_error},
    )
    app.state.server = server
    app.state.owner = server.owner
    return app


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


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


class _Server:
    def __init__(self, engine, tokenizer, model_name: str, limits: protocol.Limits):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits
        self.max_model_len = limits.max_model_len
        self.created = int(time.time())
        self.metrics = ServerMetrics()
        self.owner = EngineOwner(engine, on_step=self.metrics.on_step)

    # ------------------------------------------------------------------ routes

    async def chat_completions(self, request: Request) -> Response:
        body = protocol.parse(ChatCompletionRequest, await request.body())
        self._check_model(body.model)
        prompt = self._encode_chat(body)
        params = protocol.sampling_params(body, len(prompt), self.limits, None)
        return await self._generate(request, body, True, prompt, params)

    async def completions(self, request: Request) -> Response:
        body = protocol.parse(CompletionRequest, await request.body())
        self._check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt = self.tokenizer(prompt)["input_ids"]
        params = protocol.sampling_params(
            body, len(prompt), self.limits, COMPLETIONS_DEFAULT_MAX_TOKENS
        )
        return await self._generate(request, body, False, prompt, params)

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

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        messages = [m.template_message() for m in body.messages]
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(
                f"the model {self.model_name!r} has no chat template; use /v1/completions",
                param="messages",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as error:  # the template's own checks (jinja raise_exception)
            raise APIError(
                f"the chat template refused the messages: {error}", param="messages"
            ) from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def _generate(self, request: Request, body, chat: bool, prompt, params) -> Response:
        try:
            stream = self.owner.submit(prompt, params)
        except EngineClosedError as error:
            raise APIError(str(error), status=503, code="shutting_down") from None
        client = _ClientWatch(request)
        handed_off = False  # to the event stream, which then ends the request itself
        try:
            output = await self._first_output(client, stream, body)
            request_id = protocol.completion_id(chat)
            if body.stream:
                options = body.stream_options
                include_usage = options is not None and options.include_usage
                events = self._events(client, stream, output, chat, request_id, include_usage)
                handed_off = True
                return StreamingResponse(events, media_type="text/event-stream")
            while not output.finished:
                output = await client.next(stream)
            return JSONResponse(protocol.response(chat, request_id, self.model_name, output))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it
        except EngineStepError as error:
            raise APIError(str(error), status=500, code="engine_error") from None
        finally:
            if not handed_off:
                self.owner.abort(stream)  # a no-op when the request already ended
                client.close()

    async def _first_output(
        self, client: _ClientWatch, stream: RequestStream, body
    ) -> RequestOutput:
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
        client: _ClientWatch,
        stream: RequestStream,
        output: RequestOutput,
        chat: bool,
        request_id: str,
        include_usage: bool,
    ):
        """The server-sent events of a streamed answer, from its first output on. A client
        that goes away (the response is cancelled, or the watch sees it leave) aborts the
        request."""
        created = int(time.time())
        n = stream.params.n
        extra = {"usage": None} if include_usage else {}

        def event(choices: list[dict], **fields) -> str:
            data = protocol.chunk(chat, request_id, created, self.model_name, choices)
            return f"data: {json.dumps({**data, **extra, **fields})}\n\n"

        finished = False
        reported = [False] * n
        try:
            if chat:
                for index in range(n):
                    yield event([protocol.chunk_choice(True, index, None, None)])
            while True:
                for index in range(n):
                    delta = output.new_texts[index] if index < len(output.new_texts) else ""
                    reason = None
                    if index < len(output.finish_reasons) and not reported[index]:
                        reason = output.finish_reasons[index]
                    if delta or reason is not None:
                        reported[index] = reason is not None
                        yield event([protocol.chunk_choice(chat, index, delta, reason)])
                if output.finished:
                    break
                try:
                    output = await client.next(stream)
                except EngineStepError as error:
                    finished = True
                    failure = APIError(str(error), status=500, code="engine_error")
                    yield f"data: {json.dumps(failure.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
            finished = True
            if include_usage:
                yield event([], usage=protocol.usage(output))
            yield "data: [DONE]\n\n"
        except ClientDisconnected:
            return
        finally:
            if not finished:
                self.owner.abort(stream)
            client.close()


class _ClientWatch:
    """Waits for a stream's next item while watching the connection: raises
    ClientDisconnected as soon as the client goes away, whatever the engine is doing."""

    def __init__(self, request: Request) -> None:
        self._gone = asyncio.ensure_future(self._wait_disconnect(request))

    @staticmethod
    async def _wait_disconnect(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def next(self, stream: RequestStream):
        """The stream's next item; an exception in its place is raised."""
        if self._gone.done():
            raise ClientDisconnected
        if stream.outputs.empty():
            get = asyncio.ensure_future(stream.outputs.get())
            await asyncio.wait({get, self._gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                raise ClientDisconnected
            item = get.result()
        else:
            item = stream.outputs.get_nowait()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._gone.cancel()


def _engine_refusal(error: ValueError, request) -> APIError:
    """The engine's refusal of a request (``RequestError``) as a 400 naming the request's
    field: the engine names its own argument (its ``max_new_tokens`` is the request's
    ``max_tokens`` or ``max_completion_tokens``, its ``prompt`` the ``messages`` or ``prompt``)."""
    prompt_param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    argument = getattr(error, "argument", "prompt")
    param = {"max_new_tokens": request.max_tokens_param, "prompt": prompt_param}.get(
        argument, argument
    )
    code = {"context": "context_length_exceeded", "kv_cache": "kv_cache_exceeded"}.get(
        getattr(error, "limit", None)
    )
    message = str(error)
    if code == "kv_cache_exceeded" and param != prompt_param:
        message += f": ask for fewer {param}"
    return APIError(message, param=param, code=code)
