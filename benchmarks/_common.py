"""Helpers shared by the benchmarks (run from the repository root as ``python -m
benchmarks.bench_NAME``, with flatcli installed by ``pip install -e .``).

Imports torch and torchvision only (no flatcli), so that the peer scripts the
benchmarks write and run as fresh processes can load the same model and data
from this file without paying for flatcli's imports.

* `table`, `Tables`, `write_json`, `json_arg`: every benchmark's result as one JSON file,
  ``docs/benchmarks/data/<name>.json`` by default (the schema in `write_json`), which the
  documentation renders.
* `machine`, `commit`: the machine in words and the checkout's commit, recorded in that file.
* `sync`, `timed`, `device_name`: CUDA-synchronized wall times and the device in words.
* `resnet18`: torchvision's ``resnet18(num_classes=...)`` at width 64; at another
  width the same topology (7×7 stem, max-pool, four stages of two basic blocks,
  widths w, 2w, 4w, 8w) built from torchvision's own blocks, for CPU-sized runs.
* `class_structured_data`: seeded random class templates plus noise.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "benchmarks" / "data"


def json_arg(ap, name: str) -> None:
    """Add ``--json PATH`` to an argparse parser: where the result goes (default
    ``docs/benchmarks/data/<name>.json``)."""
    ap.add_argument(
        "--json",
        type=Path,
        default=DATA / f"{name}.json",
        help=f"write the result here (default docs/benchmarks/data/{name}.json)",
    )


def table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], note: str = ""
) -> dict[str, Any]:
    """One table of a result: a title, column names and rows of cells (numbers or text)."""
    out: dict[str, Any] = {
        "title": title,
        "columns": list(columns),
        "rows": [[_cell(c) for c in r] for r in rows],
    }
    if note:
        out["note"] = note
    return out


def records_table(title: str, records: Sequence[dict[str, Any]], note: str = "") -> dict[str, Any]:
    """A table of dicts (one per row, e.g. a child process's JSON line): the columns are their keys
    in the order first seen, a missing key an empty cell."""
    cols = list(dict.fromkeys(k for r in records for k in r))
    return table(title, cols, [[r.get(k, "") for k in cols] for r in records], note)


class Tables(list):
    """The tables of one run: `add` prints a table as Markdown and keeps it for `write_json`."""

    def add(
        self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], note: str = ""
    ) -> dict[str, Any]:
        t = table(title, columns, rows, note)
        lines = [f"\n{title}", "", "| " + " | ".join(t["columns"]) + " |"]
        lines.append("|" + "---|" * len(t["columns"]))
        lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in t["rows"]]
        print("\n".join(lines + ([note] if note else [])), flush=True)
        self.append(t)
        return t


def _cell(c: Any) -> Any:
    """A JSON cell: numbers stay numbers (NaN and infinities as text), the rest as text."""
    if c is None or isinstance(c, (bool, int, str)):
        return c
    if isinstance(c, float):
        return c if math.isfinite(c) else str(c)
    return str(c)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine(dev: torch.device | None = None) -> dict[str, Any]:
    """The machine in words: CPU model, cores, memory (GiB), the GPU when ``dev`` is a CUDA
    device (or one is visible), torch's and Python's versions."""
    out: dict[str, Any] = {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "memory_gb": _memory_gb(),
    }
    cuda = dev.type == "cuda" if dev is not None else torch.cuda.is_available()
    if cuda:
        out["gpu"] = torch.cuda.get_device_name(dev)
    out["torch"] = torch.__version__
    out["python"] = platform.python_version()
    return out


def commit() -> str:
    """The checkout's commit (short hash, ``+dirty`` with uncommitted changes), "unknown" outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def write_json(
    name: str,
    title: str,
    tables: Sequence[dict[str, Any]],
    path: Path | None = None,
    *,
    dev: torch.device | None = None,
    command: str | None = None,
) -> Path:
    """Write a benchmark's result to ``path`` (default ``docs/benchmarks/data/<name>.json``)::

        {"benchmark": name, "title": title, "command": the command line,
         "machine": {"cpu", "cores", "memory_gb", "gpu" (with a GPU), "torch", "python"},
         "commit": the checkout's commit, "date": today (YYYY-MM-DD, UTC),
         "tables": [{"title", "columns", "rows", "note" (optional)}, ...]}

    ``tables`` from `table`. Returns the path written."""
    path = Path(path) if path is not None else DATA / f"{name}.json"
    data = {
        "benchmark": name,
        "title": title,
        "command": command
        if command is not None
        else " ".join(["python -m", f"benchmarks.{Path(sys.argv[0]).stem}", *sys.argv[1:]]),
        "machine": machine(dev),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "tables": list(tables),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return path


def sync(dev: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(dev: torch.device, fn: Callable[[], T]) -> tuple[T, float]:
    """``(fn(), wall seconds)``, synchronized before and after on CUDA."""
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t0


def device_name(dev: torch.device) -> str:
    """The GPU's name, or the CPU model and torch's thread count."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    name = platform.processor() or "CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {torch.get_num_threads()} threads"


class _NarrowResNet18(nn.Module):
    """ResNet-18's topology at base width ``width`` (torchvision's blocks and initialization)."""

    def __init__(self, width: int, num_classes: int):
        from torchvision.models.resnet import BasicBlock, ResNet

        super().__init__()
        # borrow torchvision's _make_layer: it reads these attributes
        self._norm_layer, self.inplanes, self.dilation, self.groups, self.base_width = (
            nn.BatchNorm2d,
            width,
            1,
            1,
            64,
        )
        make = ResNet._make_layer.__get__(self)
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = make(BasicBlock, width, 2)
        self.layer2 = make(BasicBlock, 2 * width, 2, stride=2)
        self.layer3 = make(BasicBlock, 4 * width, 2, stride=2)
        self.layer4 = make(BasicBlock, 8 * width, 2, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(width: int = 64, num_classes: int = 10) -> nn.Module:
    """``torchvision.models.resnet18(num_classes=num_classes)`` at width 64; the same
    topology with stage widths ``width, 2·width, 4·width, 8·width`` otherwise
    (the same state-dict keys)."""
    if width == 64:
        import torchvision

        return torchvision.models.resnet18(num_classes=num_classes)
    if width < 1:
        raise ValueError(f"width must be a positive int, got {width}")
    return _NarrowResNet18(width, num_classes)


def class_structured_data(
    n: int, seed: int, classes: int = 10, noise: float = 1.0, shape: tuple[int, ...] = (3, 32, 32)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` inputs ``template[y] + noise·ε`` with ``classes`` fixed standard-normal templates,
    balanced labels in a seeded random order and standard-normal ε: (x (n, *shape), y (n,))."""
    g = torch.Generator().manual_seed(int(seed))
    templates = torch.randn(classes, *shape, generator=g)
    y = torch.arange(n) % classes
    y = y[torch.randperm(n, generator=g)]
    x = templates[y] + noise * torch.randn(n, *shape, generator=g)
    return x, y
