"""What the stage entry points share: answering the command line in one line (`main_of`: an old spelling, Hydra's
composition errors), checking the composed config before the stage is imported (`run_stage`), the Hydra run
directory, turning user errors into messages, and the end-of-sweep summary.

An entry point imports Hydra, OmegaConf, the schemas and the checker only (`qie.checks`); the stage's module, and
with it torch, diffusers and transformers, is imported once the config passed its checks. A mistake on the command
line is then answered in the time Hydra takes to start.
"""

from __future__ import annotations

import errno
import gc
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write
from omegaconf.errors import OmegaConfBaseException

from qie.checks import Checked, check
from qie.checks.hydra_errors import one_line
from qie.checks.overrides import override_problem
from qie.checks.spellings import old_spelling_problem
from qie.errors import QieError, StorageError, check_writable, describe_os_error
from qie.reporting.sweep_summary import (
    ERROR_FILE,  # where a sweep job's user error is written, in that job's run directory
)
from qie.reporting.sweep_summary import write_summary as sweep_summary

# OSErrors that say the machine, not qie, is at fault: reported in one line naming the path.
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR}

# What a stage stopped by Ctrl-C keeps, and how to go on.
_KEPT_ON_INTERRUPT = {
    "precompute": "the entries written so far are kept: run the same command again to encode the rest",
    "caption": "the captions written so far are kept: run the same command again to caption the rest",
    "infer": "the images written so far are kept",
    "train": "the checkpoints saved so far are kept: train.resume=latest continues from the last",
}

OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
SEARCH_SWEEPER = "hydra_plugins.qie_search.SearchSweeper"


