"""The OpenAI-compatible endpoint as an ASGI application (:func:`build_app`).

Starlette, served by uvicorn: both are small, widely used and maintained by one group
(encode), and Starlette is the core FastAPI is built on. FastAPI's extras (dependency
injection, generated schemas) would add nothing here: requests are validated by the pydantic
models of :mod:`~engine_core_roles.serving.protocol` and every refusal is an OpenAI error
object written by hand, with the status OpenAI's API gives it.

Routes, each also under ``/sessions/{session_id}`` (a base URL per session; a request may
instead name its session in the ``X-Session-Id`` header):

- ``GET /v1/models``; ``POST /v1/chat/completions``; ``POST /v1/completions``
- ``POST /v1/sessions`` (a new id and the key of that session alone), ``GET
  /v1/sessions/{id}`` (the record so far), ``POST /v1/sessions/{id}/reward`` (``{"reward":
  0.5}``: the session's reward, once; also ``/sessions/{id}/v1/reward``, under the session's
  base URL), ``POST /v1/sessions/{id}/end`` (the record; the id is never taken again)
- ``GET /health`` (no key needed)

With an API key set, a request carries it, or the key of the session it names (issued with
the session): a session's key opens that session's routes and no other.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from engine_core.errors import BatchError, CapabilityError, ConfigError
from engine_core.rollout import SamplingParams
from engine_core_roles.serving.chat import (
    assistant_message,
    check_tools,
    render_messages,
    reply_text,
)
from engine_core_roles.serving.config import ServeConfig
from engine_core_roles.serving.limits import (
    SESSION_HEADER,
    check_key,
    check_prompt,
    read_body,
    sampling_params,
    session_of,
)
from engine_core_roles.serving.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    error_body,
    parse_json_object,
    parse_request,
)
from engine_core_roles.serving.responses import (
    Reply,
    chat_body,
    chat_chunks,
    completion_body,
    completion_chunks,
    sse,
)
from engine_core_roles.serving.sampler import Sampled, ServedRollout
from engine_core_roles.serving.sessions import Sessions, check_session_id

__all__ = ["Endpoint", "build_app", "JSONAnswer", "StreamAnswer"]

_log = logging.getLogger(__name__)
# a Starlette request: only build_app imports Starlette (the serve extra), so that the rest of
# the roles, the command line included, imports without it
Request = Any


@dataclass(frozen=True)
class JSONAnswer:
    """A JSON body and its status."""

    body: Any
    status: int = 200


@dataclass(frozen=True)
class StreamAnswer:
    """Server-sent events."""

    events: Iterator[str]


Answer = JSONAnswer | StreamAnswer
Handler = Callable[[Request], Awaitable[Answer]]


class Endpoint:
    """The endpoint's state: its config, the rollout it serves, and the sessions."""

    def __init__(self, config: ServeConfig, served: ServedRollout) -> None:
        self.config, self.served = config, served
        self.sessions = Sessions(config.max_sessions, config.max_session_calls)
        key = config.api_key
        self._key = None if key is None else key.get_secret_value().encode()

    # -- what every request goes through -------------------------------------------------------
    def guarded(self, handler: Handler, *, key: bool = True) -> Handler:
        """``handler`` behind the API key, answering each refusal as an OpenAI error object."""

        async def run(request: Request) -> Answer:
            try:
                if key:
                    check_key(
                        request.headers.get("authorization", ""),
                        self._key,
                        lambda given: self._session_key(request, given),
                    )
                return await handler(request)
            except ApiError as e:
                return JSONAnswer(e.body(), e.status)
            except Exception:  # the server stays up; the client gets no internals
                _log.exception("request %s %s failed", request.method, request.url.path)
                return JSONAnswer(
                    error_body("the server failed on this request; see its log.", "server_error"),
                    500,
                )

        return run

    def _session_key(self, request: Request, given: bytes) -> bool:
        """Whether ``given`` is the key of the session ``request`` names (none, or a malformed
        name: no, so a caller without a key learns nothing about the name it sent)."""
        try:
            sid = self._session(request)
        except ApiError:
            return False
        return sid is not None and self.sessions.key_matches(sid, given)

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.config.max_body_bytes)

    def _session(self, request: Request) -> str | None:
        return session_of(
            request.path_params.get("session_id"), request.headers.get(SESSION_HEADER)
        )

    def _params(
        self, req: SamplingFields, limit: int | None, stop: list[str], session: str | None
    ) -> SamplingParams:
        pinned = None if session is None else self.sessions.temperature(session)
        return sampling_params(
            req,
            self.config,
            max_tokens=limit,
            stop=stop,
            stop_token_ids=self.served.stop_token_ids,
            pinned=pinned,
            pinned_by="this server" if pinned is None else f"session {session!r}",
        )

    def _check_prompt(self, ids: list[int], max_new: int, param: str) -> None:
        context = self.served.context
        check_prompt(
            ids,
            self.config,
            vocab_size=self.served.vocab_size,
            context=None if context is None else int(context),
            max_new=max_new,
            param=param,
        )

    async def _sample(self, session: str | None, prompts: list[list[int]], params: Any) -> Sampled:
        if session is not None:
            self.sessions.check(session)
            seed = None if params.seed is not None else self.sessions.next_seed(session)
            if seed is not None:  # the session's own: reproducible whatever else is served
                params = params.validated_copy(seed=seed)
        try:
            return await self.served.sample(prompts, params)
        # what the rollout refuses in a request (its settings, in a rollout's own words)
        except (BatchError, CapabilityError, ConfigError) as e:
            raise ApiError(400, str(e)) from None

    def _extra(self, prompt: Any, sampled: Sampled, session: str | None, calls: list[int]) -> Any:
        extra: dict[str, Any] = {
            "prompt_token_ids": prompt,
            "weight_version": sampled.weight_version,
        }
        if session is not None:
            extra.update(session_id=session, call_index=calls[0] if len(calls) == 1 else calls)
        return extra

    def _texts(self, ids: list[int]) -> list[str]:
        return [str(self.served.tokenizer.decode([t])) for t in ids]

    def _tops(self, sampled: Sampled, i: int, j: int) -> list[list[tuple[str, float]]] | None:
        """Choice ``j`` of prompt ``i``'s most likely tokens at each position, as texts."""
        if sampled.tops is None:
            return None
        return [
            list(zip(self._texts([t for t, _ in top]), [lp for _, lp in top], strict=True))
            for top in sampled.tops[i][j]
        ]

    # -- routes ----------------------------------------------------------------------------------
    async def models(self, request: Request) -> Answer:
        del request
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "engine-core",
        }
        return JSONAnswer({"object": "list", "data": [card]})

    async def chat(self, request: Request) -> Answer:
        session = self._session(request)
        req: ChatRequest = parse_request(await self._body(request), ChatRequest)
        stop = req.stop_strings()
        params = self._params(req, req.token_limit(), stop, session)
        if req.top_logprobs and not req.logprobs:
            raise ApiError(
                400,
                f"top_logprobs={req.top_logprobs} needs logprobs=true; send both.",
                param="top_logprobs",
            )
        if req.top_logprobs:  # a rollout that does not declare top_logprobs refuses: 400
            params = params.validated_copy(top_logprobs=req.top_logprobs)
        if req.tool_choice not in (None, "auto", "none"):
            raise ApiError(
                400,
                f"tool_choice={req.tool_choice!r}: this server lets the model choose (auto) or "
                f"reads no calls (none); it cannot force a call.",
                param="tool_choice",
            )
        tools = check_tools(req.tools)
        messages = None
        if req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
        else:
            ids, messages = render_messages(self.served.tokenizer, req.messages, tools)
        self._check_prompt(
            ids, params.max_new_tokens, "prompt_token_ids" if messages is None else "messages"
        )
        sampled = await self._sample(session, [ids], params)
        calls = []
        if session is not None:
            calls.append(self._record(session, "chat.completions", ids, sampled, 0, messages).index)
        replies = []
        for j, choice in enumerate(sampled.choices[0]):
            text, _ = reply_text(self.served.tokenizer, choice.token_ids, stop)
            message, called = assistant_message(
                text, tools is not None and req.tool_choice != "none"
            )
            finish = "tool_calls" if called else choice.finish_reason
            texts = self._texts(choice.token_ids) if req.logprobs else None
            replies.append(
                Reply(j, choice, text, message, finish, texts, self._tops(sampled, 0, j))
            )
        extra = self._extra(ids, sampled, session, calls)
        name = self.config.model_name
        if req.stream:
            usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamAnswer(sse(chat_chunks(name, len(ids), replies, extra, usage)))
        return JSONAnswer(chat_body(name, len(ids), replies, extra))

    async def completions(self, request: Request) -> Answer:
        session = self._session(request)
        req: CompletionRequest = parse_request(await self._body(request), CompletionRequest)
        stop = req.stop_strings()
        params = self._params(req, req.token_limit(), stop, session)
        if req.logprobs:  # OpenAI's legacy field: how many most likely tokens per position
            params = params.validated_copy(top_logprobs=req.logprobs)
        prompts = self._completion_prompts(req.prompt, req.n)
        for ids in prompts:
            self._check_prompt(ids, params.max_new_tokens, "prompt")
        sampled = await self._sample(session, prompts, params)
        calls = [
            self._record(session, "completions", ids, sampled, i, None).index
            for i, ids in enumerate(prompts)
            if session is not None
        ]
        replies = []
        for i, choices in enumerate(sampled.choices):
            for j, choice in enumerate(choices):
                text, _ = reply_text(self.served.tokenizer, choice.token_ids, stop)
                texts = self._texts(choice.token_ids) if req.logprobs is not None else None
                top = self._tops(sampled, i, j)
                replies.append(
                    Reply(i * req.n + j, choice, text, None, choice.finish_reason, texts, top)
                )
        prompt_ids: Any = prompts[0] if len(prompts) == 1 else prompts
        extra = self._extra(prompt_ids, sampled, session, calls)
        count = sum(len(p) for p in prompts)
        name = self.config.model_name
        if req.stream:
            usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamAnswer(sse(completion_chunks(name, count, replies, extra, usage)))
        return JSONAnswer(completion_body(name, count, replies, extra))

    def _completion_prompts(self, prompt: Any, n: int) -> list[list[int]]:
        """The prompts of a completions request as ids; ``n`` samples of each may not exceed
        ``max_n`` choices in all."""
        tok = self.served.tokenizer
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        most = self.config.max_n // n
        if not prompt or len(prompt) > most:
            raise ApiError(
                400,
                f"prompt holds {len(prompt)} prompts, each sampled n={n} times; this server "
                f"gives at most {self.config.max_n} choices a request (max_n), so send 1 to "
                f"{most} prompts.",
                param="prompt",
            )
        return [
            list(tok(p, add_special_tokens=False)["input_ids"]) if isinstance(p, str) else list(p)
            for p in prompt
        ]

    def _record(
        self, session: str, endpoint: str, ids: list[int], sampled: Sampled, i: int, messages: Any
    ) -> Any:
        return self.sessions.record(
            session,
            endpoint=endpoint,
            prompt_ids=ids,
            choices=sampled.choices[i],
            weight_version=sampled.weight_version,
            messages=messages,
            routes=None if sampled.routes is None else sampled.routes[i],
        )

    async def new_session(self, request: Request) -> Answer:
        del request
        sid, key = self.sessions.issue()
        return JSONAnswer({"id": sid, "api_key": key})

    async def reward(self, request: Request) -> Answer:
        sid = check_session_id(request.path_params["session_id"])
        body = parse_json_object(await self._body(request))
        if set(body) != {"reward"}:
            raise ApiError(
                400,
                f'a reward call\'s body is {{"reward": NUMBER}}; it held the fields '
                f"{sorted(body)}.",
                param="reward",
            )
        return JSONAnswer(self.sessions.reward(sid, body["reward"]))

    async def get_session(self, request: Request) -> Answer:
        sid = check_session_id(request.path_params["session_id"])
        return JSONAnswer(self.sessions.get(sid))

    async def end_session(self, request: Request) -> Answer:
        sid = check_session_id(request.path_params["session_id"])
        return JSONAnswer(self.sessions.end(sid))

    async def health(self, request: Request) -> Answer:
        del request
        return JSONAnswer({"status": "ok"})


