"""`shardwise ui`: serve the Plan / Runs / Bench pages on 127.0.0.1 (or --host), behind a token printed at start."""

from __future__ import annotations

import argparse
import errno
import os
import socket

from shardwise.errors import ShardwiseError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "ui", help="A local web page to plan, launch, watch and compare runs.",
        description="Serve a web page that plans a run as you type (the planner of `shardwise plan`), starts it "
                    "as `shardwise train` in the background, shows every run of the runs directory with live "
                    "curves, and charts bench reports. Binds 127.0.0.1 unless --host is given. Every request needs "
                    "the token in the URL printed at start (the page can start runs as you: on 127.0.0.1 too, "
                    "since every user of this machine can reach 127.0.0.1); --no-token drops it on 127.0.0.1.")
    p.add_argument("--runs-dir", default="runs", help="Directory of the runs (default: ./runs).")
    p.add_argument("--port", default="7860", help="Port (default 7860; 0: any free port).")
    p.add_argument("--host", default=None, help="Address to bind instead of 127.0.0.1.")
    p.add_argument("--no-token", action="store_true",
                   help="Serve 127.0.0.1 without a token: any process of any user of this machine can then use the "
                        "page (and start runs as you). Not with --host.")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def _socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:  # the address, not the port
            raise ShardwiseError(f"--host {host}: cannot listen on it ({e.strerror}); give an address of this "
                                 "machine (0.0.0.0: all of them)")
        raise ShardwiseError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror}); choose another --port")
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def run(args) -> int:
    try:
        port = int(args.port)
        if not 0 <= port < 65536:
            raise ValueError
    except ValueError:
        raise ShardwiseError(f"--port must be an integer in 0..65535, got '{args.port}'")
    try:
        import uvicorn

        from shardwise.ui.app import create_app
    except ImportError as e:
        raise ShardwiseError(f"shardwise ui needs the 'ui' extra ({e.name} is missing): pip install 'shardwise[ui]'")
    import secrets

    host = args.host or "127.0.0.1"
    loopback = host in LOOPBACK
    if getattr(args, "no_token", False) and not loopback:
        raise ShardwiseError(f"--no-token: only on 127.0.0.1; --host {host} can be reached from other machines, "
                             "so every request needs the token; drop --no-token or --host")
    token = None if getattr(args, "no_token", False) else secrets.token_urlsafe(18)
    try:
        os.makedirs(args.runs_dir, exist_ok=True)
    except OSError as e:
        why = "not a directory" if os.path.exists(args.runs_dir) else e.strerror
        raise ShardwiseError(f"--runs-dir {args.runs_dir}: cannot use it as the runs directory ({why}); "
                             "give a directory (it is created if missing)")
    sock = _socket(host, port)
    port = sock.getsockname()[1]
    allowed = ["127.0.0.1", "localhost", "[::1]"] if loopback else None  # DNS rebinding, token or not
    app = create_app(args.runs_dir, token=token, allowed_hosts=allowed)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    print(f"shardwise ui: serving {app.state.runs_dir} at {url}", flush=True)
    if not loopback:
        print(f"shardwise ui: listening on {host} (not only this machine): every request needs the token "
              f"(?token=... or header X-Shardwise-Token)", flush=True)
    elif token:
        print("shardwise ui: open the URL above; every request needs its token (?token=..., then a cookie, or "
              "header X-Shardwise-Token); --no-token serves without one", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])
    return 0
