"""Start the cluster server: a Ray (a private one on 127.0.0.1, or `--ray-address`), Serve's HTTP proxy on
--host/--port, and the gateway over `replicas` engine replicas (gateway.build); drain it and stop everything it
started.

The private Ray is always a new one (`address="local"`: never a `ray start` cluster or RAY_ADDRESS) with a temp
dir of its own. Every process it starts (GCS, raylet, agents, workers, replicas) inherits `MARK` naming that
dir, so `stop` finds them all by it, even those whose parent died, and ends any `ray.shutdown()` left behind
(SIGTERM, then SIGKILL), then removes the dir. On a cluster given by `--ray-address` the server refuses to
start where Ray Serve already runs (Serve would keep its own HTTP options and this server would not listen where
it says), and stops only the Serve instance it started.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

APP = "h2o-kv"
MARK = "H2O_KV_RAY_DIR"  # in the environment of every process of a private Ray: its temp dir
END_S = 10.0  # how long `stop` waits for the private Ray's processes to end, before each escalation


@dataclass
class Cluster:
    """What `start` started, for `stop` (filled in as it goes, so a start that fails half-way is stopped)."""

    temp_dir: str | None = None  # the private Ray's own folder (None on a cluster given by --ray-address)
    address: str | None = None  # the private Ray's GCS address (for `ray status --address`, or another --ray-address)
    connected: bool = False  # ray.init returned
    serve_started: bool = False  # this start started Ray Serve (so stop shuts it down)
    deployed: bool = False  # the app was handed to Serve (so it can be drained)
    processes: list = field(default_factory=list)  # the private Ray's processes seen so far (psutil.Process)


class _NotAttaching(logging.Filter):
    """Hides Serve's "Connecting to existing Serve app" line that serve.run logs after our own serve.start: the
    Serve it connects to is the one just started (start refuses one that ran before)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Connecting to existing Serve app" not in record.getMessage()


def start(
    cluster: Cluster, model: str, *, replicas: int, engine: dict, served_name: str, limits, api_keys: list[str],
    device: str = "cpu", host: str = "127.0.0.1", port: int = 8000, ray_address: str | None = None,
) -> None:  # fmt: skip
    """Deploy the gateway and replicas (a private Ray started here unless `ray_address` names a running cluster).
    SIGTERM's handler is left as it was: Ray's driver installs one that prints a stack dump and exits at once."""
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    from h2o_kv.runtime.cluster.gateway import build

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    if ray_address and ray_address != "local":
        ray.init(address=ray_address, log_to_driver=False)
        cluster.connected = True
    else:  # a private Ray on this machine, reachable on loopback only
        # Serve kills an HTTP proxy not ready within 5 s, and serve.start then fails; a proxy starting on a busy
        # machine takes longer, so the Ray started here allows a minute (its processes inherit this variable)
        os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
        cluster.temp_dir = tempfile.mkdtemp(prefix="h2o-kv-ray-")
        os.environ[MARK] = cluster.temp_dir  # inherited by the GCS and the raylet, and by all they start
        try:
            ray.init(address="local", _node_ip_address="127.0.0.1", _temp_dir=cluster.temp_dir,
                     include_dashboard=False, log_to_driver=False)  # fmt: skip
            cluster.connected = True
            cluster.address = ray.get_runtime_context().gcs_address
        finally:
            del os.environ[MARK]
    if previous is not None:  # Ray's driver took SIGTERM over (a native dump, then exit 15): given back
        signal.signal(signal.SIGTERM, previous)
    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        pass  # no Serve on this Ray: ours starts with our HTTP options
    else:
        raise ValueError(f"serve: Ray Serve already runs on the Ray cluster at {ray_address}; its HTTP proxy would "
                         "not take --host/--port: shut it down (serve shutdown) or use another cluster")  # fmt: skip
    cluster.serve_started = True
    serve.start(http_options={"host": host, "port": port})
    app = build(model, device=device, engine=engine, served_name=served_name, limits=limits, replicas=replicas,
                api_keys=api_keys)  # fmt: skip
    cluster.deployed = True
    quiet = _NotAttaching()
    logging.getLogger("ray.serve").addFilter(quiet)
    try:
        serve.run(app, name=APP, route_prefix="/")
    finally:
        logging.getLogger("ray.serve").removeFilter(quiet)


