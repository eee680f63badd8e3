"""Shared fixtures for the training tests: a small corpus, and one torch thread.

The tests' tensors are small, and on a busy two-core machine several OpenMP threads spend their
time waiting for each other (a 10-50x slowdown seen here), so each test runs single-threaded.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SAMPLE = textwrap.dedent('''\
    import os
    import sys


    def walk(root, pattern="*.py"):
        """Yield every file below root whose name matches pattern."""
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith(pattern[1:]):
                    yield os.path.join(dirpath, name)


    class Counter:
        def __init__(self):
            self.counts = {}

        def add(self, key, n=1):
            self.counts[key] = self.counts.get(key, 0) + n
            return self.counts[key]

        def most_common(self, k=10):
            return sorted(self.counts.items(), key=lambda kv: -kv[1])[:k]


    if __name__ == "__main__":
        counter = Counter()
        for path in walk(sys.argv[1]):
            counter.add(os.path.splitext(path)[1])
        print(counter.most_common())
''')


@pytest.fixture(scope="session")
def sample_text() -> str:
    return SAMPLE


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """A directory of small Python files (variations of one module) plus a non-matching file."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        sub = root / f"pkg{i % 3}"
        sub.mkdir(exist_ok=True)
        text = SAMPLE.replace("Counter", f"Counter{i}").replace("walk", f"walk_{i}")
        (sub / f"mod{i}.py").write_text(text * 3)
    (root / "notes.txt").write_text("not python\n")
    return root
