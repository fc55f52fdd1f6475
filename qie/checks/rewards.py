"""The rewards a config names, checked when it is composed: each node of `eval.rewards` and `validation.rewards`
against its class's constructor (`qie.evaluation.build.rewards_problem`, which imports the class and builds
nothing). `validation.search_metric` against `validation.rewards` is a plain rule (`qie.checks.rules`).
"""

from __future__ import annotations

from qie.config.groups import Groups
from qie.evaluation.build import rewards_problem


def reward_settings_problem(groups: Groups) -> str | None:
    """Why `eval.rewards` or `validation.rewards` cannot be built as configured (one line), or None: each reward's
    class is imported."""
    given = {
        "eval.rewards": None if groups.eval is None else groups.eval.rewards,
        "validation.rewards": None if groups.validation is None else groups.validation.rewards,
    }
    for key, rewards in given.items():
        if problem := rewards_problem(rewards, key):
            return problem
    return None


__all__ = ["reward_settings_problem"]
