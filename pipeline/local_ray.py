"""Starting Ray: a local instance the project starts listens on 127.0.0.1 only.

Ray resolves "127.0.0.1" as a node address to the machine's network address
(ray._private.services.resolve_ip_for_localhost), so `_node_ip_address` cannot ask for loopback.
What does: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ("no cluster"), under which Ray's node address is
the loopback address and its GCS, raylet, object manager and workers bind to it. It is read when
ray is imported, so set_loopback() sets it in the environment (for every process Ray starts) and
in the already imported constant (for this one).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

NO_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def set_loopback() -> None:
    os.environ[NO_CLUSTER_ENV] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def starts_local(address: str | None) -> bool:
    """Whether ray.init(address) would start a new local instance rather than join a cluster
    (RAY_ADDRESS, or one started on this machine with `ray start`)."""
    if address == "local":
        return True
    from ray._private.services import canonicalize_bootstrap_address

    return canonicalize_bootstrap_address(address) is None


def init_ray(address: str | None = None, **kwargs) -> None:
    """ray.init(address, **kwargs), on loopback when that starts a local instance."""
    import ray

    local = starts_local(address)
    if local:
        set_loopback()
        kwargs.setdefault("dashboard_host", "127.0.0.1")
        ray.init(address="local", **kwargs)
    else:
        ray.init(address=address, **kwargs)
    log.info("ray: %s (GCS %s)", "local, loopback" if local else address,
             ray.get_runtime_context().gcs_address)
