"""Serving benchmark: a loopback load generator against `h2o-kv serve` (or any OpenAI-compatible server).

    python -m h2o_kv.studies.loadgen --kv-memory 256MiB --requests 32 --prompt-tokens 2048 --max-tokens 128 \\
        --configs h2o:0.2,full --out results/serve

It starts one `h2o-kv serve` process at a fixed --kv-memory on an ephemeral 127.0.0.1 port (or uses
--url), then for each config sends the same N greedy streaming requests (real-text prompts of
exactly --prompt-tokens tokens), at most --concurrency at a time, with the config's `kv_policy` /
`kv_budget` body fields. Per config: requests/s, generated tokens/s, time-to-first-token and
latency percentiles, and the peak concurrent sequences and KV bytes read from /metrics. Writes
serve.json, serve.csv and serve.png into --out. Every run is bounded by --timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from h2o_kv import policies
from h2o_kv.cache.formats import KV_DTYPES
from h2o_kv.runtime.ports import free_port
from h2o_kv.runtime.serve.launch import launch_server, served_model
from h2o_kv.studies.report import command_line, environment

DEFAULT_CONFIGS = "h2o:0.2,full"


@dataclass
class Outcome:
    start: float
    end: float
    first: float | None = None
    tokens: int = 0  # from the usage chunk; else the chunks that carried text (a server without usage)
    chunks: int = 0
    error: str | None = None


def parse_configs(text: str) -> list[dict]:
    """'h2o:0.2,full,tova:64' -> request body fields per config (validated as the server would).

    "default" sends no kv fields: the server's own defaults (the only config for another server).
    """
    configs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item == "default":
            configs.append({"name": item, "fields": {}})
            continue
        name, _, budget_text = item.partition(":")
        budget = policies.parse_budget(budget_text) if budget_text else None
        policies.build(name, budget)
        fields = {"kv_policy": name, "ignore_eos": True} | ({} if budget is None else {"kv_budget": budget_text})
        configs.append({"name": item, "fields": fields})
    if not configs:
        raise ValueError("--configs is empty: give e.g. h2o:0.2,full")
    return configs


def make_prompts(token_ids: list[int], n: int, length: int) -> list[list[int]]:
    """n prompts of exactly `length` tokens: consecutive windows of the text (wrapping if it is short)."""
    if not token_ids:
        raise ValueError("the prompt text has no tokens")
    need = n * length
    flat = (token_ids * (need // len(token_ids) + 1))[:need]
    return [flat[i * length : (i + 1) * length] for i in range(n)]


async def _one(client: httpx.AsyncClient, url: str, body: dict, gate: asyncio.Semaphore) -> Outcome:
    async with gate:
        outcome = Outcome(start=time.perf_counter(), end=0.0)
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                async for line in response.aiter_lines():
                    if outcome.error or not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        outcome.error = chunk["error"].get("message", "error")
                    if chunk.get("choices") and _text(chunk):
                        outcome.chunks += 1
                        outcome.first = outcome.first or time.perf_counter()
                    if chunk.get("usage"):
                        outcome.tokens = chunk["usage"]["completion_tokens"]
        except httpx.HTTPError as err:  # counted as a failed request, reported in the results
            outcome.error = f"{type(err).__name__}: {err}"
        outcome.end = time.perf_counter()
        outcome.tokens = outcome.tokens or outcome.chunks
        return outcome


def _text(chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def watch_metrics(client: httpx.AsyncClient, url: str, peaks: dict, stop: asyncio.Event,
                        extra: dict[str, str] | None = None) -> None:  # fmt: skip
    """Peaks of the server's gauges (and of `extra`: metric name -> key), sampled every 50 ms and once more after
    `stop` (left empty for a server without /metrics). The server's own high-water marks catch what falls between
    samples."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {"h2o_kv_requests_running": "peak_running", "h2o_kv_requests_running_peak": "peak_running",
             "h2o_kv_requests_waiting": "peak_waiting", "h2o_kv_kv_bytes_in_use": "peak_kv_bytes",
             "h2o_kv_kv_bytes_peak": "peak_kv_bytes", "h2o_kv_kv_bytes_allowed": "kv_bytes_allowed",
             **(extra or {})}  # fmt: skip
    while True:
        response = await client.get(f"{url}/metrics")
        if response.status_code != 200:
            return
        running = kv_bytes = 0.0  # a cluster's gateway reports each replica: summed per scrape
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if sample.name in names:
                    key = names[sample.name]
                    peaks[key] = max(peaks.get(key, 0), sample.value)
                elif sample.name.startswith("h2o_kv_replica_"):
                    replica = peaks.setdefault("replicas", {}).setdefault(sample.labels["replica"], {})
                    key = sample.name.removeprefix("h2o_kv_replica_")
                    replica[key] = max(replica.get(key, 0), sample.value)
                    running += sample.value if key == "requests_running" else 0
                    kv_bytes += sample.value if key == "kv_bytes_in_use" else 0
        if "replicas" in peaks:
            peaks["peak_running"] = max(peaks.get("peak_running", 0), running)
            peaks["peak_kv_bytes"] = max(peaks.get("peak_kv_bytes", 0), kv_bytes)
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.05)
        except asyncio.TimeoutError:
            pass  # the sampling interval passed; sample again


