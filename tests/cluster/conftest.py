from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="session")
def _ray_session():
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local(_ray_session):
    """A small local Ray (4 logical CPUs; the machine has fewer cores), shared by the test modules
    that use it and stopped at the end of the session."""
    from weir.cluster.ray_cluster import driver_env

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=driver_env())
    return ray
