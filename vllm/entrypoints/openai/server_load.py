"""ServerLoadTracker: counts the generation requests in flight (upstream's
--enable-server-load-tracking, read at GET /load as {"server_load": n}).

Pure ASGI, so a request counts from its arrival until its response (a whole stream included)
has been sent or has failed; the count lives on app.state.server_load_metrics, as upstream.
"""
from typing import Iterable


class ServerLoadTracker:
    def __init__(self, app, state, paths: Iterable[str]):
        self.app = app
        self.state = state
        self.paths = frozenset(paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or _route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        self.state.server_load_metrics += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load_metrics -= 1


def _route_path(scope) -> str:
    """The path without --root-path (a proxy may or may not have stripped it)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path
