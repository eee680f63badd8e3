"""The plain engine (shared by every SGLang test) and the TOKENSWIFT engine (per module).

They stop with :func:`sglang_harness.stop`, not ``shutdown()``, which would also kill the other
engines' processes and a session Ray cluster's.
"""

from __future__ import annotations

import pytest

from sglang_harness import engine_args, spec_args, stop


@pytest.fixture(scope="session")
def plain_engine():
    import sglang as sgl

    engine = sgl.Engine(**engine_args())
    yield engine
    stop(engine)


@pytest.fixture(scope="module")
def spec_engine():
    import sglang as sgl

    engine = sgl.Engine(**spec_args())
    yield engine
    stop(engine)
