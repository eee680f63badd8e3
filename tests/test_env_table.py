"""Every ``SGLANG_LONGGEN_`` variable the code reads is in :mod:`sgl_longgen.env`'s table."""

from __future__ import annotations

import re
from pathlib import Path

import sgl_longgen
import sgl_longgen.cluster
import sgl_longgen.kernels
from sgl_longgen import env

# The package and the two folders it maps in (kernels/, cluster/).
ROOTS = [Path(m.__file__).parent for m in (sgl_longgen, sgl_longgen.kernels, sgl_longgen.cluster)]
READS = re.compile(r'env\.(?:get|name)\(\s*"([A-Z0-9_]+)"')


def test_every_variable_read_is_documented():
    read = {m for root in ROOTS for path in root.rglob("*.py") for m in READS.findall(path.read_text())}
    assert {"ADAPTIVE", "FOLD_MAX_TREE", "PLAIN_RUN_AHEAD"} <= read  # the scan finds them (FOLD_MAX_TREE: kernels/)
    documented = set(re.findall(r"^``([A-Z0-9_]+)``", env.__doc__, flags=re.M))
    assert read <= documented, sorted(read - documented)
