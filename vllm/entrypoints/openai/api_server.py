"""OpenAI-compatible HTTP server: `build_app(engine, ...)`, and its command line
(`python -m vllm.entrypoints.openai.api_server`, `vllm serve`).

Routes: /v1/models, /v1/completions, /v1/chat/completions, /invocations (SageMaker: routed by
the body's shape), /health, /ping, /version, /load, /tokenize, /detokenize, /tokenizer_info
(--enable-tokenizer-info-endpoint), /metrics, and with --enable-sleep-mode /sleep, /wake_up,
/is_sleeping. With --api-key every route but the probes, /version, /metrics and the API docs
needs the key (bearer_auth.py). Every error is answered in OpenAI's shape.

Sleep mode (upstream's): POST /sleep?level=1 releases the KV cache, level=2 the weights too;
mode=abort (the default) ends the requests in flight with finish_reason "abort", mode=wait lets
them finish first (new ones are refused meanwhile). While asleep a generation request is a 503,
/health stays 200 and GET /is_sleeping says {"is_sleeping": true}; POST /wake_up (tags=weights,
tags=kv_cache: part of it) restores the pool at its size and reloads the weights as loaded the
first time.

When the engine dies (e.g. a tensor-parallel worker failed: AsyncLLMEngine.died) every request
in flight gets a 500 (an error event when streaming), new requests and /health get 500, and
ENGINE_DEATH_GRACE_S later the server stops (the uvicorn.Server in app.state.server) and
`vllm serve` exits with code 1, as upstream's server exits when its engine is dead
(VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps it up). Stopping the server (SIGINT / SIGTERM) shuts
the engine down, tensor-parallel workers included.
"""
import argparse
import asyncio
import logging
import os
import sys
from contextlib import asynccontextmanager
from typing import List, Optional, Sequence, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoTokenizer

import vllm
from vllm import envs
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm_engine import AsyncLLMEngine, EngineStepError
from vllm.engine.llm_engine import EngineSleepingError
from vllm.entrypoints.openai.bearer_auth import BearerAuth
from vllm.entrypoints.openai.errors import OpenAIError
from vllm.entrypoints.openai.fingerprint import system_fingerprint
from vllm.entrypoints.openai.metrics import ServerMetrics
from vllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                              DetokenizeRequest, DetokenizeResponse,
                                              ErrorResponse, ModelCard, ModelList, ParamError,
                                              TokenizeChatRequest, TokenizeCompletionRequest,
                                              TokenizerInfoResponse, TokenizeResponse,
                                              VersionResponse)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat, auto_tool_parser
from vllm.entrypoints.openai.server_load import ServerLoadTracker
from vllm.entrypoints.openai.server_options import ServerOptions
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.tokenizer_info import tokenizer_config
from vllm.entrypoints.openai.tool_parsers import tool_parser_names
from vllm.model_executor.gguf_loader import DEFAULT_MODEL_NAME
from vllm.reasoning import reasoning_parser_names

logger = logging.getLogger("vllm.entrypoints.openai.api_server")

_ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
           404: {"model": ErrorResponse}, 500: {"model": ErrorResponse}}
# the routes a generation request takes (what --enable-server-load-tracking counts)
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/invocations")
# after the engine dies the server goes on answering 500 (/health too) this long, so clients and
# probes see why, then stops; the watchdog looks this often
ENGINE_DEATH_GRACE_S = 2.0
_WATCHDOG_INTERVAL_S = 0.2
# upstream's uvicorn.main.STARTUP_FAILURE: the exit code of a server that never started
_STARTUP_FAILURE = 3


_TYPE_TAGS = {"body", "str", "int", "float", "bool", "dict", "list", "none"}


