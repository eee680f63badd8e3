"""The batch job spec: one TOML (or JSON) file says what to generate, where, and on what.

The spec is a tree of strict ``msgspec`` structs, like :mod:`sgl_longgen.config`: an unknown key
or a value out of range fails before any engine starts, with the offending field named
(``$.engines.tp_size``), because a typo in a GPU-day batch should cost a second, not a day.

The generation settings (``method``, ``max_new_tokens``, ``seed``, ``ignore_eos``, ``[sampling]``,
the method tables ``[tokenswift]``, ``[owl]``, ``[suffix]``, ``[howl]``, ``[longspec]``,
``[adaptive]``, and ``[reference]``) are the same structs ``sgl-longgen generate`` uses. Engines
layer them over the defaults shipped beside the draft checkpoints (``longgen.toml``), exactly as the
``generate`` command does, so a job file only has to say what differs.

Relative paths (``input``, ``output_dir``, ``model``, ``heads``, ``drafter``, ``longspec_drafter``)
resolve against the folder of the job file, so a job file and its prompts can move together.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ..config import (
    AdaptiveConfig,
    HowlConfig,
    LongSpecConfig,
    Method,
    OwlConfig,
    RuntimeConfig,
    SamplingConfig,
    Strict,
    SuffixConfig,
    TokenSwiftConfig,
    merge,
)
from ..errors import LonggenError

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0.0)]


class EnginesSpec(Strict):
    """How many engine replicas, and what each one reserves.

    One engine is one Ray actor in its own placement group. With ``runtime = "sglang"`` an engine
    is one SGLang tensor-parallel group: the actor reserves ``tp_size`` GPUs (SGLang starts its TP
    workers as subprocesses of the actor, so every GPU of the group must be visible to it).
    """

    count: PosInt = 1
    tp_size: PosInt = 1  # GPUs per engine (sglang); the reference runtime uses at most one device
    cpus: PosFloat = 1.0  # CPUs reserved per engine (the reference runtime uses them as torch threads)
    # Requests one engine runs at once. SGLang batches them continuously; the reference runtime
    # decodes one at a time.
    max_concurrent_requests: PosInt = 1
    startup_timeout_s: PosFloat = 900.0  # waiting for resources and for the model to load
    # Replacement actors per engine slot after the actor died (preemption, OOM kill, node loss).
    max_restarts: NonNegInt = 3


class SGLangSpec(Strict):
    """Settings of ``runtime = "sglang"``."""

    # Passed verbatim to ``sglang.Engine`` (mem_fraction_static, attention_backend, context_length,
    # ...); they win over what the job derives (model_path, tp_size, speculative_* ...).
    engine_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)


class JobSpec(Strict, kw_only=True):
    """A batch of long generations. See ``configs/tiny_batch.toml`` for an annotated example."""

    name: str = ""  # default: the job file's name without its suffix
    model: str  # an embedded model name (tiny, ...) or an HF checkpoint directory
    # Draft checkpoints, as `sgl-longgen generate` takes them (default: the one inside the model
    # directory): TokenSwift heads; the OWL drafter of owl and howl; the LongSpec drafter.
    heads: str | None = None
    drafter: str | None = None
    longspec_drafter: str | None = None
    runtime: Literal["reference", "sglang"] = "reference"
    input: str  # JSONL, one prompt per line: {"id": ..., "prompt": "..."} or {"id": ..., "input_ids": [...]}
    output_dir: str  # records.jsonl, checkpoints/, summary.json
    # Generation (the same meaning as in `sgl-longgen generate`).
    method: Method = "tokenswift"
    max_new_tokens: PosInt = 2048
    seed: int = 0
    ignore_eos: bool = False
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    tokenswift: TokenSwiftConfig = msgspec.field(default_factory=TokenSwiftConfig)
    owl: OwlConfig = msgspec.field(default_factory=OwlConfig)
    suffix: SuffixConfig = msgspec.field(default_factory=SuffixConfig)
    howl: HowlConfig = msgspec.field(default_factory=HowlConfig)
    longspec: LongSpecConfig = msgspec.field(default_factory=LongSpecConfig)
    adaptive: AdaptiveConfig = msgspec.field(default_factory=AdaptiveConfig)
    reference: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    sglang: SGLangSpec = msgspec.field(default_factory=SGLangSpec)
    # Fault tolerance.
    checkpoint_every: PosInt = 512  # tokens between checkpoints: a kill loses at most this many per request
    max_retries: NonNegInt = 2  # re-runs of one request after its engine was lost
    engines: EnginesSpec = msgspec.field(default_factory=EnginesSpec)

    def __post_init__(self) -> None:
        if self.runtime == "reference":
            if self.engines.tp_size != 1:
                raise ValueError("engines.tp_size must be 1 with runtime = \"reference\" (it runs on one device)")
            if self.engines.max_concurrent_requests != 1:
                raise ValueError(
                    "engines.max_concurrent_requests must be 1 with runtime = \"reference\" "
                    "(it decodes one request at a time; add engines instead)"
                )
            if self.sglang.engine_kwargs:
                raise ValueError("sglang.engine_kwargs is set but runtime = \"reference\"")
        if self.runtime == "sglang":
            # What SGLang's samplers (and our plugin, which follows them) do not implement: refuse
            # rather than silently sample from another distribution.
            s = self.sampling
            if s.eta != 0.0:
                raise ValueError("sampling.eta must be 0 with runtime = \"sglang\" (SGLang has no eta filter)")
            if s.min_tokens_to_keep != 1:
                raise ValueError("sampling.min_tokens_to_keep must be 1 with runtime = \"sglang\" "
                                 "(SGLang's filters have no such floor)")
            filters = (s.top_k > 0) + (s.top_p < 1.0) + (s.min_p > 0.0)
            if filters > 1 and s.filter_order != "joint":
                raise ValueError("sampling.filter_order must be \"joint\" with runtime = \"sglang\" when more than "
                                 "one of top_k, top_p, min_p is on (SGLang applies them jointly)")

    @property
    def gpus_per_engine(self) -> int:
        """GPUs one engine reserves: its TP group, none for an engine told to run on the CPU."""
        if self.runtime == "sglang":
            return 0 if self.sglang.engine_kwargs.get("device") == "cpu" else self.engines.tp_size
        return 1 if self.reference.device.startswith("cuda") else 0


# The keys of a job file that are generation settings (GenerateConfig fields). `[reference]` is
# GenerateConfig's `runtime` table: in a job file `runtime` names the engine kind instead.
GENERATION_KEYS = ("method", "max_new_tokens", "seed", "ignore_eos", "sampling", "tokenswift", "owl", "suffix", "howl",
                   "longspec", "adaptive")
# The job fields naming draft checkpoint directories.
DRAFT_FIELDS = ("heads", "drafter", "longspec_drafter")


@dataclass
class Job:
    """A loaded job: the validated spec plus what it needs from the file it came from."""

    spec: JobSpec
    source: Path | None  # the job file (None: built in code)
    base_dir: Path  # relative paths resolve here
    # The generation settings exactly as written (no defaults filled in), in GenerateConfig's
    # shape: engines merge them over the model's own longgen.toml.
    generation: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name or (self.source.stem if self.source else "batch")

    def path(self, value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else (self.base_dir / p).resolve()

    @property
    def input_path(self) -> Path:
        return self.path(self.spec.input)

    @property
    def output_dir(self) -> Path:
        return self.path(self.spec.output_dir)

    @property
    def model(self) -> str:
        """The model as engines should open it: an embedded name stays a name."""
        from ..runtime.embedded import is_name

        m = self.spec.model
        if is_name(m):
            return m
        return str(self.path(m))

    @property
    def drafts(self) -> dict[str, str | None]:
        """The draft directories the job names (``heads``, ``drafter``, ``longspec_drafter``), resolved."""
        values = {f: getattr(self.spec, f) for f in DRAFT_FIELDS}
        return {f: str(self.path(v)) if v else None for f, v in values.items()}

    def settings(self) -> dict[str, Any]:
        """Everything that decides the tokens of a record; a resumed job must not change it."""
        return {
            "model": self.model,
            **self.drafts,
            "runtime": self.spec.runtime,
            "generation": self.generation,
            "sglang": self.spec.sglang.engine_kwargs if self.spec.runtime == "sglang" else {},
        }


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise LonggenError(f"job file not found: {path}")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise LonggenError(f"job file {path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}") from None
    if not isinstance(data, dict):
        raise LonggenError(f"job file {path} must hold a table/object at the top level")
    return data


def job_from_dict(data: dict[str, Any], source: Path | None = None, base_dir: Path | None = None) -> Job:
    """Validate plain data as a job; errors name the field (``$.engines.count``)."""
    where = str(source) if source else "job spec"
    try:
        spec = msgspec.convert(data, JobSpec)
    except msgspec.ValidationError as exc:
        raise LonggenError(f"invalid job spec {where}: {exc}") from None
    generation = {k: data[k] for k in GENERATION_KEYS if k in data}
    if "reference" in data:
        generation["runtime"] = data["reference"]
    if base_dir is None:
        base_dir = source.parent if source else Path.cwd()
    return Job(spec=spec, source=source, base_dir=base_dir.resolve(), generation=generation)


def load_job(path: str | Path, overrides: dict[str, Any] | None = None) -> Job:
    """A job file (``.toml`` or ``.json``), with optional overrides (e.g. ``output_dir``) on top."""
    path = Path(path)
    data = _read(path)
    if overrides:
        data = merge(data, overrides)
    return job_from_dict(data, source=path)
