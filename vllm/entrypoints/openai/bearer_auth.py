"""BearerAuth: with --api-key (or VLLM_API_KEY) every route needs `Authorization: Bearer <key>`
except OPEN_PATHS, the ones that run neither the model nor the tokenizer (probes, version,
metrics, the API docs). Upstream guards /v1/* only; here /invocations, /tokenize, /detokenize,
/tokenizer_info, /load, /sleep, /wake_up, /is_sleeping and any route not in OPEN_PATHS are
guarded too. The check is upstream's: the scheme is case-insensitive, the key compared by its
SHA-256 in constant time; a refusal is a 401 in OpenAI's error shape. Pure ASGI, so streaming
responses and disconnect detection pass through untouched.
"""
import hashlib
import hmac

from vllm.entrypoints.openai.errors import OpenAIError

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/openapi.json", "/docs",
                        "/docs/oauth2-redirect", "/redoc"})


class BearerAuth:
    def __init__(self, app, api_key: str):
        self.app = app
        self.key_hash = hashlib.sha256(api_key.encode()).digest()

    def authorized(self, header: bytes) -> bool:
        scheme, _, key = header.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(hashlib.sha256(key.encode()).digest(), self.key_hash)

    async def __call__(self, scope, receive, send):
        # lifespan passes (the app serves no websocket), and CORS preflights
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):   # --root-path: /prefix/v1/... is guarded too
            path = path[len(root):]
        if path.rstrip("/") not in OPEN_PATHS \
                and not self.authorized(dict(scope["headers"]).get(b"authorization", b"")):
            err = OpenAIError("Unauthorized: a valid Bearer API key is required", status=401)
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
