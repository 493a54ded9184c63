"""specserve as a Ray Serve application: N replicas (each the whole ``specserve serve``, see
``replica.py``) behind an ingress, routed by prefix and load (``router.py``).

Two ways in: ``specserve serve --replicas N`` starts a local Ray cluster (or joins one with
``--ray-address``) and runs the application on ``--host``/``--port``; or the Ray way,
``serve run server.ray_serve.app:build replicas=2 serve_args="--decoder ngram"`` (or a Serve
config file naming ``import_path: server.ray_serve.app:build``).
"""

from __future__ import annotations

import shlex
import signal
import sys
from dataclasses import dataclass, field

from server.ray_serve.replica import REPLICA_START_FAILED
from server.ray_serve.router import DEFAULT_IMBALANCE


@dataclass
class ClusterPlan:
    """What to deploy: replicas (a fixed count, or an autoscaling range), each one's
    resources, the arguments of each replica's ``specserve serve``, and the router's rule."""

    serve_args: list[str] = field(default_factory=list)
    replicas: int = 1
    min_replicas: int | None = None  # with max_replicas: autoscale on ongoing requests
    max_replicas: int | None = None
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    routing: str = "prefix"  # or "pow2": Ray Serve's default power of two choices
    imbalance: int = DEFAULT_IMBALANCE
    max_ongoing_requests: int = 256  # per replica; its server queues (and 429s) beyond

    def replica_serve_args(self) -> list[str]:
        """Each replica's ``specserve serve`` arguments. On CPUs its engine runs as many
        threads as the replica holds CPUs (at least one), unless ``--threads`` says otherwise:
        engines that each take every core fight over them (measured, 2 replicas on 2 cores:
        300 output tok/s with each engine choosing, 414-420 with one thread each)."""
        args = list(self.serve_args)
        threads_given = any(a.split("=", 1)[0] == "--threads" for a in args)
        if not threads_given and not self.gpus_per_replica:
            args += ["--threads", str(max(1, int(self.cpus_per_replica)))]
        return args

    def check(self) -> None:
        """Refuse a plan that cannot run, before anything starts."""
        if self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {self.replicas}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("--min-replicas and --max-replicas go together")
        if self.min_replicas is not None and not 0 < self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 0 < --min-replicas <= --max-replicas, got "
                f"{self.min_replicas} and {self.max_replicas}"
            )
        if self.routing not in ("prefix", "pow2"):
            raise ValueError(f"--routing: prefix or pow2, not {self.routing!r}")
        if self.cpus_per_replica <= 0 or self.gpus_per_replica < 0:
            raise ValueError("a replica needs some CPU and a non-negative GPU count")

    def check_fits(self, cluster: dict[str, float]) -> None:
        """Refuse a plan the cluster's resources (``ray.cluster_resources()``) cannot hold."""
        count = self.max_replicas or self.replicas
        for name, each in (("CPU", self.cpus_per_replica), ("GPU", self.gpus_per_replica)):
            if each and cluster.get(name, 0.0) < count * each:
                raise ValueError(
                    f"{count} replicas of {each:g} {name} each need {count * each:g} {name}; "
                    f"the cluster has {cluster.get(name, 0.0):g}"
                )


def application(plan: ClusterPlan):
    """The bound Ray Serve application of ``plan``."""
    # Ray (an optional extra) and the modules that import it load only when a cluster is used.
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from server.ray_serve.ingress import Ingress
    from server.ray_serve.replica import SpecserveReplica

    scaling = (
        {
            "autoscaling_config": {
                "min_replicas": plan.min_replicas,
                "max_replicas": plan.max_replicas,
            }
        }  # fmt: skip
        if plan.min_replicas is not None
        else {"num_replicas": plan.replicas}
    )
    routing = {}
    if plan.routing == "prefix":
        routing["request_router_config"] = RequestRouterConfig(
            request_router_class="server.ray_serve.router.PrefixAffinityRouter",
            request_router_kwargs={"imbalance": plan.imbalance},
            request_routing_stats_period_s=1.0,
            request_routing_stats_timeout_s=5.0,
        )
    replica = serve.deployment(
        SpecserveReplica,
        name="specserve-replica",
        ray_actor_options={"num_cpus": plan.cpus_per_replica, "num_gpus": plan.gpus_per_replica},
        max_ongoing_requests=plan.max_ongoing_requests,
        health_check_period_s=5,
        health_check_timeout_s=30,
        **routing,
        **scaling,
    )
    # The ingress holds every request for its whole stream; Ray Serve's default of 5 at a time
    # would queue the rest in the proxy (measured: TTFT 5-9 s at 40 streams).
    ingress_limit = plan.max_ongoing_requests * (plan.max_replicas or plan.replicas)
    ingress = serve.deployment(Ingress, name="specserve-ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=ingress_limit)  # fmt: skip
    return ingress.bind(replica.bind(plan.replica_serve_args()))


def build(args: dict):
    """``serve run server.ray_serve.app:build replicas=2 serve_args="..."`` (Ray's builder)."""
    plan = ClusterPlan(
        serve_args=shlex.split(args.get("serve_args", "")),
        replicas=int(args.get("replicas", 1)),
        min_replicas=int(args["min_replicas"]) if "min_replicas" in args else None,
        max_replicas=int(args["max_replicas"]) if "max_replicas" in args else None,
        cpus_per_replica=float(args.get("cpus_per_replica", 1)),
        gpus_per_replica=float(args.get("gpus_per_replica", 0)),
        imbalance=int(args.get("imbalance", DEFAULT_IMBALANCE)),
        routing=args.get("routing", "prefix"),
    )
    plan.check()
    return application(plan)


def replica_start_failure(messages: list[str]) -> str | None:
    """Why a replica's server failed to start, from Ray's deployment status messages (they
    carry the replica constructor's traceback), or None if none of them says."""
    for message in messages:
        for line in reversed(message.splitlines()):
            if REPLICA_START_FAILED in line:
                return line[line.index(REPLICA_START_FAILED) :].strip()
    return None


def _deployment_messages(status) -> list[str]:
    return [
        deployment.message or ""
        for app in status.applications.values()
        for deployment in app.deployments.values()
    ] + [app.message or "" for app in status.applications.values()]


def run(plan: ClusterPlan, host: str, port: int, ray_address: str | None) -> None:
    """Start (or join) a Ray cluster, deploy ``plan`` on ``host:port``, serve until stopped."""
    # Ray: an optional extra, loaded only when a cluster is used.
    import ray
    from ray import serve

    plan.check()
    started = not ray.is_initialized()
    if started:
        ray.init(address=ray_address, namespace="specserve", log_to_driver=False)
    try:
        plan.check_fits(ray.cluster_resources())
    except ValueError:
        if started:
            ray.shutdown()
        raise
    # SIGTERM ends the application as Ctrl-C does: replicas (and their servers) stop, and a
    # cluster this command started goes down with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(application(plan), name="specserve", route_prefix="/", blocking=True)
        except RuntimeError as exc:  # Ray says only "failed to update the deployments"
            reason = replica_start_failure(_deployment_messages(serve.status()))
            if reason is None:
                raise
            raise ValueError(f"the replicas failed to start: {reason}") from exc
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()