async def run_config(url: str, model: str, prompts: list[list[int]] | list[str], *, fields: dict, max_tokens: int,
                     concurrency: int, timeout: float) -> tuple[list[Outcome], float, dict]:  # fmt: skip
    """Send every prompt once (greedy, streamed) with `fields`; (outcomes, wall seconds, metric peaks)."""
    base = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **fields}  # fmt: skip
    gate, stop, peaks = asyncio.Semaphore(concurrency), asyncio.Event(), {}
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        response = await client.post(f"{url}/reset_peaks")  # 404 / 405: a server without peak gauges
        if response.status_code not in (204, 404, 405):
            response.raise_for_status()
        watcher = asyncio.create_task(watch_metrics(client, url, peaks, stop))
        start = time.perf_counter()
        tasks = [asyncio.create_task(_one(client, url, base | {"prompt": ids}, gate)) for ids in prompts]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        wall = time.perf_counter() - start
        stop.set()
        await watcher
    outcomes = [t.result() for t in tasks if t in done]
    outcomes += [Outcome(start=start, end=start + wall, error=f"not finished within {timeout} s")] * len(pending)
    return outcomes, wall, peaks


def summarize(name: str, outcomes: list[Outcome], wall: float, peaks: dict, prompt_tokens: int) -> dict:
    ok = [o for o in outcomes if o.error is None]
    ttft = [o.first - o.start for o in ok if o.first is not None]
    latency = [o.end - o.start for o in ok]
    tpot = [(o.end - o.first) / (o.tokens - 1) for o in ok if o.first is not None and o.tokens > 1]
    generated = sum(o.tokens for o in ok)
    row = dict(config=name, requests=len(outcomes), errors=len(outcomes) - len(ok), prompt_tokens=prompt_tokens,
               generated_tokens=generated, wall_s=wall, requests_per_s=len(ok) / wall,
               generated_tokens_per_s=generated / wall)  # fmt: skip
    for key, values in (("ttft_s", ttft), ("latency_s", latency), ("tpot_s", tpot)):
        for q in (50, 90, 99):
            row[f"{key}_p{q}"] = float(np.percentile(values, q)) if values else None
    row |= {key: peaks.get(key) for key in ("peak_running", "peak_waiting", "peak_kv_bytes", "kv_bytes_allowed")}
    if "replicas" in peaks:  # a cluster: each replica's own high-water mark against its own limit
        replicas = peaks["replicas"]
        row["replicas"] = len(replicas)
        row["replica_kv_peak_over_allowed"] = max(r["kv_bytes_peak"] / r["kv_bytes_allowed"] for r in replicas.values())
        row["per_replica"] = replicas
    row["first_error"] = next((o.error for o in outcomes if o.error), None)
    return row


def run_benchmark(url: str, prompts: list[list[int]] | list[str], configs: list[dict], *, max_tokens: int,
                  concurrency: int, timeout: float, model: str | None = None, prompt_tokens: int | None = None,
                  progress=print) -> list[dict]:  # fmt: skip
    """Every config in turn on the same server and prompts; one summary row per config."""
    model = model or served_model(url)
    rows = []
    for config in configs:
        outcomes, wall, peaks = asyncio.run(
            run_config(
                url,
                model,
                prompts,
                fields=config["fields"],
                max_tokens=max_tokens,
                concurrency=concurrency,
                timeout=timeout,
            )  # fmt: skip
        )
        rows.append(summarize(config["name"], outcomes, wall, peaks, prompt_tokens or len(prompts[0])))
        progress(_line(rows[-1]))
    return rows


