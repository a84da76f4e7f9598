"""Checkpoints that survive SIGKILL: write into a temp dir, fsync, rename; verify by manifest on load.

Layout: RUN_DIR/checkpoints/round-000012/{model.pt, optimizer.pt, state.json, MANIFEST.json}.
MANIFEST.json (sha256 + size of every file) is written last, inside the temp dir, before the rename:
a directory named round-* either is complete or fails verification and is skipped with a warning.
Re-saving a round renames the old dir to .old-round-*-<pid>, then the temp dir into place: a crash between the
two leaves that round only in .old-*, which load_latest and save put back (once it verifies); prune removes an
.old-* whose round is in place again.
It also carries the caller's `meta` (the node: which base model the weights belong to, and the LoRA
settings when model.pt holds an adapter rather than the whole model), read back as `Checkpoint.meta`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from node.learn.guard import START_ROUND

log = logging.getLogger(__name__)

PREFIX = "round-"
START_NAME = "start"  # round-start: the weights before round 0 (START_ROUND), the collapse guard's first restore point


def dir_name(round_: int) -> str:
    return f"{PREFIX}{START_NAME}" if round_ == START_ROUND else f"{PREFIX}{round_:06d}"


def round_of(path: Path) -> int | None:
    """The round a checkpoint directory's name says; None for a name that is no checkpoint's."""
    suffix = path.name[len(PREFIX) :] if path.name.startswith(PREFIX) else ""
    # ASCII digits only: str.isdigit() takes '²', which int() refuses
    return START_ROUND if suffix == START_NAME else int(suffix) if re.fullmatch(r"[0-9]{1,12}", suffix) else None


REQUIRED_FILES = frozenset({"model.pt", "state.json"})  # optimizer.pt too, except in a weights-only export


class CheckpointError(RuntimeError):
    pass


@dataclass
class Checkpoint:
    round: int  # last completed round; resume starts at round + 1
    path: Path
    model: dict[str, Any]
    optimizer: dict[str, Any] | None  # None in a weights-only export (export_weights): it cannot resume a run
    state: dict[str, Any]  # rng states, sampler, ij policy, counters: JSON-safe
    meta: dict[str, Any] | None = None  # from the manifest; None in checkpoints written before it existed


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:  # node/ops may not import p2p/ (p2p/files.py has its own)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


CHECKPOINTS_DIR = "checkpoints"  # under the run dir
ABANDONED_DIR = "abandoned"  # checkpoints of a timeline a run went back from, set aside
RESTORE_POINT_DIR = "restore-point"  # the collapse guard's (node/learn/guard.py), beside them


class CheckpointStore:
    def __init__(self, run_dir: Path, keep: int = 2, subdir: str = CHECKPOINTS_DIR):
        self.dir = Path(run_dir) / subdir
        self.keep = max(1, keep)
        self.low_space = False  # said once (node.log) until the disk has room for two checkpoints again
        self.watch_space = subdir == CHECKPOINTS_DIR  # one store says it (not the restore point's too)
        self.dir.mkdir(parents=True, exist_ok=True)

    def save(
        self,
        round_: int,
        weights: dict[str, Any],
        optimizer: dict[str, Any],
        state: dict[str, Any],
        meta: dict[str, Any] | None = None,
    ) -> Path:
        """`weights` and `optimizer` are state dicts (the whole model's, or only a LoRA adapter's)."""
        self._recover_interrupted()  # first: a round that is only in .old-* is set aside or replaced like any other
        self._remove_unfinished()  # before writing: on a nearly full disk the space they hold may be what it needs
        final = self.dir / dir_name(round_)
        tmp = self.dir / f".tmp-{dir_name(round_)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self._write(tmp, round_, weights, optimizer, state, meta)
        except BaseException as exc:  # a full disk, a stop: no half-written copy left to hold the space
            full = isinstance(exc, Exception) and not isinstance(exc, OSError) and self._no_room()
            shutil.rmtree(tmp, ignore_errors=True)
            if full:  # torch.save hides the errno ("unexpected pos"): said as what it is
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp)) from exc
            raise
        if final.exists():  # re-saving the same round (e.g. after a resume): replace it atomically
            old = self.dir / f".old-{final.name}-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        fsync_dir(self.dir)
        self._set_aside_newer_than(round_)
        self._prune()
        self._check_space(final)
        return final

    def _check_space(self, written: Path) -> None:
        """A warning, once until space comes back, when the disk has less than twice a checkpoint's size free:
        the next one is written in full before the oldest is removed, and metrics and logs grow meanwhile."""
        if not self.watch_space:
            return
        try:  # the checkpoint is saved: a failure to measure must not fail it
            size = sum(f.stat().st_size for f in written.iterdir())
            free = shutil.disk_usage(self.dir).free
        except OSError:
            return
        low = free < 2 * size
        if low and not self.low_space:
            log.warning(
                "the disk holding %s has %.0f MB free and a checkpoint takes %.0f MB: free some space soon (on a "
                "full disk the node stops, keeping every checkpoint and metrics line it wrote)",
                self.dir,
                free / 1e6,
                size / 1e6,
            )
        self.low_space = low

    @staticmethod
    def _write(tmp: Path, round_: int, weights: dict, optimizer: dict, state: dict, meta: dict | None) -> None:
        tmp.mkdir(parents=True)
        torch.save(weights, tmp / "model.pt")
        torch.save(optimizer, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps({"round": round_, **state}))
        files = {}
        for name in ("model.pt", "optimizer.pt", "state.json"):
            _fsync_file(tmp / name)
            files[name] = {"sha256": _sha256(tmp / name), "size": (tmp / name).stat().st_size}
        (tmp / "MANIFEST.json").write_text(json.dumps({"round": round_, "files": files, "meta": meta}))
        _fsync_file(tmp / "MANIFEST.json")
        fsync_dir(tmp)

    def _remove_unfinished(self) -> None:
        """Copies begun and never finished (a process killed mid-save, perhaps with this pid: pid 1 in a
        container). The run dir's lock says no other process writes here, and this one saves one at a time."""
        for tmp in self.dir.glob(".tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def _no_room(self) -> bool:
        """Under 1 MB left where the checkpoints go (what a write that failed without an errno ran into)."""
        try:
            return shutil.disk_usage(self.dir).free < 1_000_000
        except OSError:
            return False

    def _set_aside_newer_than(self, round_: int) -> None:
        """Checkpoints numbered after the one just written belong to a timeline this run has left (it resumed
        from an older one: its newest was corrupt, or a restore point outlived a crash). Kept, they would be
        loaded in place of the present and the present pruned."""
        for path in self._complete_dirs():
            if (round_of(path) or 0) <= round_:  # a complete dir's name always gives its round
                break
            self._set_aside(path, f"it is newer than the {dir_name(round_)} just saved (this run went back past it)")

    def _set_aside(self, path: Path, why: str) -> None:
        """Into abandoned/, never deleted, nor any copy there: a checkpoint that failed to load only for a
        passing reason (memory, I/O) can still be recovered from there by hand. A round set aside before keeps
        its name; the later copy gets a suffix (round-000012.1, .2, ...)."""
        dest = self.dir / ABANDONED_DIR / path.name
        n = 0
        while dest.exists():
            n += 1
            dest = self.dir / ABANDONED_DIR / f"{path.name}.{n}"
        try:
            dest.parent.mkdir(exist_ok=True)
            path.rename(dest)
        except OSError as exc:
            log.warning("cannot move %s to %s: %s", path.name, dest, exc)
            return
        log.warning("%s moved to %s: %s", path.name, dest, why)

    def _complete_dirs(self) -> list[Path]:
        rounds = {p: r for p in self.dir.glob(f"{PREFIX}*") if p.is_dir() and (r := round_of(p)) is not None}
        return sorted(rounds, key=rounds.__getitem__, reverse=True)

    def _prune(self) -> None:
        for stale in self._complete_dirs()[self.keep :]:
            shutil.rmtree(stale, ignore_errors=True)
        for old, final in self._old_dirs():
            if final.exists():  # replaced (a crash or an error in the rmtree after the swap left it behind)
                shutil.rmtree(old, ignore_errors=True)

    def _old_dirs(self) -> list[tuple[Path, Path]]:
        """(.old-round-*-<pid>, the round-* dir it was renamed from), by name."""
        pairs = []
        for old in sorted(self.dir.glob(".old-*")):
            name = old.name[len(".old-") :].rpartition("-")[0]
            if old.is_dir() and round_of(Path(name)) is not None:
                pairs.append((old, self.dir / name))
        return pairs

    def _recover_interrupted(self) -> None:
        """A re-save that crashed between its two renames left its round only in .old-round-*-<pid>: put back
        in place when it verifies (else left as it is, with a warning: never deleted)."""
        for old, final in self._old_dirs():
            if final.exists():
                continue  # the swap completed: prune removes it
            try:
                self.verify(old)
            except Exception as exc:  # corrupt in any way, as in load_latest
                log.warning("%s (left by an interrupted re-save) does not verify; left in place: %s", old.name, exc)
                continue
            try:
                old.rename(final)
                fsync_dir(self.dir)
            except OSError as exc:
                log.warning("cannot restore %s from %s: %s", final.name, old.name, exc)
                continue
            log.warning("%s restored from %s (a re-save of it was interrupted)", final.name, old.name)

    @staticmethod
    def verify(path: Path) -> dict[str, Any]:
        """Checks every file against the manifest; returns the manifest."""
        manifest_path = path / "MANIFEST.json"
        try:
            manifest = json.loads(manifest_path.read_text())
            files = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: missing or unreadable MANIFEST.json ({exc})") from exc
        if not isinstance(files, dict) or not REQUIRED_FILES <= files.keys():
            raise CheckpointError(f"{path}: MANIFEST.json does not list {' and '.join(sorted(REQUIRED_FILES))}")
        for name, entry in files.items():
            f = path / name
            try:
                size, digest = int(entry["size"]), str(entry["sha256"])
            except (KeyError, TypeError, ValueError, OverflowError) as exc:  # Overflow: a size of 1e999
                raise CheckpointError(f"{path}: MANIFEST.json's entry for {name} is malformed ({exc})") from exc
            if "/" in name or not f.is_file() or f.stat().st_size != size or _sha256(f) != digest:
                raise CheckpointError(f"{path}: {name} is missing, truncated or corrupt")
        return manifest

    @staticmethod
    def load(path: Path, map_location: str | torch.device = "cpu") -> Checkpoint:
        """One checkpoint directory, verified against its manifest (CheckpointError or a load error if not)."""
        manifest = CheckpointStore.verify(path)
        try:  # files that match their manifest yet do not load: written so by hand, or by another program
            state = json.loads((path / "state.json").read_text())
            model = torch.load(path / "model.pt", map_location=map_location, weights_only=True)
            optimizer = (
                torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True)
                if "optimizer.pt" in manifest["files"]
                else None
            )
            round_ = int(state["round"])
        except Exception as exc:  # torch.load's unpickler raises many kinds (struct.error, EOFError, ...)
            raise CheckpointError(f"{path}: does not load ({type(exc).__name__}: {exc})") from exc
        meta = manifest.get("meta")
        if not isinstance(model, dict) or not isinstance(meta, (dict, type(None))):
            raise CheckpointError(f"{path}: model.pt holds no state dict, or MANIFEST.json's meta is not a table")
        return Checkpoint(round=round_, path=path, model=model, optimizer=optimizer, state=state, meta=meta)

    def load_latest(self, map_location: str | torch.device = "cpu", recover: bool = True) -> Checkpoint | None:
        """Newest checkpoint that verifies and loads; older ones are the fallback. None if there is none.
        `recover`: first put back a round an interrupted re-save left in .old-* (this run's own dir only)."""
        if recover:
            self._recover_interrupted()
        candidates = self._complete_dirs()
        errors = []
        for i, path in enumerate(candidates):
            try:
                ckpt = self.load(path, map_location)
            except Exception as exc:  # corrupt in any way: say so, try the previous one
                log.warning("skipping checkpoint %s: %s", path.name, exc)
                errors.append(f"{path.name}: {exc}")
                continue
            if recover:  # the run goes on from `ckpt`: a re-save of a skipped round must not overwrite it
                for skipped in candidates[:i]:
                    self._set_aside(skipped, f"it did not load; this run resumes from {path.name}")
            return ckpt
        if candidates:
            raise CheckpointError("no loadable checkpoint in " + str(self.dir) + ": " + "; ".join(errors))
        return None


