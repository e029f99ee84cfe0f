"""The Starlette app behind `shardwise ui`: static pages, a JSON API, server-sent events.

Every answer comes from the modules the CLI uses: the form is parsed as CLI arguments
(forms.py), runs are read from what `shardwise train` writes (runs.py), bench reports are
the JSON `shardwise bench` writes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
from importlib import resources

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from shardwise.errors import ShardwiseError
from shardwise.ui import forms, runs

STATIC = str(resources.files("shardwise.ui").joinpath("static"))
TOKEN_HEADER = "x-shardwise-token"
MAX_BODY = 1 << 20  # bytes; a form is a few hundred
DRAIN = 64 << 20  # an oversized body is read (and dropped) up to this before the 413


class BodyTooLarge(ShardwiseError):
    pass


class TokenMiddleware:
    """With --host: every request carries the printed token (?token=, the header, or the
    cookie the first tokened page load sets)."""

    def __init__(self, app, token: str):
        self.app, self.token = app, token

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        req = Request(scope)
        # a cookie is per host, not per port: each server's has its port in its name
        cookie = f"shardwise_token_{(scope.get('server') or ('', 0))[1]}"
        given = req.query_params.get("token") or req.headers.get(TOKEN_HEADER) or req.cookies.get(cookie)
        if not given or not hmac.compare_digest(given.encode(), self.token.encode()):
            resp = PlainTextResponse("shardwise ui: a token is required (open the URL printed at start)", 401)
            return await resp(scope, receive, send)
        if req.query_params.get("token"):
            async def send_cookie(message):
                if message["type"] == "http.response.start":
                    message.setdefault("headers", []).append(
                        (b"set-cookie", f"{cookie}={self.token}; HttpOnly; SameSite=Strict; Path=/".encode()))
                await send(message)
            return await self.app(scope, receive, send_cookie)
        return await self.app(scope, receive, send)


def _error(e: ShardwiseError, status: int = 400) -> JSONResponse:
    if isinstance(e, BodyTooLarge):
        status = 413
    return JSONResponse({"error": str(e), "field": getattr(e, "field", None)}, status)


async def _body(request: Request) -> dict:
    if request.headers.get("content-type", "").split(";")[0] != "application/json":
        raise ShardwiseError("requests that change something must be JSON (application/json)")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > DRAIN:
        raise BodyTooLarge(f"the request body is too large ({declared} bytes; a form is a few hundred)")
    body, seen = bytearray(), 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen <= MAX_BODY:
            body += chunk
        elif seen > DRAIN:  # past this the client is not sending a form: answer without reading on
            break
    if seen > MAX_BODY:  # read to its end (up to DRAIN) so that a client still sending gets the answer
        raise BodyTooLarge(f"the request body is too large (over {MAX_BODY} bytes; a form is a few hundred)")
    try:
        d = json.loads(body)
    except (ValueError, RecursionError):
        raise ShardwiseError("the request body is not valid JSON") from None
    if not isinstance(d, dict):
        raise ShardwiseError("the request body must be a JSON object")
    return d


# Every handler reads the file system in a worker thread, never on the event loop: a slow disk, or a run's large
# files, must not stall the other requests (the page's event stream among them).
def _runs_dir(request: Request) -> str:
    return request.app.state.runs_dir


def _page(name: str):
    async def handler(request):
        return FileResponse(os.path.join(STATIC, name))
    return handler


async def _form_fields(request):
    return JSONResponse({"fields": [f.__dict__ for f in forms.fields()], "runs_dir": _runs_dir(request)})


async def _plan(request):
    try:
        values = await _body(request)
        p = await asyncio.to_thread(forms.plan, values)
        t = await asyncio.to_thread(forms.train, values)
    except ShardwiseError as e:
        return _error(e)
    return JSONResponse({"plan": p, "train": t})


async def _rehearse(request):
    try:
        values = await _body(request)
        return JSONResponse({"plan": await asyncio.to_thread(forms.rehearse, values)})
    except ShardwiseError as e:
        return _error(e)


async def _launch(request):
    runs_dir = _runs_dir(request)
    try:
        values = await _body(request)
        t = await asyncio.to_thread(forms.train, values, runs_dir, True)
        started = await asyncio.to_thread(runs.launch, runs_dir, t)
    except ShardwiseError as e:
        return _error(e)
    return JSONResponse({**started, "command": t["command"]})


def _listing(runs_dir: str) -> list[dict]:
    return [runs.info(runs_dir, p) for p in runs.find(runs_dir)]


async def _run_list(request):
    runs_dir = _runs_dir(request)
    return JSONResponse({"runs": await asyncio.to_thread(_listing, runs_dir), "runs_dir": runs_dir})


def _detail(runs_dir: str, name: str) -> dict:
    path = runs.resolve(runs_dir, name)
    d = runs.info(runs_dir, path, True)
    d["metrics"], _ = runs.metrics(path)  # the first, the last and an even sample (runs.METRICS_POINTS at most)
    return d


async def _run_detail(request):
    try:
        d = await asyncio.to_thread(_detail, _runs_dir(request), request.query_params.get("run", ""))
    except ShardwiseError as e:
        return _error(e, 404)
    return JSONResponse(d)


def _act(runs_dir: str, action: str, body: dict) -> dict:
    path = runs.resolve(runs_dir, str(body.get("run", "")))
    if action == "stop":
        return runs.stop(path)
    # remote code, or listening beyond loopback, only when this request says so (JSON true)
    return runs.resume(path, body.get("trust_remote_code") is True, body.get("listen_beyond_loopback") is True)


async def _run_action(request):
    action = request.path_params["action"]
    if action not in ("stop", "resume"):
        return JSONResponse({"error": f"/api/run/{action}: no such action (stop, resume)", "field": None}, 404)
    try:
        body = await _body(request)
        result = await asyncio.to_thread(_act, _runs_dir(request), action, body)
    except ShardwiseError as e:
        return _error(e)
    return JSONResponse(result)


def _diff(runs_dir: str, a: str, b: str) -> list[dict]:
    return runs.diff(runs.resolve(runs_dir, a), runs.resolve(runs_dir, b))


async def _run_diff(request):
    q = request.query_params
    try:
        d = await asyncio.to_thread(_diff, _runs_dir(request), q.get("a", ""), q.get("b", ""))
    except ShardwiseError as e:
        return _error(e, 404)
    return JSONResponse({"diff": d})


def _new_metrics(runs_dir: str, name: str, offset: int) -> tuple[list[dict], int]:
    try:
        return runs.metrics(runs.resolve(runs_dir, name), offset)
    except ShardwiseError:
        return [], offset


async def _events(request):
    """Server-sent events: the run list when it changes; new metrics records of ?run= (the first answer: the
    first, the last and an even sample of the records so far)."""
    from sse_starlette.sse import EventSourceResponse

    runs_dir, name = _runs_dir(request), request.query_params.get("run")

    async def gen():
        last, offset = None, 0
        while not await request.is_disconnected():
            found = await asyncio.to_thread(_listing, runs_dir)
            key = json.dumps([(r["name"], r["state"], r["why"]) for r in found])
            if key != last:
                last = key
                yield {"event": "runs", "data": json.dumps(found)}
            if name:
                recs, offset = await asyncio.to_thread(_new_metrics, runs_dir, name, offset)
                if recs:
                    yield {"event": "metrics", "data": json.dumps(recs)}
            await asyncio.sleep(1.0)

    return EventSourceResponse(gen(), ping=15)


async def _bench_list(request):
    return JSONResponse({"reports": await asyncio.to_thread(runs.bench_reports, _runs_dir(request))})


async def _bench_one(request):
    try:
        return JSONResponse(await asyncio.to_thread(runs.bench_report, _runs_dir(request),
                                                    request.query_params.get("report", "")))
    except ShardwiseError as e:
        return _error(e, 404)


ROUTES = [
    Route("/", _page("plan.html")),
    Route("/runs", _page("runs.html")),
    Route("/bench", _page("bench.html")),
    Route("/api/fields", _form_fields),
    Route("/api/plan", _plan, methods=["POST"]),
    Route("/api/rehearse", _rehearse, methods=["POST"]),
    Route("/api/launch", _launch, methods=["POST"]),
    Route("/api/runs", _run_list),
    Route("/api/run", _run_detail),
    Route("/api/run/{action:str}", _run_action, methods=["POST"]),
    Route("/api/diff", _run_diff),
    Route("/api/events", _events),
    Route("/api/bench", _bench_list),
    Route("/api/bench/report", _bench_one),
    Mount("/static", StaticFiles(directory=STATIC), name="static"),
]


def create_app(runs_dir: str, token: str | None = None, allowed_hosts: list[str] | None = None) -> Starlette:
    runs_dir = os.path.abspath(runs_dir)
    os.makedirs(runs_dir, exist_ok=True)
    middleware = []
    if allowed_hosts:  # loopback: refuse other Host headers (DNS rebinding)
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts))
    if token:
        middleware.append(Middleware(TokenMiddleware, token=token))
    app = Starlette(routes=ROUTES, middleware=middleware)
    app.state.runs_dir = runs_dir
    return app