def drain(drain_timeout: float) -> None:
    """New requests get 503 (`shutting_down`) while those in flight finish, for up to `drain_timeout` seconds;
    then the rest end (a stream with a `shutting_down` error event and `data: [DONE]`)."""
    from ray import serve

    gateway = serve.get_app_handle(APP)
    gateway.begin_drain.remote().result(timeout_s=60)
    deadline = time.monotonic() + drain_timeout
    while gateway.requests_in_flight.remote().result(timeout_s=60) and time.monotonic() < deadline:
        time.sleep(0.1)
    gateway.end_requests.remote().result(timeout_s=60)
    deadline = time.monotonic() + END_S  # the ended requests' last words reach their clients
    while gateway.requests_in_flight.remote().result(timeout_s=60) and time.monotonic() < deadline:
        time.sleep(0.05)


def stop(cluster: Cluster, *, keep_logs: bool = False) -> None:
    """Shut down the Serve this start started and disconnect from Ray; with a private Ray, end every process of
    it that outlives `ray.shutdown()` and remove its temp dir (kept with `keep_logs`: its session's logs)."""
    import ray
    from ray import serve

    try:
        if cluster.temp_dir:
            cluster.processes += _private_processes(cluster.temp_dir)  # raylet's children, before it goes
        if cluster.serve_started:
            serve.shutdown()
    finally:
        if cluster.connected:
            ray.shutdown()
        if cluster.temp_dir:
            _end_processes(cluster)
            if not keep_logs:
                shutil.rmtree(cluster.temp_dir)


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE  # a zombie is over, only not reaped
    except psutil.NoSuchProcess:
        return False


def _private_processes(temp_dir: str) -> list:
    """The live processes of the private Ray in `temp_dir`: those with `MARK` naming it, or their command line."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(MARK) == temp_dir or any(temp_dir in part for part in proc.cmdline()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # gone, or another user's
    return [proc for proc in found if _alive(proc)]


def _end_processes(cluster: Cluster) -> None:
    """Wait for the private Ray's processes to end; SIGTERM those left, then SIGKILL (the dashboard and runtime env
    agents outlive their raylet and ignore SIGTERM); raises if one is still there."""
    import psutil

    def left() -> list:  # psutil.Process knows its start time: a pid reused by another process is not signalled
        mine = {proc.pid: proc for proc in cluster.processes + _private_processes(cluster.temp_dir)}
        return [proc for proc in mine.values() if _alive(proc)]

    for send in (None, signal.SIGTERM, signal.SIGKILL):
        procs = left()
        for proc in procs if send is not None else ():
            try:
                proc.send_signal(send)
            except psutil.NoSuchProcess:
                pass
        deadline = time.monotonic() + END_S
        while procs and time.monotonic() < deadline:
            time.sleep(0.1)
            procs = [proc for proc in procs if _alive(proc)]
        if not procs:
            return
    names = ", ".join(f"{proc.pid} ({proc.name()})" for proc in procs)
    raise RuntimeError(f"the private Ray in {cluster.temp_dir} left processes that SIGKILL did not end: {names}")


def serve_forever(*, drain_timeout: float = 30.0, **settings) -> None:
    """`h2o-kv serve --replicas N`: start, then on SIGTERM or Ctrl-C drain for `drain_timeout` seconds (as the
    one-process server: new requests 503) and stop everything started. A signal during start-up, or a second one
    while draining, stops at once; stopping itself is not interrupted."""
    phase = ["starting"]
    stopping = threading.Event()

    def on_signal(signum, frame) -> None:
        if phase[0] == "serving":
            phase[0] = "draining"
            stopping.set()
        elif phase[0] != "stopping":
            raise KeyboardInterrupt  # start-up, or a second signal while draining: stop now

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cluster = Cluster()
    failed = False
    try:
        start(cluster, **settings)
        if cluster.temp_dir:
            print(f"h2o-kv serve: a private Ray at {cluster.address}, its files in {cluster.temp_dir} (removed on "
                  "stop)", file=sys.stderr, flush=True)  # fmt: skip
        print(f"h2o-kv serve: {settings['replicas']} replica(s) ready at http://{settings['host']}:{settings['port']}",
              file=sys.stderr, flush=True)  # fmt: skip
        phase[0] = "serving"
        while not stopping.wait(0.5):
            pass
        print(f"h2o-kv serve: draining: requests in flight may finish for {drain_timeout:g} s, new ones get 503",
              file=sys.stderr, flush=True)  # fmt: skip
        drain(drain_timeout)
    except KeyboardInterrupt:
        pass
    except BaseException:
        failed = True
        raise
    finally:
        phase[0] = "stopping"
        stop(cluster, keep_logs=failed)
        if failed and cluster.temp_dir:
            print(f"h2o-kv serve: the private Ray's logs are kept in {cluster.temp_dir}", file=sys.stderr)
        elif not failed:
            print("h2o-kv serve: stopped", file=sys.stderr, flush=True)
