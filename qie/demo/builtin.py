"""The built-in demo data set: what `python -m qie.precompute` and `python -m qie.train` read on a tiny model
when `data.path` is not set, so that both run as typed on a fresh machine.

It is the demo's synthetic shapes (`qie.demo.synthetic`) in the kind the model takes (edits with a control
image, shapes from their descriptions for text to image, images and their layers for a layered model),
generated once into `$QIE_HOME/demo_data/` and read from there afterwards. A real model still needs `data.path`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from qie.checks import Checked
from qie.config import qie_home
from qie.models import ModelSpec, model_spec

SAMPLES = 64
IMAGE_SIZE = 64
SEED = 0
# Bump when what `make_dataset` writes changes: a new folder, never a stale one.
VERSION = 1


def builtin_data(kind: str, samples: int = SAMPLES) -> tuple[Path, bool]:
    """The folder of the demo data set of `kind` ("edit", "t2i" or "layered"), written on first use; and whether
    this call wrote it. Writers racing on a shared `$QIE_HOME` each write a private folder and rename it in place;
    the first rename wins and the others drop theirs."""
    folder = qie_home() / "demo_data" / f"{kind}-{samples}-v{VERSION}"
    if folder.is_dir():
        return folder, False
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    from qie.demo.synthetic import make_dataset  # PIL's drawing: only when the set is written (an entry imports this)

    try:
        root = make_dataset(
            scratch / "split",
            train=samples,
            heldout=0,
            size=IMAGE_SIZE,
            seed=SEED,
            controls=kind == "edit",
            layered=kind == "layered",
        )
        os.replace(root / "train", scratch / "data")
        try:
            os.rename(scratch / "data", folder)
        except OSError:
            if not folder.is_dir():
                raise
            return folder, False
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder, True


def data_kind(spec: ModelSpec) -> str:
    """Which demo data set a model trains on: layers, edits (it takes a control image) or text to image, as its
    family's outputs say."""
    return spec.family.outputs.demo_data(spec)


def with_builtin_data(checked: Checked) -> Checked:
    """The CLI's step before a stage's edge (`qie.cli.run_stage`'s `prepare`): the checked config itself, or, on a
    tiny model (`model.tiny`) without `data.path`, a copy whose `data.path` is the built-in demo data set (said in one
    line). A real model without `data.path` is left to the stage, which names the missing key."""
    data, model = checked.groups.data, checked.groups.model
    if data is None or model is None or data.path or not model.tiny:
        return checked
    kind = data_kind(model_spec(model))
    folder, written = builtin_data(kind)
    how = "generated in" if written else "in"
    print(
        f"qie: data.path is not set: using the built-in demo data set of the tiny model ({SAMPLES} {kind} samples, "
        f"{how} {folder}); data.path=... names your own"
    )
    return checked.replaced("data", path=str(folder))


__all__ = ["SAMPLES", "builtin_data", "data_kind", "with_builtin_data"]
