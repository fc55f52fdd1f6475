"""The samples a stage reads: a data set's samples (captions filled in where asked), a range of them in id order,
and the failure list a stage writes."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

from qie.data.formats import DataSource, read_dataset
from qie.data.samples import DataProblem, Dataset, Sample
from qie.errors import DataError


class CaptionFiller(Protocol):
    """What gives samples without a caption theirs (`qie.stages.auto_caption.AutoCaptions`)."""

    def fill(self, samples: list[Sample]) -> tuple[list[Sample], list[DataProblem]]: ...


def read_data(
    source: DataSource,
    require_target: bool = True,
    require_prompt: bool = True,
    captions: CaptionFiller | None = None,
) -> Dataset:
    """The samples of `source`: a folder, a manifest or a Hugging Face data set; without `require_prompt`, samples
    without a caption have the prompt "" (the caption stage). With `captions` (`data.auto_caption`, see
    `qie.stages.auto_caption.auto_captions`), samples without a caption get one, and those that cannot are
    problems."""
    fill = require_prompt and captions is not None
    data = read_dataset(source, require_target, require_prompt and not fill)
    if fill:
        samples, problems = captions.fill(data.samples)  # type: ignore[union-attr]
        data = Dataset(samples, sorted([*data.problems, *problems], key=lambda p: p.id))
    return data


def sample_range(
    data: Dataset, start: int, end: int | None, raise_errors: bool, on_error_key: str
) -> list[Sample | DataProblem]:
    """The samples and scan problems of `start`..`end` of `data`, in id order (broken samples included, so fixing
    one shifts nothing).

    Raises:
        DataError: the first problem when `raise_errors` (naming `on_error_key`, the setting that goes on).
    """
    items = sorted([*data.samples, *data.problems], key=lambda x: x.id)[start:end]
    problems = [x for x in items if isinstance(x, DataProblem)]
    if raise_errors and problems:
        p = problems[0]
        raise DataError(f"sample {p.id!r}: {p.path}: {p.reason} ({on_error_key}=skip goes on)")
    return items


def write_failures(run_dir: Path, problems: list[DataProblem]) -> Path:
    """Write `failures.jsonl` (one DataProblem a line) in `run_dir`; returns its path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "failures.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps(asdict(p)) + "\n")
    return path