def _field_path(loc) -> str:
    """('body', 'messages', 0, 'content', 'list[TextContentPart]', 0) -> 'messages.0.content.0':
    pydantic's union-member tags are dropped."""
    keep = [str(x) for x in loc if not (isinstance(x, str) and (
        x in _TYPE_TAGS or "[" in x or x[:1].isupper()))]
    return ".".join(keep)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """upstream's 400: "N validation error(s):" then each pydantic error (its type, loc, msg,
    input, ctx); param names the field (a request-level check names its own)."""
    errors = exc.errors()
    param = next((e["ctx"]["error"].param for e in errors
                  if isinstance(e.get("ctx", {}).get("error"), ParamError)), None)
    if param is None and errors:
        param = "body" if errors[0].get("type") == "json_invalid" \
            else _field_path(errors[0].get("loc", ()))
    if not errors:
        return OpenAIError("Validation error", param="body")
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(f"  {e}" for e in errors)
    return OpenAIError(message, param=param or "body")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(EngineSleepingError)
    async def sleeping(_, exc: EngineSleepingError):
        return OpenAIError(str(exc), status=503).response()

    @app.exception_handler(EngineStepError)     # EngineDeadError too: the engine is dead
    async def engine_error(_, exc: EngineStepError):
        return OpenAIError(str(exc), status=500).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return OpenAIError(str(exc.detail), status=exc.status_code).response()

    @app.exception_handler(Exception)
    async def internal_error(_, exc: Exception):
        logger.error("unhandled error", exc_info=exc)
        return OpenAIError(f"internal error: {exc!r}", status=500).response()


def build_app(engine: AsyncLLMEngine, served_model_names: Optional[Sequence[str]] = None,
              api_key: Optional[str] = None, chat_template: Optional[str] = None,
              shutdown_engine: bool = True, enable_auto_tool_choice: bool = False,
              tool_call_parser: Optional[str] = None,
              options: Optional[ServerOptions] = None,
              reasoning_parser: Optional[str] = None) -> FastAPI:
    """The server's app. Its lifespan starts the engine loop (and stops it on exit when
    shutdown_engine is true). api_key: None reads VLLM_API_KEY. tool_choice "auto" needs
    enable_auto_tool_choice and a tool_call_parser name (tool_parsers/: "hermes").
    reasoning_parser (vllm/reasoning/: "deepseek_r1", "qwen3"): chat replies carry the
    reasoning as reasoning_content. An engine built with enable_sleep_mode
    (--enable-sleep-mode) gets the /sleep, /wake_up and /is_sleeping routes."""
    names = list(served_model_names or [os.path.basename(str(engine.engine.model_config.model))])
    api_key = api_key or envs.VLLM_API_KEY
    tokenizer = AutoTokenizer.from_pretrained(engine.engine.model_config.tokenizer)
    completion = OpenAIServingCompletion(engine, tokenizer, names)
    chat = OpenAIServingChat(engine, tokenizer, names, _load_template(chat_template),
                             enable_auto_tools=enable_auto_tool_choice,
                             tool_parser=tool_call_parser, reasoning_parser=reasoning_parser)
    options = options or ServerOptions()
    completion.options = chat.options = options
    completion.fingerprint = chat.fingerprint = system_fingerprint(engine.engine)
    metrics = ServerMetrics(engine, names[0])

    @asynccontextmanager
    async def lifespan(_):
        engine.start()
        watchdog = asyncio.ensure_future(_stop_on_engine_death(app, engine))
        try:
            yield
        finally:
            watchdog.cancel()
            if shutdown_engine:
                engine.shutdown()

    app = FastAPI(title="vLLM (vToken fork) OpenAI-compatible API", version=vllm.__version__,
                  lifespan=lifespan)
    app.root_path = options.root_path      # set after: the constructor's argument is deprecated
    app.state.engine, app.state.metrics = engine, metrics
    app.state.server = None       # the uvicorn.Server running the app: stopped if the engine dies
    app.state.server_load_metrics = 0
    _install_error_handlers(app)
    if options.enable_server_load_tracking:
        app.add_middleware(ServerLoadTracker, state=app.state, paths=_GENERATION_PATHS)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.get("/health")
    async def health():
        """200 while the engine loop runs, asleep or not."""
        if engine.died:
            raise OpenAIError(str(engine.dead_error), status=500)
        if not engine.is_running:
            raise OpenAIError("the engine loop is not running", status=503)
        return Response(status_code=200)

    @app.get("/ping")
    async def ping():
        """SageMaker's health probe (upstream's, GET and POST): /health's answer."""
        return await health()

    @app.post("/ping")
    async def ping_post():
        return await health()

    def check_engine() -> None:
        """A dead (or stopped) engine: a 500, a sleeping one a 503, before any response
        begins, streamed or not."""
        if engine.errored:
            raise engine.dead_error
        engine.check_awake()

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return VersionResponse(version=vllm.__version__)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/load")
    async def load():
        """In-flight generation requests (0 unless --enable-server-load-tracking), as upstream."""
        return JSONResponse({"server_load": app.state.server_load_metrics})

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models():
        root = options.model_root or str(engine.engine.model_config.model)
        return ModelList(data=[ModelCard(id=n, root=root, max_model_len=engine.max_model_len)
                               for n in names])

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(request: CompletionRequest, raw_request: Request):
        check_engine()
        return await completion.create(request, raw_request)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        check_engine()
        return await chat.create(request, raw_request)

    @app.post("/invocations", responses=_ERRORS)
    async def invocations(raw_request: Request):
        """SageMaker's one route: a chat body (messages) goes to chat, else a completion body
        (prompt); the first request type that validates wins, as upstream."""
        check_engine()
        try:
            body = await raw_request.json()
        except ValueError as e:
            raise OpenAIError(f"JSON decode error: {e}", param="body") from None
        for request_type, serving in ((ChatCompletionRequest, chat),
                                      (CompletionRequest, completion)):
            try:
                request = request_type.model_validate(body)
            except ValidationError:
                continue
            return await serving.create(request, raw_request)
        raise OpenAIError("Cannot find suitable handler for request. Expected one of: "
                          "['ChatCompletionRequest', 'CompletionRequest']", param="body")

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(request: Union[TokenizeCompletionRequest, TokenizeChatRequest]):
        completion.model_name(request.model)
        if isinstance(request, TokenizeChatRequest):
            tools = [t.model_dump(exclude_none=True) for t in request.tools or []] or None
            ids = chat.render(request.messages, request.add_generation_prompt,
                              request.add_special_tokens, tools,
                              request.continue_final_message)["prompt_token_ids"]
        else:
            ids = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                                token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(request: DetokenizeRequest):
        completion.model_name(request.model)
        completion.check_token_ids(request.tokens, param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))

    if options.enable_tokenizer_info_endpoint:    # upstream serves it only when asked
        @app.get("/tokenizer_info", response_model=TokenizerInfoResponse)
        async def tokenizer_info():
            return JSONResponse(tokenizer_config(tokenizer, chat.chat_template))

    if engine.engine.enable_sleep_mode:      # --enable-sleep-mode (an engine flag)
        _add_sleep_routes(app, engine)
    return app


