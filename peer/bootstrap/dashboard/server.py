"""The dashboard's HTTP server: the page, its static assets and the JSON API, read-only.

Routes (GET and HEAD only; anything else is 405):
- `/` the run, `/peers/<peer id>` one peer: the same HTML shell (static/index.html), whose script
  (static/dashboard.js) fetches the API and builds the DOM with textContent, never innerHTML;
- `/static/<name>` the page's script, style and the vendored Chart.js (static/chart.min.js, MIT,
  LICENSE.chart.js.txt beside it): nothing is loaded from elsewhere, so the page works offline;
- `/api/dashboard`, `/api/run`, `/api/loss`, `/api/stages`, `/api/peers`, `/api/peers/<peer id>`
  (`peer.bootstrap.dashboard.views`).

Every answer carries a strict Content-Security-Policy (scripts, styles, images and fetches from
this origin only; no inline script or style, no framing), `X-Content-Type-Options: nosniff` and no
referrer; JSON escapes <, > and & as well, so a record's string is never markup anywhere. The server is
a stdlib `ThreadingHTTPServer` on a daemon thread (`serve_dashboard`); it binds to 127.0.0.1 unless
told otherwise (`--dashboard-host`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import unquote, urlsplit

from peer.bootstrap.dashboard import views
from peer.bootstrap.dashboard.collect import Collector

logger = logging.getLogger(__name__)

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".txt": "text/plain",
}
MAX_PEER_ID = 128  # characters of a peer id in a URL


def _static(name: str) -> bytes | None:
    """A file of static/ by its plain name (no folders: `..` and slashes never reach the disk)."""
    if not name or "/" in name or "\\" in name or name.startswith(".") or not name.endswith(tuple(STATIC_TYPES)):
        return None
    item = resources.files("peer.bootstrap.dashboard").joinpath("static", name)
    return item.read_bytes() if item.is_file() else None


def to_json(data: Any) -> bytes:
    """Strict JSON (no NaN), with <, > and & escaped so no answer can be read as markup."""
    out = json.dumps(data, allow_nan=False, separators=(",", ":"))
    return out.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


def api(c: Collector, path: str) -> Any:
    """The answer of an /api/ path, or None (404)."""
    routes: dict[str, Callable[[], Any]] = {
        "/api/dashboard": lambda: views.dashboard(c),
        "/api/run": lambda: views.run_view(c),
        "/api/loss": lambda: views.loss_view(c),
        "/api/stages": lambda: views.stages_view(c),
        "/api/peers": lambda: views.peers_view(c),
    }
    if path in routes:
        return routes[path]()
    if path.startswith("/api/peers/"):
        peer_id = unquote(path.removeprefix("/api/peers/"))
        if 0 < len(peer_id) <= MAX_PEER_ID:
            return views.peer_view(c, peer_id)
    return None


def handler_for(c: Collector) -> type[BaseHTTPRequestHandler]:
    """A read-only request handler class over collector `c`."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "peer-dashboard"
        sys_version = ""

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("dashboard %s " + format, self.address_string(), *args)

        def _send(self, status: int, body: bytes, ctype: str, cache: str = "no-store") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Security-Policy", CSP)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Referrer-Policy", "no-referrer")
            self.send_header("X-Frame-Options", "DENY")
            self.send_header("Cache-Control", cache)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            try:
                if path == "/" or path.startswith("/peers/"):
                    page = _static("index.html")
                    assert page is not None, "the package lost static/index.html"
                    return self._send(200, page, "text/html; charset=utf-8")
                if path.startswith("/static/"):
                    name = path.removeprefix("/static/")
                    body = _static(name)
                    if body is not None:
                        ctype = STATIC_TYPES[name[name.rindex(".") :]]
                        return self._send(200, body, ctype, "max-age=3600")
                elif path.startswith("/api/"):
                    data = api(c, path)
                    if data is not None:
                        return self._send(200, to_json(data), "application/json")
            except Exception:  # a bug answers 500 and is logged; the bootstrap goes on
                logger.exception("dashboard: %s failed", path)
                return self._send(500, b'{"error":"internal"}', "application/json")
            self._send(404, b'{"error":"not found"}', "application/json")

        def do_HEAD(self) -> None:
            self.do_GET()

        def _refuse(self) -> None:
            self._send(405, b'{"error":"read-only"}', "application/json")

        do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

    return Handler


class DashboardServer:
    """The running HTTP server (`serve_dashboard`); `stop()` shuts it down."""

    def __init__(self, server: ThreadingHTTPServer, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread
        self.host, self.port = str(server.server_address[0]), int(server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_dashboard(c: Collector, port: int, host: str = "127.0.0.1") -> DashboardServer:
    """Serve the dashboard of `c` on host:port (0: a free port) from a daemon thread."""
    server = ThreadingHTTPServer((host, port), handler_for(c))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="dashboard-http", daemon=True)
    thread.start()
    running = DashboardServer(server, thread)
    logger.info("dashboard on %s", running.url)
    return running
