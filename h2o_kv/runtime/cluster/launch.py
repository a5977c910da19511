"""Start the cluster server: a Ray (local on 127.0.0.1, or `--ray-address`), Serve's HTTP proxy on --host/--port,
and the gateway over `replicas` engine replicas (gateway.build). `running_cluster` does the same for tests and
the serving study, on an ephemeral loopback port, and takes everything down on exit."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from h2o_kv.runtime.serve.launch import free_port

APP = "h2o-kv"


def start(
    model: str, *, replicas: int, engine: dict, served_name: str, limits, api_keys: list[str], device: str = "cpu",
    host: str = "127.0.0.1", port: int = 8000, ray_address: str | None = None,
) -> None:  # fmt: skip
    """Deploy the gateway and replicas (Ray started here unless `ray_address` names a running cluster)."""
    import ray
    from ray import serve

    from h2o_kv.runtime.cluster.gateway import build

    if ray_address and ray_address != "local":
        ray.init(address=ray_address, log_to_driver=False)
    else:  # a private Ray on this machine, reachable on loopback only
        # Serve kills an HTTP proxy not ready within 5 s, and serve.start then fails; a proxy starting on a busy
        # machine takes longer, so the Ray started here allows a minute (its processes inherit this variable)
        os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    app = build(model, device=device, engine=engine, served_name=served_name, limits=limits, replicas=replicas,
                api_keys=api_keys)  # fmt: skip
    serve.run(app, name=APP, route_prefix="/")


def stop() -> None:
    """Delete the app and shut Serve and this process's Ray connection down."""
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def serve_forever(**settings) -> None:
    """`h2o-kv serve --replicas N`: start, then wait for Ctrl-C or SIGTERM, then stop."""
    import signal

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    start(**settings)
    print(f"h2o-kv serve: {settings['replicas']} replica(s) ready at http://{settings['host']}:{settings['port']}",
          file=sys.stderr, flush=True)  # fmt: skip
    try:
        while not stopping:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        stop()


@contextmanager
def running_cluster(model: str, *, replicas: int, engine: dict, limits, api_keys=(), served_name: str = "tiny",
                    ) -> Iterator[str]:  # fmt: skip
    """A cluster server on an ephemeral 127.0.0.1 port: yields its base URL; stopped on exit."""
    port = free_port()
    start(model, replicas=replicas, engine=engine, served_name=served_name, limits=limits, api_keys=list(api_keys),
          port=port)  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop()
