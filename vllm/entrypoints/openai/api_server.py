"""OpenAI-compatible HTTP server: `build_app(engine, ...)`, and its command line
(`python -m vllm.entrypoints.openai.api_server`, `vllm serve`).

Routes: /v1/models, /v1/completions, /v1/chat/completions (Bearer auth when --api-key is set),
/health, /version, /tokenize, /detokenize, /metrics. Every error is answered in OpenAI's shape.
"""
import argparse
import hmac
import logging
import os
from contextlib import asynccontextmanager
from typing import List, Optional, Sequence, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoTokenizer

import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.entrypoints.openai.errors import OpenAIError
from vllm.entrypoints.openai.metrics import ServerMetrics
from vllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                              DetokenizeRequest, DetokenizeResponse,
                                              ErrorResponse, ModelCard, ModelList,
                                              TokenizeChatRequest, TokenizeCompletionRequest,
                                              TokenizeResponse, VersionResponse)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.model_executor.gguf_loader import DEFAULT_MODEL_NAME

logger = logging.getLogger("vllm.entrypoints.openai.api_server")

_ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
           500: {"model": ErrorResponse}}


class BearerAuth:
    """ASGI middleware: /v1/* needs `Authorization: Bearer <key>` (pure ASGI, so streaming
    responses and disconnect detection pass through untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") \
                and scope["method"] != "OPTIONS":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = OpenAIError("Unauthorized: a valid Bearer API key is required", status=401)
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


_TYPE_TAGS = {"body", "str", "int", "float", "bool", "dict", "list", "none"}


def _field_path(loc) -> str:
    """('body', 'messages', 0, 'content', 'list[TextContentPart]', 0) -> 'messages.0.content.0':
    pydantic's union-member tags are dropped."""
    keep = [str(x) for x in loc if not (isinstance(x, str) and (
        x in _TYPE_TAGS or "[" in x or x[:1].isupper()))]
    return ".".join(keep)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return OpenAIError(f"malformed JSON body: {errors[0].get('ctx', {}).get('error', '')}",
                           param="body")
    message = "; ".join(f"{_field_path(e.get('loc', ())) or 'body'}: {e.get('msg', 'invalid')}"
                        for e in errors[:5])
    param = _field_path(errors[0].get("loc", ())) if errors else ""
    return OpenAIError(message or "invalid request", param=param or "body")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return OpenAIError(str(exc.detail), status=exc.status_code).response()

    @app.exception_handler(Exception)
    async def internal_error(_, exc: Exception):
        logger.error("unhandled error", exc_info=exc)
        return OpenAIError(f"internal error: {exc!r}", status=500).response()


def build_app(engine: AsyncLLMEngine, served_model_names: Optional[Sequence[str]] = None,
              api_key: Optional[str] = None, chat_template: Optional[str] = None,
              shutdown_engine: bool = True) -> FastAPI:
    """The server's app. Its lifespan starts the engine loop (and stops it on exit when
    shutdown_engine is true)."""
    names = list(served_model_names or [os.path.basename(str(engine.engine.model_config.model))])
    tokenizer = AutoTokenizer.from_pretrained(engine.engine.model_config.tokenizer)
    completion = OpenAIServingCompletion(engine, tokenizer, names)
    chat = OpenAIServingChat(engine, tokenizer, names, _load_template(chat_template))
    metrics = ServerMetrics(engine, names[0])

    @asynccontextmanager
    async def lifespan(_):
        engine.start()
        yield
        if shutdown_engine:
            engine.shutdown()

    app = FastAPI(title="vLLM (vToken fork) OpenAI-compatible API", version=vllm.__version__,
                  lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    _install_error_handlers(app)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.get("/health")
    async def health():
        if not engine.is_running:
            raise OpenAIError("the engine loop is not running", status=503)
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return VersionResponse(version=vllm.__version__, engine=engine.engine.get_engine_info())

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models():
        root = str(engine.engine.model_config.model)
        return ModelList(data=[ModelCard(id=n, root=root, max_model_len=engine.max_model_len)
                               for n in names])

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(request: CompletionRequest, raw_request: Request):
        return await completion.create(request, raw_request)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await chat.create(request, raw_request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(request: Union[TokenizeCompletionRequest, TokenizeChatRequest]):
        completion.model_name(request.model)
        if isinstance(request, TokenizeChatRequest):
            ids = chat.render(request.messages, request.add_generation_prompt,
                              request.add_special_tokens)["prompt_token_ids"]
        else:
            ids = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(request: DetokenizeRequest):
        completion.model_name(request.model)
        completion.check_token_ids(request.tokens, param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))

    return app


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
    add("--api-key", type=str, default=os.environ.get("VLLM_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1/* (default: $VLLM_API_KEY)")
    add("--served-model-name", type=str, nargs="+", default=None,
        help="model name(s) the API accepts (default: the model's directory name)")
    add("--chat-template", type=str, default=None,
        help="chat template file or text (default: the tokenizer's)")
    add("--uvicorn-log-level", type=str, default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"])
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
    engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    app = build_app(engine, served_names(args), args.api_key, args.chat_template)
    logger.info("OpenAI-compatible API at http://%s:%d/v1 (model %s)", args.host, args.port,
                served_names(args)[0])
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_keep_alive=5)


def main(argv: Optional[List[str]] = None) -> None:
    run_server(make_arg_parser().parse_args(argv))


if __name__ == "__main__":
    main()