def _add_sleep_routes(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """Upstream's /sleep, /wake_up and /is_sleeping; a bad level, mode or tag is a 400."""

    @app.post("/sleep", responses=_ERRORS)
    async def sleep(level: int = 1, mode: str = "abort"):
        try:
            await engine.sleep(level, mode)
        except ValueError as e:      # "level: ..." / "mode: ...": the message names the param
            name = str(e).split(":", 1)[0]
            raise OpenAIError(str(e), param=name if name in ("level", "mode") else None) \
                from None
        return Response(status_code=200)

    @app.post("/wake_up", responses=_ERRORS)
    async def wake_up(raw_request: Request):
        tags = raw_request.query_params.getlist("tags") or None
        try:
            await engine.wake_up(tags)
        except ValueError as e:
            raise OpenAIError(str(e), param="tags") from None
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})


async def _stop_on_engine_death(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """Once the engine has died, stop the server (ENGINE_DEATH_GRACE_S later)."""
    while not engine.died:
        await asyncio.sleep(_WATCHDOG_INTERVAL_S)
    if envs.VLLM_KEEP_ALIVE_ON_ENGINE_DEATH:
        logger.error("%s; VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set: the server stays up and "
                     "answers 500", engine.dead_error)
        return
    server = app.state.server
    if server is None:
        logger.error("%s; the server answers 500 from now on", engine.dead_error)
        return
    logger.error("%s; the server stops in %.0f s", engine.dead_error, ENGINE_DEATH_GRACE_S)
    await asyncio.sleep(ENGINE_DEATH_GRACE_S)
    server.should_exit = True


def _load_template(template: Optional[str]) -> Optional[str]:
    """--chat-template: a file path or the template text itself."""
    if template and os.path.isfile(template):
        with open(template) as f:
            return f.read()
    return template


# ---- command line -----------------------------------------------------------------------------
def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add = parser.add_argument
    add("--host", type=str, default="0.0.0.0")
    add("--port", type=int, default=8000)
    add("--api-key", type=str, default=None,
        help="require `Authorization: Bearer KEY` on every route but /health, /ping, "
             "/version, /metrics and the API docs (default: $VLLM_API_KEY)")
    add("--served-model-name", type=str, nargs="+", default=None,
        help="model name(s) the API accepts (default: the model's directory name)")
    add("--chat-template", type=str, default=None,
        help="chat template file or text (default: the tokenizer's)")
    add("--enable-auto-tool-choice", action="store_true",
        help='serve tool_choice "auto" (and requests with tools but no tool_choice): the '
             "output's tool calls are parsed by --tool-call-parser")
    add("--tool-call-parser", type=str, default=None,
        help=f"how tool calls are written in the output: {', '.join(tool_parser_names())} "
             "(hermes: <tool_call>{...}</tool_call>, as examples/tool_chat_template_hermes.jinja "
             "asks for)")
    add("--reasoning-parser", type=str, default=None, choices=reasoning_parser_names(),
        help="split a reasoning model's chat output into reasoning_content (the <think> ... "
             "</think> part) and content: deepseek_r1 (the output may omit <think>; without "
             "</think> it is all reasoning), qwen3 (reasoning only after a leading <think>)")
    add("--uvicorn-log-level", type=str, default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"])
    add("--uds", type=str, default=None,
        help="serve on this unix domain socket instead of --host/--port")
    add("--root-path", type=str, default=None,
        help="the path prefix a path-based routing proxy serves this app under")
    add("--enable-server-load-tracking", action="store_true",
        help="count in-flight generation requests; GET /load reports {\"server_load\": n}")
    add("--enable-tokenizer-info-endpoint", action="store_true",
        help="serve GET /tokenizer_info (the tokenizer's configuration and chat template)")
    add("--return-tokens-as-token-ids", action="store_true",
        help='write tokens in logprobs as "token_id:<id>" (a request\'s '
             "return_tokens_as_token_ids overrides it)")
    add("--kv-usage-in-response", action="store_true",
        help="ours: report usage.kv (evicted / live tokens, peak blocks) in every response, "
             "not only when a request asks with \"kv_usage\": true")
    return parser


def make_arg_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        description="vLLM (vToken fork) OpenAI-compatible server")
    EngineArgs.add_cli_args(parser)
    return add_server_args(parser)


def served_names(args: argparse.Namespace) -> List[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model is None:
        return [DEFAULT_MODEL_NAME]
    return [args.model.rstrip("/")]


def run_server(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    auto_tool_parser(args.enable_auto_tool_choice, args.tool_call_parser)  # before the model loads
    options = ServerOptions.from_cli_args(args, model_root=args.model or DEFAULT_MODEL_NAME)
    engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    app = build_app(engine, served_names(args), args.api_key, args.chat_template,
                    enable_auto_tool_choice=args.enable_auto_tool_choice,
                    tool_call_parser=args.tool_call_parser, options=options,
                    reasoning_parser=args.reasoning_parser)
    if args.uds:
        logger.info("OpenAI-compatible API on unix socket %s (model %s)", args.uds,
                    served_names(args)[0])
        where = dict(uds=args.uds)
    else:
        logger.info("OpenAI-compatible API at http://%s:%d%s/v1 (model %s)", args.host,
                    args.port, options.root_path, served_names(args)[0])
        where = dict(host=args.host, port=args.port)
    serve_app(app, engine, log_level=args.uvicorn_log_level, **where)


def serve_app(app: FastAPI, engine: AsyncLLMEngine, **uvicorn_kwargs) -> None:
    """uvicorn.run(app), with the server in app.state.server (the app stops it when the engine
    dies); exits with code 1 if the engine died. SIGINT / SIGTERM stop the server, and its
    lifespan shuts the engine down."""
    uvicorn_kwargs.setdefault("timeout_keep_alive", 5)
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_kwargs))
    app.state.server = server
    try:
        server.run()
    except KeyboardInterrupt:     # SIGINT, re-raised by uvicorn after its graceful shutdown
        pass
    finally:
        uds = uvicorn_kwargs.get("uds")
        if uds and os.path.exists(uds):
            os.remove(uds)
    if engine.died:
        logger.error("exiting: %s", engine.dead_error)
        sys.exit(1)
    if not server.started:
        sys.exit(_STARTUP_FAILURE)


def main(argv: Optional[List[str]] = None) -> None:
    run_server(make_arg_parser().parse_args(argv))


if __name__ == "__main__":
    main()
