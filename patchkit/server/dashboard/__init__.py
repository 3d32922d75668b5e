"""The dashboard: a page the front-end serves at `/dashboard`, from plain HTML, CSS and JavaScript files
shipped in this package (no CDN, no build step), and the two routes that feed it beyond the API's own.

    GET /                 a short page linking to the dashboard and the API's routes
    GET /dashboard        the page; its script and style under /dashboard/ (public: they hold no data)
    GET /v1/activity      the last requests with their calls' timings (`RequestSteps.timeline`), how many it
                          keeps (`window`: the page's percentiles are over them), and the autoscaler's
                          recent decisions
    GET /v1/graph.svg, /v1/pipelines/{name}/graph.svg   a pipeline's graph as patchkit draws it

The page reads everything else from routes the API already serves (/v1/pipelines, each pipeline's
`input_schema` the form's fields; /v1/stats), and sends questions, their inputs typed as that schema
says, to the streaming query route with steps on. Every URL it uses is relative, so it works
behind a proxy that serves the front-end under a path. Its data routes ask
for the deployment's bearer token like every other route: the page asks for the token once, keeps it
in the tab's sessionStorage, and sends it as an `Authorization` header; the files themselves are
public (`PUBLIC_PATHS`), since a browser cannot send a header when it opens a page.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from aiohttp import web

from patchkit.server.replies import error_reply, json_reply, request_id_of
from patchkit.serving.frontend import Frontend
from patchkit.serving.steps import RECENT_REQUESTS

__all__ = ["PUBLIC_PATHS", "DashboardRoutes", "is_public"]

PUBLIC_PATHS = ("/", "/dashboard")  # and the files under /dashboard/
_FILES = {"app.js": "text/javascript", "style.css": "text/css", "index.html": "text/html"}
_HOME = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>patchkit</title></head>
<body style="font-family: sans-serif; margin: 2em">
<h1>patchkit</h1>
<p>This endpoint serves pipelines over HTTP. <a href="dashboard">Open the dashboard</a> to watch them run.</p>
<p>API: <code>POST v1/query</code>, <code>GET v1/pipelines</code>, <code>GET v1/stats</code>, <code>GET metrics</code>,
<code>GET healthz</code>, <code>GET readyz</code> (see the HTTP API reference).</p>
</body></html>
"""


def is_public(path: str) -> bool:
    """Whether `path` is one of the dashboard's files or the home page, served without the token."""
    return path in PUBLIC_PATHS or (path.startswith("/dashboard/") and path.removeprefix("/dashboard/") in _FILES)


def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


class DashboardRoutes:
    """The dashboard's routes over `frontend`; `add_to` puts them on the app's router (server/http.py)."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    def add_to(self, router: web.UrlDispatcher) -> None:
        """Called once by `build_app`."""
        router.add_get("/", self.home)
        router.add_get("/dashboard", self.page)
        router.add_get("/dashboard/{file}", self.file)
        router.add_get("/v1/activity", self.activity)
        router.add_get("/v1/graph.svg", self.svg)
        router.add_get("/v1/pipelines/{name}/graph.svg", self.svg)

    async def home(self, request: web.Request) -> web.Response:
        return web.Response(text=_HOME, content_type="text/html")

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(body=_asset("index.html"), content_type="text/html", charset="utf-8")

    async def file(self, request: web.Request) -> web.Response:
        name = request.match_info["file"]
        if name not in _FILES:
            raise web.HTTPNotFound()
        return web.Response(body=_asset(name), content_type=_FILES[name], charset="utf-8")

    async def activity(self, request: web.Request) -> web.Response:
        """The last requests' calls (timings, batch, replica; never their data), at most `window` of them, and the
        autoscaler's decisions."""
        decisions: list[dict[str, Any]] = list(self.frontend.deployment.autoscaler.recent)
        return web.json_response({"requests": self.frontend.collector.recent.timelines(), "window": RECENT_REQUESTS,
                                  "decisions": decisions[::-1]})

    async def svg(self, request: web.Request) -> web.Response:
        """The graph of the only pipeline, or of `name`; 404 naming the pipelines served for another name."""
        try:
            version = self.frontend.route(request.match_info.get("name"))
        except Exception as exc:
            status, payload = error_reply(exc, debug=self.frontend.config.server.debug)
            return json_reply(status, {"error": payload["error"], "request_id": request_id_of(request)})
        return web.Response(text=version.pipeline.graph.to_svg(), content_type="image/svg+xml")
