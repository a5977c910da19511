"""`h2o-kv serve`: the OpenAI-compatible server on uvicorn, with its flags.

Only argparse and the policies are imported here, so `h2o-kv --help` works without the serve
extra; FastAPI and uvicorn are imported when the command runs.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import socket
import sys
from pathlib import Path

from h2o_kv import policies
from h2o_kv.cache.formats import KV_DTYPES
from h2o_kv.runtime.bundled import BUNDLED_NAME

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, flag: str = "--kv-memory", minimum: int = 1) -> int:
    """'512MiB', '2GB', '1.5GiB' or plain bytes '1000000' as a byte count (>= `minimum`); `flag` names it in errors."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"{flag} {text!r} is not a size: give bytes (1000000) or e.g. 512MiB, 2GB, 1.5GiB")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < minimum:
        raise ValueError(f"{flag} must be at least {minimum} byte{'s' if minimum != 1 else ''}, got {text!r}")
    return size


def check_port(host: str, port: int) -> None:
    """Refuse, before the model loads, a --host/--port this process cannot listen on (taken, not this machine's,
    or privileged): a bind as uvicorn's, released at once. Port 0 (any free port) is always free."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # uvicorn's choice
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
            sock.bind((host, port))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            why = "is already in use (another server?): stop it or choose another --port"
        elif err.errno == errno.EACCES:
            why = "needs privileges this process lacks (ports below 1024): choose another --port"
        else:
            why = f"cannot be listened on ({err.strerror or err}): check --host"
        raise ValueError(f"serve: {host}:{port} {why}") from None


def served_name(model: str) -> str:
    """The model id clients send: the bundled name, an HF id, or a local path's last part."""
    path = Path(model).expanduser()
    return path.stem if model.endswith(".gguf") else path.name if path.exists() else model


def _size(n: int) -> str:
    for unit, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= unit:
            return f"{n / unit:.4g} {name}"
    return f"{n} B"


def startup_line(engine, model_name: str) -> str:
    """What the server serves with, for its start-up line: the model, the default policy and budget, the KV memory."""
    budget = engine.budget
    if str(engine.policy).lower() == "full":
        kept = "keeping every token"
    elif isinstance(budget, float):
        kept = f"budget {budget:.0%} of each prompt per KV head"
    else:
        kept = f"budget {budget} tokens per sequence and KV head"
    storage = engine.kv_dtype or str(engine.model.dtype).removeprefix("torch.")
    memory = "unbounded" if engine.kv_memory is None else _size(engine.kv_memory)
    return (f"model {model_name} on {engine.model.device.type}, policy {engine.policy}, {kept}, KV memory {memory} "
            f"({storage} keys and values), up to {engine.max_batch} sequences at once"
            + ("" if not getattr(engine, "session_memory", None) else
               f", up to {_size(engine.session_memory)} of it kept from finished requests for reuse"))  # fmt: skip


PREFILL_CHUNK = {"cpu": 256, "cuda": 2048}  # --prefill-chunk's default per device


