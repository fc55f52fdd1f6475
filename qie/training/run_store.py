"""A training run's outputs in an object store (`run.output_url`): checkpoints, the weights, metrics and the run
record, so that a node keeps nothing a restart needs.

Everything is written into the local run folder first, as without a store, and then uploaded whole, one object a
file: `<url>/checkpoints/step-NNNNNN/...` and, at the end, the rest of the run folder (`lora/`, `metrics.jsonl`,
`train_result.json`, `.hydra/`, ...). A checkpoint is visible only once all its files are stored: its marker
`checkpoints/step-NNNNNN/.complete` is written last, by a conditional create (as the cache's claims are), so a
checkpoint whose upload was cut short is never listed, never resumed from, and uploaded again by the run that
saves that step next. One run writes the store at a time (its lease, `qie.training.run_lease`); the marker names
the run and each file's SHA-256, and `trainer_state.json` the run that saved it: a checkpoint whose files are not
those its marker lists, or whose state another run saved, is refused on resume.

The file system is the one the `remote` cache backend opens (`open_store`): the same endpoint and storage options,
credentials from the `AWS_*` environment (`AWS_ENDPOINT_URL` included) or a profile.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

from qie.cache.remote_store import open_store
from qie.errors import StorageError
from qie.training import checkpoint as ckpt
from qie.training.run_lease import WriterLease

COMPLETE = ".complete"
FOLDER = "checkpoints"
METRICS = "metrics.jsonl"
# Never uploaded: the run folder's lock and what is being written (temporary checkpoint folders).
_LOCAL_ONLY = (".qie-run.lock",)
# What a checkpoint's name and each part of a stored file's path may be: no `..`, no empty part (`//`), no `/` at
# the start, so that a file downloaded from the store lands inside its checkpoint folder whatever the store holds.
_NAME = re.compile(r"step-[0-9]{6,}")
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")


class RunStore:
    """The run's outputs under `url` (`run.output_url`, e.g. `s3://BUCKET/PREFIX`).

    Args:
        endpoint_url: the S3 endpoint of MinIO, R2 or a local server (`run.endpoint_url`).
        storage_options: anything else for the fsspec file system (`run.storage_options`).
        retries, backoff, timeout: per request, as the remote cache's.

    Raises:
        ConfigError: a URL that cannot be opened (no s3fs), or a bucket without a prefix.
    """

    def __init__(
        self,
        url: str,
        endpoint_url: str | None = None,
        storage_options: Mapping | None = None,
        retries: int = 4,
        backoff: float = 0.5,
        timeout: float = 5.0,
    ) -> None:
        self.url, self.endpoint_url = str(url).rstrip("/"), endpoint_url or None
        self.store = open_store("run", self.url, self.endpoint_url, storage_options, (retries, backoff, timeout))
        # This run's id: in its lease, in each checkpoint's marker and trainer_state.json (`ckpt.read_state`).
        self.run_id = secrets.token_hex(8)
        self.writer = WriterLease(self.store, self.url, self.run_id)

    def claim(self, resuming: bool) -> None:
        """Take the store for this run (its writer lease, `qie.training.run_lease`): the first requests, so that a
        store that is down, refuses the credentials or has no bucket is named in one line before anything loads. A
        run that does not resume is refused a store holding another run's checkpoints (it would write beside them).

        Raises:
            StorageError: as said, naming the store and what to do.
        """
        self.writer.take()
        names = [] if resuming else self.checkpoints()
        if names:
            self.writer.release()
            raise StorageError(
                f"run.output_url={self.url} holds the checkpoints of an earlier run (the newest {names[-1]}): continue "
                "it with train.resume=latest, or give this run an output URL of its own"
            )

    def release(self) -> None:
        """Release the store for other runs (the writer lease)."""
        self.writer.release()

    def upload(self, local: Path, name: str) -> dict[str, str]:
        """Store the file `local`, or every file under the folder `local`, as `name` (`name/<relative path>`);
        each object in one request. Returns each object written (its path relative to `name`, "." for a file)
        with the SHA-256 of its bytes."""
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        written = {}
        for path in files:
            if path.name in _LOCAL_ONLY or any(part.endswith(".tmp") for part in path.relative_to(local).parts):
                continue
            relative, data = path.relative_to(local).as_posix(), path.read_bytes()
            self.store.write(f"{name}/{relative}" if relative != "." else name, data)
            written[relative] = hashlib.sha256(data).hexdigest()
        return written

    def publish_checkpoint(self, folder: Path, run_dir: Path) -> bool:
        """Upload the complete local checkpoint `folder`, then its marker (this run's id and each file's digest),
        then the metrics so far; False when the store already holds that step complete from this run (nothing is
        written).

        Raises:
            StorageError: the step is stored complete by another run, or this run's lease was taken over.
        """
        name = f"{FOLDER}/{folder.name}"
        self.writer.check()
        if (stored := self._marker(name)) is not None:
            if stored.get("run") != self.run_id:
                raise StorageError(
                    f"{self.url}/{name} is stored complete by another run ({stored.get('run', 'unnamed')}): this "
                    f"run's {folder} is kept in its run folder; give this run an output URL of its own"
                )
            return False
        files = self.upload(folder, name)
        marker = {"step": ckpt.read_state(folder)["step"], "written": time.time(), "run": self.run_id, "files": files}
        self.writer.check()
        created = self.store.create(f"{name}/{COMPLETE}", json.dumps(marker).encode())
        if (run_dir / METRICS).is_file():
            self.upload(run_dir / METRICS, METRICS)
        return created

    def _marker(self, name: str) -> dict | None:
        """The marker of the stored checkpoint `name` (`checkpoints/step-NNNNNN`), None when it has none; a marker
        that is no JSON object reads as {}."""
        try:
            doc = json.loads(self.store.read(f"{name}/{COMPLETE}"))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def checkpoints(self) -> list[str]:
        """The names (`step-NNNNNN`) of the complete checkpoints in the store, oldest first."""
        return _complete(self.store.listing(FOLDER))

    def prune(self, keep: int | None) -> list[str]:
        """Delete the oldest complete checkpoints beyond `keep` (None keeps all), each marker first so that a
        checkpoint being deleted is no longer listed, and what uploads cut short left of checkpoints older than
        the newest complete one (this run saves no step before it again). Returns the names deleted."""
        objects = self.store.listing(FOLDER)
        complete = _complete(objects)
        old = complete[:-keep] if keep else []
        started = {n.split("/")[1] for n in objects if n.count("/") >= 2}
        old += sorted(n for n in started - set(complete) if complete and n < complete[-1])
        for name in old:
            self.store.remove(f"{FOLDER}/{name}/{COMPLETE}")
            for obj in sorted(o for o in objects if o.startswith(f"{FOLDER}/{name}/") and not o.endswith(COMPLETE)):
                self.store.remove(obj)
        return old

    def download_checkpoint(self, name: str, run_dir: Path) -> Path:
        """Copy the store's complete checkpoint `name` into `run_dir/checkpoints/name` (written under a temporary
        name and renamed, replacing a local folder of that name); returns the local folder.

        Raises:
            StorageError: an object of the checkpoint whose key would leave its folder (`..`, `//`, a leading `/`):
                the checkpoint is refused before anything is written.
        """
        folder = run_dir / FOLDER / name
        prefix = f"{FOLDER}/{name}/"
        files = {obj[len(prefix) :]: obj for obj in sorted(self.store.listing(f"{FOLDER}/{name}"))}
        files.pop(COMPLETE, None)
        for relative, obj in files.items():
            if not all(_PART.fullmatch(part) for part in relative.split("/")):
                raise StorageError(
                    f"{self.url}/{prefix} holds the object {obj!r}, whose key leads out of its checkpoint folder: "
                    f"checkpoint {name} is refused; delete that object (or the checkpoint) from the store, or resume "
                    "from a checkpoint qie wrote"
                )
        run, digests = self._listed(name, set(files))
        tmp = ckpt.temp_dir(folder)
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for relative, obj in files.items():
                data = self.store.read(obj)
                if hashlib.sha256(data).hexdigest() != digests[relative]:
                    raise self._mixed(name, f"its {relative} is not the file run {run} stored (another digest)")
                target = tmp / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            saved_by = ckpt.read_state(tmp).get("run")
            if saved_by != run:
                raise self._mixed(name, f"its marker names run {run} and its {ckpt.STATE_FILE} run {saved_by}")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return ckpt.commit(tmp, folder)

    def _listed(self, name: str, stored: set[str]) -> tuple[str, dict[str, str]]:
        """(the run, {file: SHA-256}) the marker of the stored checkpoint `name` lists, checked against the files
        `stored` (their paths relative to the checkpoint).

        Raises:
            StorageError: a marker without them (an earlier qie's), or files it does not list or lacks.
        """
        marker = self._marker(f"{FOLDER}/{name}") or {}
        run, digests = marker.get("run"), marker.get("files")
        if not isinstance(run, str) or not isinstance(digests, dict):
            raise StorageError(
                f"checkpoint {name} in {self.url} has a marker without its run's id and file digests (stored by an "
                "earlier qie, or damaged): its files cannot be told from another run's; delete it from the store, "
                "or resume from a local copy with train.resume=PATH"
            )
        if extra := sorted(stored - set(digests)):
            raise self._mixed(name, f"it holds {extra[0]}, which its marker (run {run}) does not list")
        if missing := sorted(set(digests) - stored):
            raise self._mixed(name, f"it lacks {missing[0]}, which its marker (run {run}) lists")
        return run, digests

    def _mixed(self, name: str, why: str) -> StorageError:
        return StorageError(
            f"checkpoint {name} in {self.url} is refused: {why}; two runs wrote into it. Delete it from the store "
            "(the earlier checkpoints are kept) and resume again"
        )

    def download_metrics(self, run_dir: Path) -> bool:
        """Copy the store's metrics.jsonl into `run_dir` (the steps logged before a restart); False when none."""
        try:
            data = self.store.read(METRICS)
        except FileNotFoundError:
            return False
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / METRICS).write_bytes(data)
        return True

    def publish_run(self, run_dir: Path) -> int:
        """Upload the run folder but its checkpoints (uploaded as they are saved); returns the objects written.

        Raises:
            StorageError: this run's lease was taken over.
        """
        self.writer.check()
        count = 0
        for path in sorted(run_dir.iterdir()):
            if path.name != FOLDER and path.name not in _LOCAL_ONLY:
                count += len(self.upload(path, path.name))
        return count


def _complete(objects: dict[str, int]) -> list[str]:
    """The checkpoint names with a marker among the `objects` of `checkpoints/`, oldest first."""
    parts = (n.split("/") for n in objects)
    return sorted(p[1] for p in parts if len(p) == 3 and p[2] == COMPLETE and _NAME.fullmatch(p[1]))


__all__ = ["COMPLETE", "RunStore"]
