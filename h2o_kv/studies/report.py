"""Writing study results, shared by the bench and the eval: CSV and JSON tables, the record of the
machine and versions a run used, the command that made it, and matplotlib set up for files.

Only the standard library and torch at import time; matplotlib is imported by `pyplot()` when a
study draws its plots (the `bench` and `eval` extras install it).
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def write_json(path: Path, data: Any) -> Path:
    """`data` as indented JSON (values JSON cannot hold, such as paths or dtypes, as strings)."""
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def cell(value: Any) -> Any:
    """A CSV cell: floats to 6 significant digits (inf spelled out), None empty, the rest as is."""
    if isinstance(value, float):
        return str(value) if math.isinf(value) or math.isnan(value) else f"{value:.6g}"
    return "" if value is None else value


def write_csv(path: Path, columns: Sequence[str], rows: Iterable[Row]) -> Path:
    """One line per row with `columns` in order; keys outside `columns` are left out."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: cell(row.get(key)) for key in columns})
    return path


def provenance() -> Row:
    """What a GPU figure's row records of where it ran (issue 51): the commit ("+dirty" for changed code), torch,
    triton and the GPU (None where absent)."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # Triton is not a dependency of the core
        triton_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return dict(commit=commit(), torch=torch.__version__, triton=triton_version, gpu=gpu)


def environment() -> Row:
    """Where the numbers come from: timings only compare on the same machine, versions and threads."""
    import torch
    import transformers

    from h2o_kv.cache.attend import native_products
    from h2o_kv.runtime.malloc import malloc_state

    return dict(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        machine=platform.machine(),
        processor=platform.processor() or None,
        cpu_model=_cpu_model(),  # the VMs this runs on differ: AVX2-only, or AVX-512 with bfloat16 products
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        bfloat16_products=native_products(torch.bfloat16),
        cpus=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        load_avg=os.getloadavg() if hasattr(os, "getloadavg") else None,  # a busy machine gives noisy timings
        malloc=malloc_state(),  # "retained": glibc keeps freed memory (malloc.py), prompts fault far less
        cuda=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        commit=commit(),
    )


def commit() -> str:
    """The checkout's short commit, "+dirty" when the tree has changes outside `results/` (what a study writes while
    others run is data, not the code a figure ran); "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        status = ["git", "status", "--porcelain", "--", ".", ":(exclude)results"]
        dirty = subprocess.run(status, capture_output=True, text=True, check=True).stdout
        return out.stdout.strip() + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):  # not a checkout (an installed wheel), or no git
        return "unknown"


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:  # not Linux: platform.processor() above says what it can
        return None


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command being run, for the results' provenance (`python -m module` spelled out as such)."""
    argv = list(sys.argv if argv is None else argv)
    prog = Path(argv[0]) if argv else Path("python")
    if prog.suffix == ".py":  # python -m h2o_kv.x: argv[0] is the module's file
        parts = prog.with_suffix("").parts
        module = ".".join(parts[parts.index("h2o_kv") :]) if "h2o_kv" in parts else prog.stem
        name = f"python -m {module.removesuffix('.__main__')}"
    else:
        name = prog.name
    return " ".join([name, *(_in_checkout(arg) for arg in argv[1:])])


def _in_checkout(arg: str) -> str:
    """An absolute path inside a git checkout, shown from the checkout's root (`--out /work/x/results/t` ->
    `results/t`), so a recorded command reads the same whichever clone or worktree ran it; anything else as given."""
    if not arg.startswith("/"):
        return arg
    path = Path(arg)
    for folder in path.parents:
        if (folder / ".git").exists():  # a directory in a clone, a file in a worktree
            return str(path.relative_to(folder))
    return arg


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("plots need matplotlib: pip install 'h2o-kv[bench]' or 'h2o-kv[eval]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, *, dpi: int = 110) -> Path:
    """Write a figure to `path` and release it."""
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    return path


def study_parser(subparsers: Any, name: str, help: str, description: str, add_arguments, main, epilog=None,
                 show_defaults: bool = False):  # fmt: skip
    """Register a study's subcommand (`name`, its flags from `add_arguments`, `main` run as args.func;
    `show_defaults`: --help gives each flag's default)."""
    import argparse

    class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    formatter = Help if show_defaults else argparse.RawDescriptionHelpFormatter
    parser = subparsers.add_parser(name, help=help, description=description, epilog=epilog,
                                   formatter_class=formatter)  # fmt: skip
    add_arguments(parser)
    parser.set_defaults(func=main)
    return parser


def run_study(prog: str, name: str, description: str, add_arguments, main, argv=None, epilog=None) -> int:
    """`python -m` for a study: parse its flags and run `main`, a bad input as one line and exit code 2."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return main(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"h2o-kv {name}: error: {err}", file=sys.stderr)
        return 2


def extra_installed(command: str, extra: str, modules: Sequence[str]) -> bool:
    """Whether a study's optional packages are installed; prints the one line that says what to install if not."""
    missing = missing_extra(command, extra, modules)
    if missing:
        print(missing, file=sys.stderr)
    return missing is None


def missing_extra(command: str, extra: str, modules: Sequence[str]) -> str | None:
    """The one line to print when a study's optional packages are not installed, else None."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            return f"h2o-kv {command} needs the {extra} extra ({module} is missing): pip install 'h2o-kv[{extra}]'"
    return None
