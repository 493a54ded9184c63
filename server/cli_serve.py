"""``specserve serve``: the OpenAI-compatible HTTP server on one model."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import fields

from server.cli_generate import add_model_arguments, engine_config_from_args
from server.cors import add_cors_arguments, cors_from
from server.limits import DESCRIPTIONS, RequestLimits
from server.ray_serve.cluster_env import PROXIES, prepare_cluster_env

API_KEYS_ENV = "SPECSERVE_API_KEYS"


def api_keys_from(args: argparse.Namespace) -> list[str]:
    """--api-key (repeatable) plus $SPECSERVE_API_KEYS (comma-separated)."""
    keys = list(args.api_key or [])
    keys += [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    return keys


# Flags of the Ray Serve application, which its replicas' own `specserve serve` do not take.
RAY_FLAGS = {"--replicas", "--min-replicas", "--max-replicas", "--replica-cpus",
             "--replica-gpus", "--ray-address", "--routing", "--ray-proxy", "--host",
             "--port"}  # fmt: skip


def replica_arguments(argv: list[str]) -> list[str]:
    """``argv`` (after ``serve``) without the flags of the Ray application, for each replica's
    own ``specserve serve``."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in RAY_FLAGS:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return kept


def default_replica_cpus(args: argparse.Namespace) -> float:
    """Without ``--replica-cpus``: a local cluster shares this machine's cores among its
    (most) replicas; a replica joining a cluster holds one CPU."""
    if args.ray_address:
        return 1.0
    count = args.max_replicas or args.replicas or 1
    return max(len(os.sched_getaffinity(0)) / count, 0.5)


def _cmd_serve_replicas(args: argparse.Namespace) -> int:
    """``--replicas N`` / ``--ray-address``: the Ray Serve application (server/ray_serve/)."""
    try:
        prepare_cluster_env(args.ray_proxy, args.ray_address)  # before Ray is imported
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    try:
        from server.ray_serve.app import ClusterPlan, run
    except ImportError as exc:
        raise SystemExit(
            f"--replicas needs Ray Serve: pip install 'specserve[ray]' ({exc})"
        ) from exc
    argv = sys.argv[sys.argv.index("serve") + 1 :] if "serve" in sys.argv else []
    plan = ClusterPlan(
        serve_args=replica_arguments(argv),
        replicas=args.replicas or 1,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        cpus_per_replica=args.replica_cpus or default_replica_cpus(args),
        gpus_per_replica=args.replica_gpus,
        routing=args.routing,
    )
    run(plan, args.host, args.port, args.ray_address)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.replicas is not None or args.ray_address or args.min_replicas is not None:
        return _cmd_serve_replicas(args)
    # the web stack: only for `serve` (the other commands never load it)
    import uvicorn
    from sse_starlette.sse import AppStatus

    from server.app import create_app
    from server.shutdown import Server
    from server.state import ServerSettings

    config = engine_config_from_args(args)
    limits = RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)})
    settings = ServerSettings(
        config=config,
        served_model_name=args.served_model_name,
        api_keys=api_keys_from(args),
        max_queued_requests=args.max_queued_requests,
        limits=limits,
        engine_stall_timeout_s=args.engine_stall_timeout or None,
        max_engine_restarts=args.max_engine_restarts,
        request_timeout_s=args.request_timeout or None,
        stream_interval=args.stream_interval,
        cors=cors_from(args),
        shutdown_timeout_s=args.shutdown_timeout,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,  # one line per request comes from specserve.requests instead
        ws_max_size=limits.max_body_bytes,  # a WebSocket message is a request body too
        # Uvicorn's own bound, a backstop behind ours (server/shutdown.py).
        timeout_graceful_shutdown=args.shutdown_timeout + 5,
    )
    # Streams end at our deadline with an error event, not at sse-starlette's first notice
    # (releases before the switch existed cut them at the signal).
    getattr(AppStatus, "disable_automatic_graceful_drain", lambda: None)()
    shutdown = app.state.specserve.shutdown
    Server(config, shutdown).run()
    if shutdown.fatal is not None:
        print(f"error: {shutdown.fatal}", file=sys.stderr)
        return 1
    return 0


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server")
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        action="append",
        help=f"require this bearer key (repeatable; also ${API_KEYS_ENV}, comma-separated)",
    )
    p.add_argument("--served-model-name", help="model id clients use (default: --model)")
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests accepted beyond the running batch before answering 429",
    )
    p.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=60.0,
        help="seconds an engine may report nothing while requests are in flight before it is "
        "killed and restarted, its streams ended with an error (0: never)",
    )
    p.add_argument(
        "--max-engine-restarts",
        type=_at_least_zero,
        default=3,
        help="engine restarts allowed within 10 minutes after crashes or stalls; past them the "
        "server exits with status 1, as it does when the engine fails to start",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT: seconds running requests may go on before open streams get "
        "an error event and [DONE] and the server exits",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=0.0,
        help="seconds after which a request still generating is aborted with a 408 (an error "
        "event when streaming; 0: no limit)",
    )
    p.add_argument(
        "--stream-interval",
        type=at_least_one,
        default=1,
        help="tokens a streamed choice gathers before a chunk is sent (its first token is "
        "sent at once): fewer chunks cost less CPU per token, most behind --replicas",
    )
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    add_cors_arguments(p)
    ray = p.add_argument_group("replicas on Ray Serve (pip install 'specserve[ray]')")
    ray.add_argument("--replicas", type=int, help="run N replicas behind Ray Serve's proxy, "
                     "routed by prefix and load (default: one process, no Ray)")  # fmt: skip
    ray.add_argument("--min-replicas", type=int, help="autoscale between this ...")
    ray.add_argument("--max-replicas", type=int, help="... and this many replicas")
    ray.add_argument(
        "--replica-cpus",
        type=float,
        help="CPUs each replica holds, and its engine's threads on CPUs "
        "(default: a local cluster's cores / replicas; with --ray-address: 1)",
    )
    ray.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs each replica holds")
    ray.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    ray.add_argument("--routing", choices=("prefix", "pow2"), default="prefix",
                     help="prefix: to the replica holding the prompt's prefix unless its queue "
                     "is much longer; pow2: Ray Serve's power of two choices")  # fmt: skip
    ray.add_argument("--ray-proxy", choices=PROXIES, default="ray",
                     help="the HTTP proxy of a cluster this command starts: ray (Ray Serve's "
                     "own) or haproxy (Ray Serve's high-throughput ingress: less CPU per "
                     "token; binds ports 8404, 9101 and 30000+ on every interface)")  # fmt: skip
    limits = p.add_argument_group("request limits (beyond one: a 400 naming it; body: 413)")
    for f in fields(RequestLimits):
        limits.add_argument(
            "--" + f.name.replace("_", "-"),
            type=at_least_one,
            default=f.default,
            help=f"most {DESCRIPTIONS[f.name]} (default {f.default})",
        )
    p.set_defaults(func=_cmd_serve)


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _at_least_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value
