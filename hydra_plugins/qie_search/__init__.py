"""A Hydra plugin of qie: the Optuna search (`hydra/sweeper=optuna`, the `optuna` extra) ended in one line when
none of its trials finished. Optuna's sweeper then asks for the best trial of a study without one and raises, which
would skip the sweep summary that names each trial's error (`qie.cli.SweepSummary`, which also has Hydra build this
sweeper in place of Optuna's own). Hydra builds sweepers only from the `hydra_plugins` package, hence its place.
"""

from __future__ import annotations

import sys
from typing import Any

try:
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
except ImportError:  # the `optuna` extra is not installed: no search to end
    OptunaSweeper = None

# What Optuna raises when asked for the best trial of a study with no finished trial.
_NO_TRIAL_FINISHED = "No trials are completed yet"

if OptunaSweeper is not None:

    class SearchSweeper(OptunaSweeper):
        """Optuna's sweeper, which ends a search whose every trial failed with one `qie: error:` line (no best
        parameters, no `optimization_results.yaml`) and lets the sweep summary follow."""

        def sweep(self, arguments: list[str]) -> Any:
            try:
                return super().sweep(arguments)
            except ValueError as e:
                if _NO_TRIAL_FINISHED not in str(e):
                    raise
            print(
                "qie: error: no trial of the search finished (each one's error is listed below): fix it and search "
                "again; no best parameters were chosen",
                file=sys.stderr,
                flush=True,
            )
            return None
