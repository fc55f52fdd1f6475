"""Targets an objective computes ahead of training (`PrecomputesTargets`: distillation's teacher outputs, a plug-in's
targets) into the stores it asks its context for, computed by the precompute stage (`precompute.teachers=true`).

The precompute run takes the training run's overrides; the objective's model is built exactly as that run builds it
(its setup, the base with its fused LoRAs, quantization, memory levers and mixed precision, the adapter added and
turned off), so each output lands under the key the training run looks up. Every sample of this process's share
gets `fills_per_sample()` outputs (distillation: one per seed), and, where the run drops captions, one for its empty
prompt as well; the text-only variants precompute encodes for reference dropout are samples of the share too.
A cached training run then reads them all instead of sampling the teacher on first use.
"""

from __future__ import annotations

import functools
from pathlib import Path

from qie.cache.base import CacheStore
from qie.data.collate import collate
from qie.data.samples import Sample
from qie.errors import ConfigError, QieError
from qie.progress import progress
from qie.stages.accelerator import make_accelerator
from qie.stages.objective_store import objective_store
from qie.stages.precompute_work import TypeSummary
from qie.stages.sources import build_source
from qie.stages.train_model import (
    base_model_key,
    build_train_state,
    load_model,
    make_objective,
    objective_context,
    run_records,
)
from qie.stages.train_setup import TrainSetup
from qie.training.objectives import PrecomputesTargets, objective_class

__all__ = ["check_processes", "fill_teachers"]


def check_processes(setup: TrainSetup, processes: int) -> None:
    """Refuse FSDP over several processes, before anything is encoded: each process fills its own share, and FSDP
    needs every process in each forward pass.

    Raises:
        ConfigError: naming what to do instead.
    """
    if setup.memory.fsdp and processes > 1:
        raise ConfigError(
            "precompute.teachers=true fills each process's share on its own, which train.fsdp=true "
            "cannot (every process takes part in each forward pass): fill them with one process per "
            "whole model, or train with cache.mode=lazy"
        )


def fill_teachers(
    setup: TrainSetup, samples: list[Sample], backend: CacheStore, run_dir: Path, desc: str = ""
) -> tuple[str, TypeSummary]:
    """Compute the missing targets of `samples` into `backend` (their embeddings are cached by now) with the training
    run's `setup` (`train_setup`, `check_processes`); returns the entry types filled (the stores the objective asked
    for, joined by ", ") and their counts: new (computed), skipped (present), failed (a sample whose embeddings
    cannot be read)."""
    cls = objective_class(setup.train.objective)
    if not issubclass(cls, PrecomputesTargets):
        raise ConfigError(f"precompute.teachers=true: {cls.__qualname__} computes no targets ahead of training")
    accelerator = make_accelerator(setup.train, setup.memory, str(setup.model.dtype), run_dir)
    source = build_source(setup.source.with_mode("cached"), setup.spec, backend)
    parts = load_model(setup.plan, accelerator)
    record = run_records(setup.plan, [])[0]
    stores = functools.partial(objective_store, backend, mode="lazy")  # every missing one computed and written
    context = objective_context(setup.plan, parts, stores, base_model_key(setup.model, record))
    state, objective = build_train_state(setup.plan, accelerator, parts, make_objective(setup.plan, context))
    context.sealed = True
    # The model under its mixed-precision autocast as training calls it, without the data-parallel wrapper: its
    # forward would sync buffers with the other processes, which fill shares of other lengths.
    model = accelerator.unwrap_model(state.model)
    model.train()  # as in a training step
    drops = [False, True] if float(setup.data.caption_dropout_rate) > 0 else [False]
    seeds = objective.fills_per_sample()
    summary = TypeSummary()
    with progress(len(samples) * len(drops), desc or "teacher outputs", unit="sample") as bar:
        for sample in samples:
            try:
                embeds = source.get([sample])
            except QieError:  # its embeddings failed to encode (recorded there); training skips it too
                summary.failed += len(drops) * seeds
                bar.update(len(drops))
                continue
            for drop in drops:
                batch = collate(embeds, [drop], negatives=True).to(accelerator.device, state.dtype)
                computed = objective.fill(model, batch)
                summary.new += computed
                summary.bytes_written += computed * batch.latents[0].numel() * batch.prompt_embeds.element_size()
                summary.skipped += seeds - computed
                bar.update()
    return ", ".join(context.built.get("stores", {})) or "targets", summary
