"""The plain engine (shared by every SGLang test) and the TOKENSWIFT engine (per module)."""

from __future__ import annotations

import pytest

from sglang_harness import engine_args, spec_args


@pytest.fixture(scope="session")
def plain_engine():
    import sglang as sgl

    engine = sgl.Engine(**engine_args())
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def spec_engine():
    import sglang as sgl

    engine = sgl.Engine(**spec_args())
    yield engine
    engine.shutdown()
