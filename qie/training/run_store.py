"""A training run's outputs in an object store (`run.output_url`): checkpoints, the weights, metrics and the run
record, so that a node keeps nothing a restart needs.

Everything is written into the local run folder first, as without a store, and then uploaded whole, one object a
file: `<url>/checkpoints/step-NNNNNN/...` and, at the end, the rest of the run folder (`lora/`, `metrics.jsonl`,
`train_result.json`, `.hydra/`, ...). A checkpoint is visible only once all its files are stored: its marker
`checkpoints/step-NNNNNN/.complete` is written last, by a conditional create (as the cache's claims are), so a
checkpoint whose upload was cut short is never listed, never resumed from, and uploaded again by the run that
saves that step next. The file system is the one the `remote` cache backend opens (`open_store`): the same
endpoint and storage options, credentials from the `AWS_*` environment (`AWS_ENDPOINT_URL` included) or a profile.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

from qie.cache.remote_store import open_store
from qie.errors import StorageError
from qie.training import checkpoint as ckpt

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

    def upload(self, local: Path, name: str) -> int:
        """Store the file `local`, or every file under the folder `local`, as `name` (`name/<relative path>`);
        each object in one request. Returns how many objects were written."""
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for path in files:
            if path.name in _LOCAL_ONLY or any(part.endswith(".tmp") for part in path.relative_to(local).parts):
                continue
            relative = path.relative_to(local).as_posix()
            self.store.write(f"{name}/{relative}" if relative != "." else name, path.read_bytes())
        return len(files)

    def publish_checkpoint(self, folder: Path, run_dir: Path) -> bool:
        """Upload the complete local checkpoint `folder`, then its marker, then the metrics so far; False when the
        store already holds that step complete (nothing is written)."""
        name = f"{FOLDER}/{folder.name}"
        if self.store.size(f"{name}/{COMPLETE}") is not None:
            return False
        self.upload(folder, name)
        marker = {"step": ckpt.read_state(folder)["step"], "written": time.time()}
        created = self.store.create(f"{name}/{COMPLETE}", json.dumps(marker).encode())
        if (run_dir / METRICS).is_file():
            self.upload(run_dir / METRICS, METRICS)
        return created

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
        tmp = ckpt.temp_dir(folder)
        shutil.rmtree(tmp, ignore_errors=True)
        for relative, obj in files.items():
            target = tmp / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.store.read(obj))
        return ckpt.commit(tmp, folder)

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
        """Upload the run folder but its checkpoints (uploaded as they are saved); returns the objects written."""
        count = 0
        for path in sorted(run_dir.iterdir()):
            if path.name != FOLDER and path.name not in _LOCAL_ONLY:
                count += self.upload(path, path.name)
        return count


def _complete(objects: dict[str, int]) -> list[str]:
    """The checkpoint names with a marker among the `objects` of `checkpoints/`, oldest first."""
    parts = (n.split("/") for n in objects)
    return sorted(p[1] for p in parts if len(p) == 3 and p[2] == COMPLETE and _NAME.fullmatch(p[1]))


__all__ = ["COMPLETE", "RunStore"]
