"""A local Ray on loopback with 2 CPUs, one per test module that asks for it (usefixtures)."""
import pytest
import ray

from pipeline.local_ray import init_ray


@pytest.fixture(scope="module")
def ray_cluster():
    init_ray("local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