def _line(row: dict) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    return (f"{row['config']:>12}: {row['requests'] - row['errors']}/{row['requests']} ok, "
            f"{row['requests_per_s']:.3f} req/s, {row['generated_tokens_per_s']:.1f} gen tok/s, "
            f"TTFT p50 {fmt(row['ttft_s_p50'], '.2f')} s, latency p50 {fmt(row['latency_s_p50'], '.2f')} s, "
            f"peak running {fmt(row['peak_running'], '.0f')}")  # fmt: skip


def ratios(rows: list[dict], reference: str = "full") -> dict[str, dict[str, float]]:
    """Each config against the reference config (peak sequences and generated tokens/s)."""
    ref = next((r for r in rows if r["config"] == reference), None)
    out = {}
    for row in rows:
        if ref is None or row is ref:
            continue
        out[row["config"]] = {
            key: row[key] / ref[key] if row[key] and ref[key] else None
            for key in ("peak_running", "generated_tokens_per_s", "requests_per_s")
        }
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="an already running server (default: start h2o-kv serve)")
    parser.add_argument("--model", default="smollm2-135m", help="model to serve, and whose tokenizer makes prompts")
    parser.add_argument("--kv-memory", default="256MiB", help="the server's --kv-memory (default 256MiB)")
    parser.add_argument("--max-batch", type=int, default=64, help="the server's --max-batch (default 64)")
    parser.add_argument("--prefill-chunk", type=int, default=256, help="the server's --prefill-chunk")
    parser.add_argument("--kv-dtype", default=None, choices=list(KV_DTYPES), help="the server's --kv-dtype")
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="start `h2o-kv serve --replicas N` on a local Ray instead (the cluster extra)",
    )
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="policy[:budget] list (default h2o:0.2,full)")
    parser.add_argument("--requests", type=int, default=32, help="requests per config (default 32)")
    parser.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default: all)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--text", default=None, help="prompt text source (default: the offline corpus)")
    parser.add_argument(
        "--text-prompts", action="store_true", help="send prompts as text, not token ids (servers that need strings)"
    )
    parser.add_argument("--served-model", default=None, help="model id to send (default: the server's first)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per config (default 3600)")
    parser.add_argument("--out", default="results/serve", help="output directory (default results/serve)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m h2o_kv.studies.loadgen", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return _run(args, command_line(None if argv is None else ["loadgen.py", *argv]))
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"loadgen: error: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, command: str) -> int:

    from h2o_kv.runtime.models import load_tokenizer
    from h2o_kv.studies.data import load_corpus
    from h2o_kv.studies.serve_results import write_results

    configs = parse_configs(args.configs)
    if args.url and (args.kv_dtype or args.replicas is not None):
        raise ValueError("--kv-dtype and --replicas set the server loadgen starts; a server given with --url keeps "
                         "its own")  # fmt: skip
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    for flag, value in (("--requests", args.requests), ("--prompt-tokens", args.prompt_tokens),
                        ("--max-tokens", args.max_tokens), ("--concurrency", args.concurrency or 1)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    tokenizer = load_tokenizer(args.model)
    chars = args.requests * args.prompt_tokens * 8
    ids = tokenizer(load_corpus(args.text, max_chars=chars), add_special_tokens=False)["input_ids"]
    prompts = make_prompts(ids, args.requests, args.prompt_tokens)
    if args.text_prompts:
        prompts = [tokenizer.decode(p) for p in prompts]
    settings = dict(kv_memory=args.kv_memory, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                    kv_dtype=args.kv_dtype)  # fmt: skip
    run = dict(max_tokens=args.max_tokens, concurrency=args.concurrency or args.requests, timeout=args.timeout,
               model=args.served_model)  # fmt: skip
    if args.url:
        rows = run_benchmark(args.url.rstrip("/"), prompts, configs, prompt_tokens=args.prompt_tokens, **run)
    else:
        extra = () if args.replicas is None else ("--replicas", str(args.replicas), "--ray-address", "local",
                                                   "--port", str(free_port()))  # fmt: skip
        with launch_server(args.model, **settings, extra=extra) as url:
            rows = run_benchmark(url, prompts, configs, prompt_tokens=args.prompt_tokens, **run)
    server = (
        {"url": args.url} if args.url else settings | {"model": args.model, "replicas": args.replicas}
    )  # another server: its own settings
    meta = dict(command=command, environment=environment(), server=server, requests=args.requests,
                prompt_tokens=args.prompt_tokens, **run)  # fmt: skip
    paths = write_results(rows, ratios(rows), meta, args.out)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0 if all(row["errors"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
