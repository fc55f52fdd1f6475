"""What an objective asks the run for: `ObjectiveContext`, the one thing its constructor is given besides its own
settings (`Cls(context, **settings)`).

Each service is built when an objective first asks for it, so a run builds nothing its objective does not use:
flow matching asks for noise, sigmas and the flow loss and the run loads no decoder and reads no rows; an objective
that samples and scores its own edits asks for the sampler, the decoder, the rows and a reward; one that computes
targets ahead of training asks for a store of its own entry type. A new kind of need is one method here, not a field
threaded through the stages.

`RunContext` (`qie.training.objectives.run_context`) is the implementation the train stage and precompute's target
filling build (`qie.stages.train_model`); tests build it from their own pieces.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from qie.evaluation.reward import Reward
from qie.training.objectives.reference import FrozenCopy, Reference
from qie.types import Batch

if TYPE_CHECKING:
    from qie.evaluation.scoring import Row
    from qie.models.flow import FlowPrediction


class ObjectiveStore(Protocol):
    """A keyed store of one entry type over the run's cache backend: what an objective computes ahead of training
    (distillation's teacher outputs), one tensor per entry, named by the fields of its key (`context.store`)."""

    # Whether a missing entry is to be computed (and written where the store keeps entries): precompute and
    # cache.mode=lazy fill; cache.mode=cached only reads (a miss is the objective's error to raise).
    fills: bool

    def read(self, fields: Mapping[str, Any]) -> torch.Tensor | None:
        """The tensor stored under `fields`, or None (missing, or damaged: `holds` tells which)."""
        ...

    def write(self, fields: Mapping[str, Any], value: torch.Tensor) -> None:
        """Store `value` under `fields` (a store that keeps nothing, as in cache.mode=live, drops it)."""
        ...

    def holds(self, fields: Mapping[str, Any]) -> bool:
        """Whether an entry is stored under `fields`, readable or not."""
        ...


class NoStore:
    """The store of a run that keeps nothing (cache.mode=live, or a backend that stores nothing): every entry is
    computed when needed and dropped."""

    fills = True

    def __init__(self, entry_type: str) -> None:
        self.entry_type = entry_type

    def read(self, fields: Mapping[str, Any]) -> torch.Tensor | None:
        return None

    def holds(self, fields: Mapping[str, Any]) -> bool:
        return False

    def write(self, fields: Mapping[str, Any], value: torch.Tensor) -> None:
        pass


class ObjectiveContext(Protocol):
    """Everything an objective may ask of the run (see the module's text). Tensors are on the model's device."""

    family: Any  # the ModelFamily: its pieces, patch size and outputs
    loss_weighting: str  # `train.loss_weighting`: the flow loss's weighting over sigmas
    scheduler: Any  # the model's noise scheduler (a sampler's step replaces its `step`: `qie.training.flow_sde`)
    sampling_defaults: Mapping[str, Any]  # the pipeline's num_inference_steps, true_cfg_scale
    pipeline_config: Mapping[str, Any]  # the checkpoint's model_index.json
    model_key: Mapping[str, Any]  # what the base model is: part of the keys of what a store keeps

    def noise_and_sigmas(self, batch: Batch, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Gaussian noise shaped as `batch.latents` and one noise level per sample (B,) in (0, 1], drawn from
        `generator` (noise first) as the run's `train.timestep_sampling` says."""
        ...

    def flow_prediction(self, model: Any, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor) -> FlowPrediction:
        """The model's velocity prediction for `batch` noised to `sigmas`, beside the true velocity and the loss
        masks' weights (`qie.models.flow.FlowPrediction`; `.error()` is the flow loss per sample)."""
        ...

    def flow_loss(
        self, model: Any, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor, weighting: str | None = None
    ) -> torch.Tensor:
        """The flow-matching loss of each sample (B,), float32, with the batch's loss masks, weighted over sigmas by
        `weighting` (default: the run's `loss_weighting`)."""
        ...

    def sample(
        self,
        model: Any,
        batch: Batch,
        generator: torch.Generator | None = None,
        *,
        steps: int | None = None,
        copies: int = 1,
        noise: torch.Tensor | None = None,
        true_cfg_scale: float = 1.0,
        scheduler: Any = None,
        shared_start: bool = False,
        span: tuple[int, int | None] | None = None,
    ) -> torch.Tensor:
        """`copies` results of each sample (B * copies, ...) shaped as `batch.latents`, sample-major, sampled by the
        family's loop from the batch's cached embeddings (each prompt unpadded), without CFG unless
        `true_cfg_scale` > 1 (against the empty prompt). Starting noise: `noise` (of any latent size), else drawn
        from `generator` per sample (one shared by its copies with `shared_start`). `scheduler` replaces the model's
        (its `step`: an SDE step); `steps` defaults to the pipeline's; `span` (start, stop) runs those steps alone,
        `noise` being the latents at `start`. The gradient is on where the caller has it on."""
        ...

    def denoise(
        self,
        model: Any,
        batch: Batch,
        noise: torch.Tensor,
        *,
        steps: int,
        scheduler: Any = None,
        checkpoint: bool = False,
    ) -> torch.Tensor:
        """The family's loop over the batch as collated (padded prompts, no CFG) from `noise` (B, ...); with the
        gradient on and `checkpoint`, each prediction is recomputed in the backward pass (a student trained
        through its sampling)."""
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (N, 3, H, W) in [0, 1] of normalised latents (the VAE's decoder, loaded on first use)."""
        ...

    def pixels_per_latent(self) -> int:
        """Image pixels per latent pixel along a side (the VAE's scale; the decoder is loaded to read it)."""
        ...

    def row(self, sample_id: str, size: tuple[int, int] | None = None, needs: Collection[str] = ()) -> Row:
        """A sample's row (`qie.evaluation.scoring.Row`): prompt and control images, and its target and edit region
        at `size` (width, height) where `needs` names them ("target", "mask")."""
        ...

    def reward_inputs(self, batch: Batch, copies: int = 1) -> tuple[list[list[torch.Tensor]], list[str]]:
        """What a reward's `__call__` takes besides the images for `copies` edits of each sample, sample-major: the
        control images (3, h, w) of each edit and its prompt."""
        ...

    def reward(self, node: Mapping[str, Any]) -> Reward:
        """The reward a `{_target_: ..., keys}` setting names, built as `qie.eval` builds it."""
        ...

    def score(self, reward: Reward, images: torch.Tensor, batch: Batch, copies: int = 1) -> torch.Tensor:
        """`reward`'s scores (B * copies,) float64, higher is better, of `copies` edits of each sample (images
        sample-major), given the rows' target and edit region where the reward needs them.

        Raises:
            DataError: the reward needs a target or edit region that a sample lacks.
        """
        ...

    def reference(self, lora: str | None = None) -> Reference:
        """The reference model inside the trained one: the base (adapter off), or the adapter of `lora`. Ask for it
        in `__init__`: it is added to the model before the model is wrapped for training."""
        ...

    def frozen_copy(self) -> FrozenCopy:
        """A frozen copy of the trained weights, swapped in by its `active()` and moved towards them by
        `follow(decay)` (DiffusionNFT's sampling policy); kept in every checkpoint and restored on resume."""
        ...

    def keep(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `tensors` (the objective's own state, updated in place) in every checkpoint, and restore them in
        place when a run resumes, so that a resumed run goes on exactly."""
        ...

    def store(self, entry_type: str) -> ObjectiveStore:
        """The store of `entry_type` (lower-case letters and `_`, e.g. `teacher_latent`) over the run's cache."""
        ...


__all__ = ["NoStore", "ObjectiveContext", "ObjectiveStore"]
