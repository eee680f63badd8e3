"""Kernel tests run the Triton kernels compiled on a GPU host and interpreted on a CPU.

The interpreter must be chosen before any ``@triton.jit`` function is defined, so it is set here,
before the test modules import the kernels. Its matrix products go through numpy, whose OpenBLAS
oversubscribes small machines badly (a 256x16x256 product took 20 ms instead of 0.04 ms on 2
cores): one BLAS thread.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1, user_api="blas")
    except ImportError:  # env var above covers a numpy that is not loaded yet
        pass


def pytest_configure(config):
    # The interpreter itself triggers numpy deprecation warnings on every indexed load.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:triton.*")
