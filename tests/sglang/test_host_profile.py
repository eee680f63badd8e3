"""The opt-in host profile covers only the requests that ask for it and writes pstats."""

from __future__ import annotations

import pstats
from types import SimpleNamespace

from sgl_longgen.sglang import host_profile
from sgl_longgen.sglang.host_profile import PROFILE_ENV, PROFILE_PARAM, HostProfile
from sgl_longgen.sglang.request_settings import parse_custom_params, with_settings


def req(params):
    """A request as admission leaves it: its custom_params carry their parsed settings."""
    return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=with_settings(params,
                                                                                       parse_custom_params(params))))


def test_off_unless_the_server_opts_in(monkeypatch):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    assert HostProfile.from_env() is None


def test_profiles_asked_steps_and_dumps_stats(monkeypatch, tmp_path):
    path = tmp_path / "steps.prof"
    monkeypatch.setenv(PROFILE_ENV, str(path))
    monkeypatch.setattr(host_profile, "DUMP_EVERY", 2)
    prof = HostProfile.from_env()
    assert not prof.wants([req(None), req({"penalty": 1.1})])
    assert prof.wants([req(None), req({PROFILE_PARAM: True})])

    def _decode(x):
        return sum(i * x for i in range(1000))

    want = _decode(3)
    assert prof.run(_decode, 3) == want
    assert not path.exists()  # first dump after DUMP_EVERY steps
    prof.run(_decode, 4)
    stats = pstats.Stats(str(path)).stats
    assert [v[1] for k, v in stats.items() if k[2] == "_decode"] == [2]
    assert (tmp_path / "steps.prof.steps").read_text().strip() == "2"


def test_profile_spans_the_gap_to_the_next_step_and_stops_on_demand(monkeypatch, tmp_path):
    path = tmp_path / "steps.prof"
    monkeypatch.setenv(PROFILE_ENV, str(path))
    prof = HostProfile.from_env()

    def _decode(x):
        return x

    def between_steps():  # what the scheduler does before our next step
        return sum(range(1000))

    prof.run(_decode, 1)
    between_steps()
    prof.run(_decode, 2)
    assert not path.exists()
    prof.stop()  # e.g. a batch without profiled requests
    between_steps()  # no longer profiled
    stats = pstats.Stats(str(path)).stats
    assert [v[1] for k, v in stats.items() if k[2] == "between_steps"] == [1]
    assert (tmp_path / "steps.prof.steps").read_text().strip() == "2"
    prof.stop()  # idempotent