def engine_settings(args: argparse.Namespace) -> dict:
    """Engine keyword arguments from the flags, checked before the model loads."""
    budget = None if args.budget is None else policies.parse_budget(args.budget)
    if args.policy == "full":
        budget = None
    policies.build(args.policy, budget, sinks=args.sinks)  # refuse a bad pair before the model loads
    kv_memory = None if args.kv_memory is None else parse_bytes(args.kv_memory)
    session_memory = parse_bytes(args.session_memory, "--session-memory", minimum=0) or None
    prefill_chunk = PREFILL_CHUNK["cuda" if str(args.device).startswith("cuda") else "cpu"]
    prefill_chunk = prefill_chunk if args.prefill_chunk is None else args.prefill_chunk
    for flag, value in (("--max-batch", args.max_batch), ("--prefill-chunk", prefill_chunk)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.headroom < 0:
        raise ValueError(f"--headroom must be >= 0, got {args.headroom}")
    return dict(
        policy=args.policy,
        budget=budget,
        kv_memory=kv_memory,
        max_batch=args.max_batch,
        prefill_chunk=prefill_chunk,
        sinks=args.sinks,
        kv_dtype=args.kv_dtype,
        session_memory=session_memory,
        headroom=args.headroom,
    )


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys from --api-key (repeatable) and H2O_KV_API_KEY (comma-separated); an empty key is refused."""
    keys = list(args.api_key or []) + [k for k in os.environ.get("H2O_KV_API_KEY", "").split(",") if k.strip()]
    if any(not key.strip() or key != key.strip() for key in keys):
        raise ValueError("an API key must be non-empty, without spaces at its ends")
    return keys


def request_limits(args: argparse.Namespace):
    """The per-request bounds from the flags (`requests.Limits`), checked before anything loads."""
    from h2o_kv.runtime.serve.requests import Limits

    for flag, value in (
        ("--max-new-tokens", args.max_new_tokens),
        ("--max-queue", args.max_queue),
        ("--max-connections", args.max_connections),
        ("--max-prompt-tokens", args.max_prompt_tokens),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, seconds in (("--read-timeout", args.read_timeout), ("--stream-timeout", args.stream_timeout)):
        if not 0 < seconds < float("inf"):  # also refuses nan
            raise ValueError(f"{flag} must be a number of seconds > 0, got {seconds}")
    return Limits(max_body_bytes=parse_bytes(args.max_body), max_prompt_tokens=args.max_prompt_tokens,
                  max_new_tokens=args.max_new_tokens, max_queue=args.max_queue, read_timeout=args.read_timeout,
                  stream_timeout=args.stream_timeout)  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if not args.ray_address or args.ray_address == "local":  # first, before the slow imports; a remote Ray binds there
        check_port(args.host, args.port)
    if not 0 <= args.drain_timeout < float("inf"):  # also refuses nan
        raise ValueError(f"--drain-timeout must be a number of seconds >= 0, got {args.drain_timeout}")
    keys = api_keys(args)
    limits = request_limits(args)
    settings = engine_settings(args)
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1 or args.ray_address:
        return serve_cluster(args, keys, limits, settings)
    try:
        from h2o_kv.runtime.serve.app import create_app
        from h2o_kv.runtime.serve.server import Server
    except ImportError as err:
        raise ValueError(f"the server needs the serve extra: pip install 'h2o-kv[serve]' ({err})") from None
    from h2o_kv.runtime.engine import Engine
    from h2o_kv.runtime.models import load_model

    model, tokenizer = load_model(args.model, device=args.device)
    engine = Engine(model, tokenizer, **settings)
    if not keys and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"h2o-kv serve: warning: serving on {args.host} with no API key: anyone who reaches the port can use "
              "the model (--api-key or H2O_KV_API_KEY)", file=sys.stderr)  # fmt: skip
    name = args.served_model_name or served_name(args.model)
    app = create_app(engine, name, api_keys=keys, limits=limits)
    Server.for_app(app, engine, host=args.host, port=args.port, drain_timeout=args.drain_timeout,
                   log_level=args.log_level, max_connections=args.max_connections,
                   announce=startup_line(engine, name)).run()  # fmt: skip
    return 0


def serve_cluster(args: argparse.Namespace, keys: list[str], limits, settings: dict) -> int:
    """`--replicas N` / `--ray-address`: the same routes from N engine replicas on Ray Serve (runtime/cluster)."""
    try:
        from h2o_kv.runtime.cluster.launch import serve_forever
    except ImportError as err:
        raise ValueError(f"--replicas needs the cluster extra: pip install 'h2o-kv[cluster]' ({err})") from None
    serve_forever(model=args.model, replicas=args.replicas, engine=settings, limits=limits, api_keys=keys,
                  served_name=args.served_model_name or served_name(args.model), device=args.device, host=args.host,
                  port=args.port, ray_address=args.ray_address, drain_timeout=args.drain_timeout)  # fmt: skip
    return 0


def add_parser(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server (continuous batching over one bounded KV cache)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics on "
        "127.0.0.1. Requests may override the KV policy and budget with the body fields kv_policy, kv_budget.",
    )
    serve.add_argument("--model", default=BUNDLED_NAME, help=f"bundled name, HF id, local dir or .gguf file (default "
                       f"{BUNDLED_NAME})")  # fmt: skip
    serve.add_argument("--served-model-name", default=None, help="the model id clients use (default: from --model)")
    serve.add_argument("--device", default="cpu")
    serve.add_argument(
        "--policy",
        default=policies.SERVE_DEFAULT,
        choices=policies.NAMES,
        help=f"default KV policy ({policies.SERVE_DEFAULT}: KVzip's pass over the whole prompt ranking the whole "
        "cache, the question at its end kept; docs/serving.md)",
    )
    serve.add_argument(
        "--budget",
        default="512",
        help="default KV budget: tokens (64) or a prompt fraction (0.2, 20%%); default 512 tokens per sequence and "
        "KV head (short chats keep everything; a fraction of a 40-token chat would keep 8)",
    )
    serve.add_argument("--sinks", type=int, default=4, help="StreamingLLM sink tokens")
    serve.add_argument(
        "--kv-memory", default="1GiB", help="bytes the KV cache may use, e.g. 512MiB, 2GB (default 1GiB)"
    )
    serve.add_argument("--session-memory", default="0",
                       help="KV bytes (within --kv-memory) kept from finished requests, e.g. 256MiB: a prompt that "
                       "extends a kept conversation or document prefills only its new tokens; least recently used "
                       "dropped first, and whenever running requests need the room (default 0: off)")  # fmt: skip
    serve.add_argument("--headroom", type=int, default=0,
                       help="tokens each sequence and KV head holds past its budget once its prompt is through: "
                       "questions after a kept document (--session-memory) join it without evicting any of it, as "
                       "kvpress appends them (default 0)")  # fmt: skip
    serve.add_argument(
        "--kv-dtype",
        default=None,
        choices=list(KV_DTYPES),
        help="store kept keys and values as int8 with per-token scales: about 3.5x the sequences in --kv-memory",
    )
    serve.add_argument("--max-batch", type=int, default=16, help="most sequences decoding together (default 16)")
    serve.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prompt tokens per prefill step between decode steps (default 256 on a CPU, 2048 on a GPU, where a "
        "larger matrix product costs little more: results/gpu/README.md)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--max-body", default="1MiB", help="largest request body; larger: 413 (default 1MiB)")
    serve.add_argument("--max-prompt-tokens", type=int, default=None,
                       help="largest prompt in tokens; longer: 400 (default: none of its own; prompt + max_tokens past "
                            "the model's context is always refused)")  # fmt: skip
    serve.add_argument("--max-new-tokens", type=int, default=4096,
                       help="largest max_tokens a request may ask; more: 400 (default 4096)")  # fmt: skip
    serve.add_argument("--max-queue", type=int, default=256,
                       help="requests that may wait for the engine; more: 429, Retry-After (default 256)")  # fmt: skip
    serve.add_argument("--max-connections", type=int, default=512,
                       help="open connections at once; more: 503 from uvicorn (default 512)")  # fmt: skip
    serve.add_argument("--read-timeout", type=float, default=30.0,
                       help="seconds a client may take to send a request's headers, or its body; then 408 and the "
                       "connection closed (default 30)")  # fmt: skip
    serve.add_argument("--stream-timeout", type=float, default=60.0,
                       help="seconds a stream may go unread before its request is cancelled, freeing its KV memory "
                       "(default 60)")  # fmt: skip
    serve.add_argument("--api-key", action="append", metavar="KEY",
                       help="require Authorization: Bearer KEY on every route but /health (repeat for several keys; "
                       "also H2O_KV_API_KEY, comma-separated)")  # fmt: skip
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--replicas", type=int, default=1,
                       help="engine replicas on Ray Serve, each with its own --kv-memory, requests routed to the one "
                       "with the most free KV memory (the cluster extra; default 1: one process, no Ray)")  # fmt: skip
    serve.add_argument("--ray-address", default=None,
                       help="run the replicas on this Ray cluster (auto, or head-ip:6379); 'local' starts a Ray on "
                       "127.0.0.1 (what --replicas > 1 does without this flag)")  # fmt: skip
    serve.add_argument(
        "--drain-timeout", type=float, default=30.0, help="on SIGTERM, seconds in-flight requests may finish"
    )
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(func=cmd_serve)
