"""Markdown tables of the GPU study's rows (`h2o_kv.studies.bench.gpu`): decode against compiled StaticCache and the
bandwidth floor, prefill against SDPA, the attention kernels on their own, and the captured step's check."""

from __future__ import annotations


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(rows: list[dict]) -> str:
    machine = next((r for r in rows if r.get("cell") == "machine"), {})
    rate = machine.get("copy_bytes_s")
    lines = []
    if machine:
        lines += [f"{machine['gpu']}, torch {machine['torch']}, copy rate {rate / 1e12:.2f} TB/s (read + write)", ""]
    shapes = list(dict.fromkeys(r["shape"] for r in rows if "shape" in r))
    for shape in shapes:
        mine = {r["cell"]: r for r in rows if r.get("shape") == shape}
        any_row = next(iter(mine.values()))
        lines += [f"### {shape}: {any_row['context']} tokens x batch {any_row['batch']}", ""]
        base = mine.get("static-compiled", {}).get("tok_s")
        lines += ["| decode | batch | step ms | tokens/s | vs compiled StaticCache | KV MB | floor ms | step / floor |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for name, r in mine.items():
            if "tok_s" not in r and not (name.startswith(("static", "dynamic", "h2o", "snapkv")) and "error" in r):
                continue
            if "error" in r:
                lines.append(f"| {name} | | error: {r['error'][:120]} | | | | | |")
                continue
            batch = r.get("run_batch", r["batch"])
            floor = None
            if rate and "weight_bytes" in r:
                floor = 1000 * (r["weight_bytes"] + r["kv_bytes"]) / rate
            lines.append(
                f"| {name} | {batch} | {r['step_ms']:.2f} | {r['tok_s']:.0f} | "
                f"{_f(r['tok_s'] / base if base else None, '.2f')} | {r['kv_bytes'] / 1e6:.0f} | {_f(floor, '.2f')} | "
                f"{_f(r['step_ms'] / floor if floor else None, '.2f')} |"
            )
        pre = mine.get("prefill", {})
        if "sdpa" in pre:
            lines += ["", "| prefill, batch 1 | seconds | vs SDPA |", "| --- | --- | --- |"]
            for name in ("sdpa", "h2o", "snapkv", "h2o-chunked"):
                lines.append(f"| {name} | {pre[name]:.3f} | {pre[name] / pre['sdpa']:.2f} |")
        chunked = mine.get("prefill-chunked", {})
        if "h2o_s" in chunked:
            full, h2o = chunked["full_s"], chunked["h2o_s"]
            lines += ["", f"One prompt in the engine's {chunked['chunk']}-token calls: Full() {full:.3f} s, H2O "
                      f"{h2o:.3f} s ({h2o / full:.2f}x); H2O's {chunked['h2o_device_ms']:.0f} ms of device time, its "
                      "top kernels:", "", "| kernel | calls | ms |", "| --- | --- | --- |"]  # fmt: skip
            lines += [f"| `{k['name']}` | {k['calls']} | {k['ms']:.1f} |" for k in chunked["h2o_kernels"]]
        ops = mine.get("attention-ops", {})
        if "sdpa_ms" in ops:
            lines += ["", f"One layer's prompt attention: SDPA {ops['sdpa_ms']:.2f} ms, flash + H2O scores "
                      f"{ops['sdpa+scores_ms']:.2f} ms ({ops['sdpa+scores_ms'] / ops['sdpa_ms']:.2f}x); decode kernel "
                      f"over 20 % of the slots {ops['decode_kernel_ms']:.3f} ms ({ops['decode_kernel_gb_s']:.0f} GB/s "
                      "of keys and values)."]  # fmt: skip
        check = mine.get("check-captured", {})
        if check:
            lines += ["", f"Captured step against eager steps: {check}"]
        gen = mine.get("generate-compiled", {})
        if "same_tokens" in gen:
            lines += ["", f"`model.generate` with a KVCache, compiled against eager: {gen}"]
        prof = mine.get("profile-step", {})
        if "kernels" in prof:
            ms = prof["device_us_per_step"] / 1000
            count = prof["kernels_per_step"]
            lines += ["", f"An eager H2O step: {count:.0f} kernels, {ms:.2f} ms of device time. Its top kernels:", "",
                      "| kernel | calls / step | us / step |", "| --- | --- | --- |"]  # fmt: skip
            for k in prof["kernels"]:
                lines.append(f"| `{k['name']}` | {k['calls_per_step']:.0f} | {k['us_per_step']:.0f} |")
        errors = [f"{name}: {r['error']}" for name, r in mine.items() if "error" in r]
        lines += ["", *(f"- error in {e}" for e in errors), ""]
    return "\n".join(lines)
