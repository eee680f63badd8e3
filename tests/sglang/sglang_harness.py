"""Arguments for SGLang's real engine on the CPU, with and without our speculative algorithm:
the random-init tiny Llama in float32 with our ``longgen_torch`` attention backend."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from sgl_longgen import env
from sgl_longgen.runtime import resolve_model

MODEL = "tiny-random"
CONTEXT = 2048


def model_path() -> Path:
    return resolve_model(MODEL)


def heads_path() -> Path:
    return model_path() / "tokenswift-heads"


def engine_args(**extra) -> dict:
    args = dict(
        model_path=str(model_path()),
        device="cpu",
        dtype="float32",
        attention_backend="longgen_torch",
        disable_cuda_graph=True,
        disable_overlap_schedule=True,
        mem_fraction_static=0.05,
        max_total_tokens=16384,
        max_running_requests=8,
        context_length=CONTEXT,
        random_seed=0,
        skip_tokenizer_init=True,
        enable_custom_logit_processor=True,
        log_level="error",
    )
    args.update(extra)
    return args


def heads_with(directory: Path, defaults: str) -> Path:
    """A copy of the test heads in ``directory`` whose ``longgen.toml`` holds ``defaults``."""
    shutil.copytree(heads_path(), directory)
    (directory / "longgen.toml").write_text(defaults)
    return directory


def spec_args(**extra) -> dict:
    extra.setdefault("speculative_draft_model_path", str(heads_path()))
    return engine_args(speculative_algorithm="TOKENSWIFT", **extra)


PROMPTS = [
    [256, 100, 101, 102],
    [256] + list(b"def fibonacci(n):\n    if n < 2:\n        return n\n"),
    [256, 5, 6, 7, 8, 9, 5, 6, 7],
]


BUDGETS = (1, 2, 7, 1023)  # max_new_tokens that end inside, at and right after a multi-token step


def check_budgets(plain_engine, engine, **extra) -> None:
    """Exactly ``max_new_tokens`` tokens come back, whatever a step accepted past the budget
    (``extra``: more sampling params of ``engine``'s requests, ``custom_params`` say)."""
    for n in BUDGETS:
        want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(n))
        got = engine.generate(input_ids=PROMPTS, sampling_params=greedy(n, **extra))
        for w, g in zip(want, got):
            assert len(g["output_ids"]) == len(w["output_ids"]) == n
            assert g["output_ids"] == w["output_ids"]
            assert g["meta_info"]["completion_tokens"] == n


def spec_engine_with(**settings: str):
    """A module fixture's body: a TOKENSWIFT engine whose worker starts with these
    ``SGLANG_LONGGEN_*`` settings (yielded, then stopped)."""
    import sglang as sgl

    with worker_settings(**settings):
        engine = sgl.Engine(**spec_args())
    yield engine
    stop(engine)


def last(meta: dict, key: str):
    """A request's final running value of a per-step report series (None: it never had one, as
    ``longgen_tau`` of a request that took no speculative step)."""
    values = [v for v in meta[key] if v is not None]
    return values[-1] if values else None


def check_same_draws(without, with_, custom_params: dict) -> None:
    """Sampled requests (temperature 1) give the very same tokens on both engines: the worker's
    ``with_`` setting changes when work is queued, never which draws are made. Unseeded requests
    share one generator, the second has its own seed; they end on stop tokens at different
    points, mid-way, so work queued for batches that never come is dropped too."""
    stops = [list(range(10, 16)), list(range(100, 104)), []]
    params = [{"max_new_tokens": 120 + 20 * i, "temperature": 1.0, "stop_token_ids": s, "custom_params": custom_params,
               **({"sampling_seed": 7} if i == 1 else {})} for i, s in enumerate(stops)]
    outputs = [[o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=params)]
               for engine in (without, with_)]
    assert outputs[1] == outputs[0]
    lengths = [len(o) for o in outputs[1]]
    assert len(set(lengths)) == 3 and min(lengths) < 100, lengths  # they end apart, mid-way


def greedy(max_new_tokens: int, **extra) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, **extra}


def stop(engine) -> None:
    """Stop one of several engines of this process (``shutdown()`` would stop them all)."""
    from sgl_longgen.sglang.engine import stop_engine

    stop_engine(engine)


@contextmanager
def worker_settings(**settings: str):
    """``SGLANG_LONGGEN_<KEY>`` settings for the engines started inside: their schedulers read
    them when they build the worker."""
    for key, value in settings.items():
        os.environ[env.name(key)] = value
    try:
        yield
    finally:
        for key in settings:
            os.environ.pop(env.name(key), None)
