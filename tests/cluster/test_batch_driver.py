"""The driver process without Ray: its exit status when a signal stops it, and the environment it
hands its engines.

A stopped run exits with 128 + the signal's number, as a shell reports a process that signal ended
(SIGTERM, from ``ray job stop`` or a scheduler: 143; Ctrl-C: 130). The run is replaced by one that
signals its own process; a real driver stopped by SIGTERM is in ``test_batch_ray.py``.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from batch_helpers import write_job
from sgl_longgen import env
from sgl_longgen.cli import main
from sgl_longgen.cluster import runner


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_the_run_with_128_plus_its_number(monkeypatch, tmp_path, sig, status):
    def stopped_run(job, **kwargs):
        os.kill(os.getpid(), sig)
        time.sleep(30)
        pytest.fail(f"{sig.name} did not interrupt the run")

    monkeypatch.setattr(runner, "run_job", stopped_run)
    # A shell starts a background job with SIGINT ignored, and Python then leaves it ignored: the
    # test gives the process Python's usual Ctrl-C handling, whatever started it.
    started_with = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        before = signal.getsignal(signal.SIGTERM)
        assert main(["batch", "run", str(write_job(tmp_path, "sig"))]) == status
        assert signal.getsignal(signal.SIGTERM) is before  # the handler was the run's only
    finally:
        signal.signal(signal.SIGINT, started_with)


def test_engines_get_the_home_under_its_current_name(monkeypatch, tmp_path):
    monkeypatch.delenv(env.name("HOME"), raising=False)
    monkeypatch.delenv(env.OLD_PREFIX + "HOME", raising=False)
    assert runner._runtime_env() is None
    monkeypatch.setenv(env.OLD_PREFIX + "HOME", str(tmp_path / "old"))
    with pytest.warns(UserWarning, match="SGLANG_LONGGEN_HOME"):
        assert runner._runtime_env() == {"env_vars": {"SGLANG_LONGGEN_HOME": str(tmp_path / "old")}}
    monkeypatch.setenv(env.name("HOME"), str(tmp_path / "new"))
    assert runner._runtime_env() == {"env_vars": {"SGLANG_LONGGEN_HOME": str(tmp_path / "new")}}
