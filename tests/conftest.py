import os

# One thread per test process, set before torch starts its thread pools, inherited by the
# processes tests start (sweep workers, torchrun ranks): the suite runs in two processes
# (pyproject's addopts), and two processes with two OpenMP threads each on two cores spend
# their time spinning (measured: 9 min instead of 80 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # tiny test models: threading overhead dominates


def _cache_cli_commands() -> None:
    """CliRunner.invoke converts the Typer app into a click command on every call (32 ms for
    flatcli's, ~150 calls in the suite); the command is stateless between invocations, so the
    tests build it once per app. Without the private hook (another typer) nothing changes."""
    import functools

    import typer.testing

    if hasattr(typer.testing, "_get_command"):
        typer.testing._get_command = functools.lru_cache(maxsize=None)(typer.testing._get_command)


_cache_cli_commands()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