def build_app(endpoint: Endpoint) -> Any:
    """The ASGI application (Starlette) of ``endpoint``."""
    try:
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route
    except ImportError as e:
        raise ConfigError(
            f"the endpoint needs the serve extra ({e}); pip install 'engine-core-roles[serve]'."
        ) from e

    def route(path: str, handler: Handler, method: str, *, key: bool = True) -> Any:
        guarded = endpoint.guarded(handler, key=key)

        async def run(request: Request) -> Response:
            answer = await guarded(request)
            if isinstance(answer, StreamAnswer):
                return StreamingResponse(answer.events, media_type="text/event-stream")
            return JSONResponse(answer.body, status_code=answer.status)

        return Route(path, run, methods=[method])

    async def refused(request: Request, exc: Exception) -> Response:
        """Starlette's own refusals (no such route, wrong method) as OpenAI error objects."""
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        what = {404: "no such route", 405: "method not allowed on this route"}.get(status, str(exc))
        body = error_body(
            f"{request.method} {request.url.path}: {what}; the routes are /v1/models, "
            f"/v1/chat/completions, /v1/completions and /v1/sessions (the first three also "
            f"under /sessions/ID).",
            "invalid_request_error",
        )
        return JSONResponse(body, status_code=status)

    routes = [route("/health", endpoint.health, "GET", key=False)]
    for base in ("", "/sessions/{session_id}"):
        routes += [
            route(f"{base}/v1/models", endpoint.models, "GET"),
            route(f"{base}/v1/chat/completions", endpoint.chat, "POST"),
            route(f"{base}/v1/completions", endpoint.completions, "POST"),
        ]
    routes += [
        route("/sessions/{session_id}/v1/reward", endpoint.reward, "POST"),
        route("/v1/sessions", endpoint.new_session, "POST"),
        route("/v1/sessions/{session_id}/reward", endpoint.reward, "POST"),
        route("/v1/sessions/{session_id}", endpoint.get_session, "GET"),
        route("/v1/sessions/{session_id}/end", endpoint.end_session, "POST"),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: refused})
