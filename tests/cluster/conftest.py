from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_local():
    """One small local Ray instance per test module (4 logical CPUs; the machine has fewer cores)."""
    if ray.is_initialized():
        ray.shutdown()
    from weir.cluster.ray_cluster import driver_env

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=driver_env())
    yield ray
    ray.shutdown()
