"""The shape every stage has: a recipe object whose `setup()` builds what the stage needs (its `_setup_*` methods,
each keeping what it builds on the object), `run()` does the stage's work and returns its result, and `cleanup()`
gives back what the run held (locks, threads, the collector's freeze), also when setup or run failed.

A stage's `run(cfg, run_dir)` is its edge: it reads the composed config once into typed settings and hands them to
its recipe (`TrainRecipe`, `PrecomputeRecipe`, `InferRecipe`, `CaptionRecipe`, `CacheAdminRecipe`, `DemoRecipe`).
"""

from __future__ import annotations

from typing import Any


class Recipe:
    """A stage's work in three parts; `execute()` runs them, with `cleanup()` always last."""

    def setup(self) -> None:
        """Build what `run` needs (nothing by default)."""

    def run(self) -> Any:
        raise NotImplementedError

    def cleanup(self) -> None:
        """Give back what the run held (nothing by default)."""

    def execute(self) -> Any:
        """setup, run and cleanup; returns what `run` returns."""
        try:
            self.setup()
            return self.run()
        finally:
            self.cleanup()


__all__ = ["Recipe"]