def run_dir() -> Path:
    """The Hydra run (or multirun job) directory of the current job."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def _in_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


# What a stage's module gives its entry point: the stage from a checked config and its run directory.
Start = Callable[[Checked, Path], Any]


def run_stage(
    stage: str,
    load: Callable[[], Start],
    cfg: DictConfig,
    prepare: Callable[[Checked], Checked] | None = None,
) -> Any:
    """Check `cfg` once (`qie.checks.check`: no model library is imported until its plain checks pass), let `prepare`
    complete it (e.g. with the built-in data set), then import the stage (`load`: its `start`) and run it in the
    Hydra run directory; a QieError, or a full or unwritable disk, exits 2 with one `qie: error:` line; Ctrl-C (or
    training's second stop signal) exits 128 + the signal with one `qie: interrupted` line saying what is kept.

    In a sweep (`-m`), a job's QieError is written to `error.txt` in its run directory and the sweep goes
    on with the next job; `SweepSummary` lists the failed jobs at the end and exits non-zero.

    Args:
        stage: the stage's name, for the line a Ctrl-C prints (what it keeps).
    """
    _give_back_hydra_errors()
    try:
        checked = check(cfg)
        from qie.progress import quiet_library_bars  # loads the libraries' logging: once the config is checked

        quiet_library_bars()
        if prepare is not None:
            checked = prepare(checked)
        result = load()(checked, run_dir())
        if not _in_sweep():
            # The process ends with the stage: the interpreter's last collection would walk every object the model
            # libraries made (seconds, most of what follows the stage's end); frozen, they are left to the exit.
            gc.freeze()
        return result
    except KeyboardInterrupt as e:
        exit_interrupted(e, stage)
    except (QieError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in _STORAGE_ERRNOS:
            raise
        message = str(e) if isinstance(e, QieError) else describe_os_error(e)
        if not _in_sweep():
            print(f"qie: error: {message}", file=sys.stderr)
            sys.exit(2)
        folder = run_dir()
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ERROR_FILE).write_text(f"{message}\n", encoding="utf-8")
        print(f"qie: error in job {folder}: {message}\nqie: the sweep goes on with the next job", file=sys.stderr)
        return None


# Set by `main_of` while Hydra composes (when the user has not set it): Hydra then raises its composition errors,
# which `main_of` prints in one line, instead of printing them itself over several lines and exiting 1.
_FULL_ERROR = "HYDRA_FULL_ERROR"
_composing = {"set": False}


def main_of(hydra_main: Callable[[], Any], stage: str, argv: list[str] | None = None) -> None:
    """Run an entry point's `@hydra.main` function with qie's answers to the command line: an old spelling of a key
    (`qie.checks.spellings`) and Hydra's composition errors (an unknown key, a preset that does not exist, a value of
    the wrong type) each end in one `qie: error:` line and exit 2, before anything is imported for the stage; an
    unknown key or preset of the command line is answered before Hydra composes (`qie.checks.overrides`).

    Args:
        stage: the stage's config name (`conf/<stage>.yaml`), whose schema the overrides are read against.
    `HYDRA_FULL_ERROR=1` set by the user keeps Hydra's own report.

    torch's CPU threads wait for each other passively (`OMP_WAIT_POLICY=PASSIVE`, unless the environment says
    otherwise; read when torch loads, after this): spinning at every parallel region, OpenMP's default, takes the cores
    another job on the machine (or the stage's own read-ahead thread) needs, and a cached step of the tiny model took
    5-10x longer beside one (docs/benchmarks.md §17)."""
    args = sys.argv[1:] if argv is None else argv
    # Answered before Hydra composes: an old spelling, a key the stage's schema lacks, a preset its group lacks (the
    # last two are Hydra's to report with the user's HYDRA_FULL_ERROR=1).
    hydras = os.environ.get(_FULL_ERROR) is not None
    if problem := old_spelling_problem(overrides_of(args)) or (not hydras and override_problem(stage, args)):
        _exit_error(problem)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if os.environ.get(_FULL_ERROR) is None:
        os.environ[_FULL_ERROR] = "1"
        _composing["set"] = True
    try:
        with _mode_from_the_command_line(overrides_of(args)):
            hydra_main()
    except (HydraException, OmegaConfBaseException) as e:
        if not _composing["set"]:  # the user's HYDRA_FULL_ERROR, or raised while a stage ran
            raise
        _give_back_hydra_errors()
        _exit_error(one_line(e) if isinstance(e, HydraException) else str(e).splitlines()[0])
    finally:
        _give_back_hydra_errors()


@contextmanager
def _mode_from_the_command_line(overrides: list[str]) -> Iterator[None]:
    """Hydra 1.3's `@hydra.main` composes the whole config once only to read `hydra.mode` (`Hydra.get_mode`), then
    again to run. qie's tree never sets the mode, so unless the command line does (`hydra.mode=...`), the mode is
    what Hydra takes when the config sets none: a sweep with `-m`, else one run; the first composition (a quarter of
    a second, more than the rest of an entry point's own work) is skipped."""
    if any(o.lstrip("+~").startswith("hydra.mode") for o in overrides):
        yield
        return
    from hydra._internal.hydra import Hydra

    asked = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: None  # Hydra's answer for a config without a mode
    try:
        yield
    finally:
        Hydra.get_mode = asked


def _give_back_hydra_errors() -> None:
    """Hydra reports errors its own way again (once the config is composed: the stage's own errors, a sweep's later
    jobs), and a process the stage starts inherits the user's environment."""
    if _composing["set"]:
        os.environ.pop(_FULL_ERROR, None)
        _composing["set"] = False


def _exit_error(message: str) -> NoReturn:
    print(f"qie: error: {message}", file=sys.stderr)
    sys.exit(2)


def overrides_of(argv: list[str]) -> list[str]:
    """The overrides of a command line (`key=value`, `+key=value`, `~key`), without Hydra's options and their
    values (`--cfg job`, `-cn NAME`)."""
    out, after_option = [], False
    for arg in argv:
        if not after_option and not arg.startswith("-"):
            out.append(arg)
        after_option = arg in _HYDRA_VALUE_OPTIONS
    return out


def exit_interrupted(e: KeyboardInterrupt, stage: str) -> NoReturn:
    """One line for a stage stopped by Ctrl-C (or a second stop signal, `Interrupted`), then exit 128 + the
    signal: the whole command stops, a sweep's later jobs included."""
    signum = getattr(e, "signum", signal.SIGINT)
    kept = str(e) or _KEPT_ON_INTERRUPT.get(stage, "what was written so far is kept")
    print(f"qie: interrupted by {signal.Signals(signum).name}: {kept}", file=sys.stderr, flush=True)
    sys.exit(128 + signum)


def exit_after_signal(result: Any) -> None:
    """Exit 128 + the signal's number (130 for SIGINT, 143 for SIGTERM) when a training stopped on a signal (its
    state saved): shells, schedulers and sweeps must not read it as done."""
    signum = result.get("signal") if isinstance(result, dict) else None
    if signum:
        sys.exit(128 + int(signum))


class SweepSummary(Callback):
    """A Hydra callback (configured in the stage roots): after a sweep, print and write its summary
    (`qie.reporting.sweep_summary`: each job's overrides, status, final loss, held-out metrics and run folder), then
    name the jobs that failed with a user error (their `error.txt`) and exit 1 if any did. It reads the sweep
    folder, so it works for launchers that run the jobs elsewhere (Slurm) too. Before a search
    (`hydra/sweeper=optuna`) it checks that the jobs measure what the search minimises, and has Hydra build qie's
    Optuna sweeper (`hydra_plugins.qie_search`), which ends a search where no trial finished in one line, before this
    summary."""

    def __init__(self) -> None:
        self.started = 0.0

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.time() - 1  # a second of slack for file systems with coarse times
        sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
        if "optuna" in sweeper.lower() and "validation" in config and not config.validation.get("heldout_samples"):
            print(
                "qie: error: hydra/sweeper=optuna minimises the held-out loss each job returns: "
                "set validation.heldout_samples=N (samples of data.path kept out of training)",
                file=sys.stderr,
            )
            sys.exit(2)
        # The same search, ended in one line when no trial finished (where qie's plugin is installed beside it).
        if sweeper == OPTUNA and importlib.util.find_spec(SEARCH_SWEEPER.rsplit(".", 1)[0]) is not None:
            with read_write(config.hydra.sweeper):
                config.hydra.sweeper._target_ = SEARCH_SWEEPER

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        jobs = [p.parent.parent for p in sweep.rglob(".hydra/overrides.yaml") if p.stat().st_mtime >= self.started]
        failed = sorted(p.parent for p in sweep.rglob(ERROR_FILE) if p.stat().st_mtime >= self.started)
        if jobs:
            sweep_summary(sweep, jobs)
        if not failed:
            return
        lines = [f"qie: sweep {sweep}: {len(failed)} of {max(len(jobs), len(failed))} job(s) failed"]
        for job in failed:
            message = (job / ERROR_FILE).read_text(encoding="utf-8").strip().splitlines()
            lines.append(f"  {job}: {message[0] if message else '(no message)'}")
        print("\n".join(lines), file=sys.stderr)
        sys.exit(1)


def search_value(result: Any) -> float | None:
    """What the train entry point returns to a Hydra sweeper: the job's `search_value` (`validation.search_metric`'s
    last value, negated where higher is better) or else its held-out loss (`heldout_loss`); None for a job that
    failed with a user error (the Optuna sweeper counts it as a failed trial and goes on). Lower is better."""
    value = result.get("search_value", result.get("heldout_loss")) if isinstance(result, dict) else None
    return float(value) if value is not None else None


class RunDirCheck(Callback):
    """Hydra callback: check the run (or sweep) directory is writable before Hydra creates it, so a bad
    `hydra.run.dir` ends in one `qie: error:` line instead of Hydra's traceback."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_or_exit(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_or_exit(config, "hydra.sweep.dir")


class RunFolderLock(Callback):
    """Hydra callback of the train and infer stages: hold the run folder (`qie.run_lock`) before Hydra writes its
    `.hydra/` record there, so a second run on the folder of a live training is refused without touching it. Only
    the writing process (rank 0) takes it. A sweep job's folder is locked by the train stage itself."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from qie import run_lock

        if not run_lock.is_writer():
            return
        try:
            run_lock.acquire(Path(str(OmegaConf.select(config, "hydra.run.dir"))))
        except StorageError as e:
            print(f"qie: error: {e}", file=sys.stderr)
            sys.exit(2)


def _check_or_exit(config: DictConfig, key: str) -> None:
    try:
        check_writable(Path(str(OmegaConf.select(config, key))), key)
    except StorageError as e:
        print(f"qie: error: {e}", file=sys.stderr)
        sys.exit(2)


# Hydra's own options that take the next argument as their value.
_HYDRA_VALUE_OPTIONS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn"}
_HYDRA_VALUE_OPTIONS |= {"--config-dir", "-cd", "--experimental-rerun"}


def keyed_positionals(argv: list[str], keys: tuple[str, ...]) -> list[str]:
    """`argv` (without the program) with its arguments that are no override and no option (`RUN_DIR OUT`) turned
    into overrides of `keys`, in order (`export.run_dir='RUN_DIR'`), quoted for Hydra's grammar; any beyond
    `keys` are left for Hydra to refuse."""
    out, given, after_option = [], 0, False
    for arg in argv:
        plain = not after_option and not arg.startswith("-") and "=" not in arg
        after_option = arg in _HYDRA_VALUE_OPTIONS
        if plain and given < len(keys):
            quoted = arg.replace("\\", "\\\\").replace("'", "\\'")
            arg, given = f"{keys[given]}='{quoted}'", given + 1
        out.append(arg)
    return out
