"""python -m qie.report RUN_DIR — rebuild the report of a training run folder (`report.html`), of a sweep folder
(`sweep_report.html`, for a folder holding `sweep_summary.json`) or of a demo's folder (its `report.html`) from the
files in it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qie.errors import QieError, StorageError, describe_os_error

DEMO_REPORT = "demo_report.json"


def rebuild(folder: Path) -> Path:
    """Write the report of `folder` (a run or a sweep); its path.

    Raises:
        StorageError: `folder` is not a run or sweep folder qie wrote.
    """
    from qie.reporting.run_files import METRICS
    from qie.reporting.sweep_summary import SUMMARY_JSON

    if not folder.is_dir():
        raise StorageError(f"{folder} is not a folder: give a training run folder (hydra.run.dir) or a sweep folder")
    if (folder / SUMMARY_JSON).is_file():
        from qie.reporting.sweep_report import write_sweep_report

        try:
            return write_sweep_report(folder, json.loads((folder / SUMMARY_JSON).read_text(encoding="utf-8")))
        except (ValueError, KeyError, TypeError) as e:
            raise StorageError(
                f"{folder / SUMMARY_JSON} is not a sweep summary qie wrote ({e.__class__.__name__}: {e}): rebuild "
                "each job's report with python -m qie.report JOB_FOLDER"
            ) from None
    if (folder / DEMO_REPORT).is_file() and (folder / "train" / METRICS).is_file():  # a demo's folder
        from qie.demo.page import write_demo_page

        return write_demo_page(folder, json.loads((folder / DEMO_REPORT).read_text(encoding="utf-8")))
    if not (folder / METRICS).is_file():
        raise StorageError(f"{folder} holds no {METRICS}: give the folder a training run wrote (hydra.run.dir)")
    from qie.reporting.run_report import write_report

    return write_report(folder)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qie.report", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a training run folder, or a sweep folder")
    args = parser.parse_args(argv)
    try:
        print(f"qie: report {rebuild(args.folder)}")
    except (QieError, OSError) as e:
        print(f"qie: error: {e if isinstance(e, QieError) else describe_os_error(e)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