def export_weights(src: Path, dest: Path) -> Path:
    """A checkpoint's weights without its optimizer (a third of the size with Adam), in the same layout, for
    another run's --lora-init: what an experiment commits so that later cells on other machines can start
    from it. `src` is verified first; `dest` appears whole or not at all (temp dir, then rename)."""
    src, dest = Path(src), Path(dest)
    manifest = CheckpointStore.verify(src)
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = {}
    for name in ("model.pt", "state.json"):
        shutil.copy2(src / name, tmp / name)
        _fsync_file(tmp / name)
        files[name] = manifest["files"][name]
    origin = "/".join(src.resolve().parts[-4:])  # e.g. seed3/peer0/checkpoints/round-000099: not this machine's dirs
    (tmp / "MANIFEST.json").write_text(json.dumps({**manifest, "files": files, "exported_from": origin}))
    _fsync_file(tmp / "MANIFEST.json")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def load_from(path: Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    """A checkpoint named by the user: a round-* directory, or a run dir (its newest good checkpoint)."""
    path = Path(path)
    if (path / "MANIFEST.json").exists():
        return CheckpointStore.load(path, map_location)
    if (path / "checkpoints").is_dir():
        ckpt = CheckpointStore(path, keep=10**6).load_latest(map_location, recover=False)  # another run's: read only
        if ckpt is not None:
            return ckpt
    raise CheckpointError(
        f"{path}: neither a checkpoint directory (round-*/MANIFEST.json) nor a run dir with a checkpoint"
    )
