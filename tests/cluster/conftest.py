"""One local Ray cluster (with the dashboard, for the Jobs API) shared by the Ray tests.

Drivers under test run either in this process (``run_job``) or as real ``sgl-longgen batch run``
subprocesses joined to this cluster through ``RAY_ADDRESS``, so they can be killed with a signal.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from batch_helpers import Cluster
from sgl_longgen.cluster.engine_common import NAMESPACE

# Ray reads this when it is imported: a busy 2-core machine can need more than the default 60 s.
os.environ.setdefault("RAY_DASHBOARD_STARTUP_TIMEOUT_S", "300")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # Ray jobs run their entrypoint through a shell: it must find this environment's sgl-longgen.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        ctx = ray.init(num_cpus=4, include_dashboard=True, dashboard_port=_free_port(), namespace=NAMESPACE,
                       log_to_driver=False)
        dashboard, why = f"http://{ctx.dashboard_url}", None
    except Exception as exc:  # the Jobs API tests skip, saying why; the others still run
        ray.shutdown()
        why = f"the Ray dashboard did not start: {str(exc).strip().splitlines()[0]}"
        ctx = ray.init(num_cpus=4, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
        dashboard = None
    yield Cluster(gcs=ctx.address_info["gcs_address"], dashboard=dashboard, no_dashboard=why)
    ray.shutdown()


@pytest.fixture
def jobs_api(ray_cluster):
    """The cluster, for tests that need its dashboard (the Ray Jobs API)."""
    if ray_cluster.dashboard is None:
        pytest.skip(ray_cluster.no_dashboard)
    return ray_cluster
