"""How much of a rows-first H2O decode step is Python (and torch's small operators) rather than h2o-kv's C++
calls: py-spy (`pip install py-spy`, not a dependency) samples a process decoding SmolLM2-135M at batch 4 after an
argv[1]-token prompt (default 512: the Python per step does not depend on it), H2O at 20 %, float32, 2 threads;
a sample whose innermost frame is a torch op call (`torch.ops.h2o_kv.*`: the C++ kernels) counts as C++,
any other as Python, by the innermost function.
"""
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

n = int(sys.argv[1]) if len(sys.argv) > 1 else 512
child = f"""
import sys, torch
import h2o_kv.generation as g
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.models import load_model
model = load_model("smollm2-135m", rows_first=True)[0]
prompt, token = torch.randint(100, 30000, (4, {n})), torch.randint(100, 30000, (4, 1))
with torch.inference_mode():
    cache = new_cache(model, "h2o", policy_for("h2o", 0.2, {n}), max_len={n} + 2000)
    g.forward(model, cache, prompt)
    print("ready", flush=True)
    for i in range(2000):
        g.forward(model, cache, token, positions=torch.full((4, 1), {n} + i))
"""
spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
while proc.stdout.readline().strip() != "ready":
    pass
with tempfile.NamedTemporaryFile(suffix=".txt") as out:
    try:
        subprocess.run([spy, "record", "--pid", str(proc.pid), "--duration", "12", "--rate", "200", "--format",
                        "raw", "--output", out.name], check=True, capture_output=True)  # fmt: skip
    finally:
        proc.kill()
    lines = open(out.name).read().splitlines()
total, python = 0, collections.Counter()
for line in lines:
    stack, count = line.rsplit(" ", 1)
    frames = stack.split(";")
    if "forward (h2o_kv/generation.py" not in stack:  # other threads (tqdm's monitor), or between steps
        continue
    total += int(count)
    if "OpOverloadPacket.__call__" not in frames[-1]:
        python[re.sub(r":\d+\)", ")", frames[-1])] += int(count)
share = sum(python.values()) / total
print(f"# {total} samples in decode steps ({n}-token prompt, batch 4): {100 * share:.1f} % outside the C++ calls")
for name, count in python.most_common(12):
    print(f"{100 * count / total:5.1f} %  {name}")
