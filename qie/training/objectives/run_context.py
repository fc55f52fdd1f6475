"""`RunContext`: the `ObjectiveContext` the train stage and precompute's target filling build (`qie.stages.train_model`)
over a run's pieces, its lazy services given as builders, each called once, when an objective first asks for it.
Tests build it from their own pieces."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from qie.data.images import rgb
from qie.errors import DataError
from qie.evaluation.reward import Reward, RewardCall, reward_value, score
from qie.models.sampling import PromptInputs, initial_noise
from qie.training.objectives.context import NoStore, ObjectiveStore
from qie.training.objectives.reference import FrozenCopy, Reference
from qie.types import Batch

REWARD_SETTING = "train.objective.reward"  # where an objective's reward is set, for messages

if TYPE_CHECKING:
    from qie.evaluation.scoring import Row
    from qie.models.flow import FlowPrediction
    from qie.training.timesteps import SigmaSampling


@dataclass(kw_only=True)
class RunContext:
    """An `ObjectiveContext` over a run's pieces; the lazy services are builders, each called once, when first asked.

    Args:
        family, sigmas, loss_weighting, scheduler, pipeline_config, sampling_defaults, model_key: as the protocol.
        transformer: the model with its trained adapter, before it is wrapped (for `reference`); None: none.
        decoder: builds the VAE (its decoder) on first `decode`.
        rows: a sample id's row at a size for what a reward needs (`qie.stages.train_data.sample_rows`).
        rewards: builds a reward from its setting (`qie.evaluation.build`, with the run's model group).
        stores: builds the store of an entry type over the run's cache (`qie.stages.objective_store`); None: stores
            that keep nothing (`NoStore`).
    """

    family: Any
    sigmas: SigmaSampling
    loss_weighting: str = "none"
    scheduler: Any = None
    pipeline_config: Mapping[str, Any] = field(default_factory=dict)
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    model_key: Mapping[str, Any] = field(default_factory=dict)
    transformer: torch.nn.Module | None = None
    decoder: Callable[[], Any] | None = None
    rows: Callable[[str, tuple[int, int] | None, Collection[str]], Row] | None = None
    rewards: Callable[[Mapping[str, Any]], Reward] | None = None
    stores: Callable[[str], ObjectiveStore] | None = None
    # What was built on first use: the VAE, the stores by entry type, the references handed out.
    built: dict[str, Any] = field(default_factory=dict, repr=False)
    sealed: bool = False  # the model is wrapped for training: no reference can be added any more

    # --- flow matching ----------------------------------------------------------------------------------------

    def noise_and_sigmas(self, batch: Batch, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        latents, patch = batch.latents, self.family.patch_size
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents.device, latents.dtype)
        tokens = (latents.shape[-2] // patch) * (latents.shape[-1] // patch)
        return noise, self.sigmas.sample(latents.shape[0], generator, tokens)

    def flow_prediction(self, model: Any, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor) -> FlowPrediction:
        return self.family.predict(model, batch, noise, sigmas)

    def flow_loss(
        self, model: Any, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor, weighting: str | None = None
    ) -> torch.Tensor:
        how = self.loss_weighting if weighting is None else weighting
        return self.flow_prediction(model, batch, noise, sigmas).error(weighting=how)

    # --- sampling ---------------------------------------------------------------------------------------------

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
        steps = int(steps or self.sampling_defaults.get("num_inference_steps") or 1)
        shape, device, dtype = batch.latents.shape[1:], batch.latents.device, batch.prompt_embeds.dtype
        out = []
        for i in range(len(batch.ids)):
            if noise is not None:
                start = noise[i * copies : (i + 1) * copies]
            else:
                draws = 1 if shared_start else copies
                start = initial_noise((draws, *shape), generator, device, dtype).expand(copies, *shape)
            prompt, negative, controls = sample_inputs(batch, i, copies, negatives=true_cfg_scale > 1)
            out.append(
                self.family.denoise(
                    model,
                    self.scheduler if scheduler is None else scheduler,
                    start,
                    prompt=prompt,
                    negative=negative,
                    controls=controls,
                    steps=steps,
                    true_cfg_scale=float(true_cfg_scale),
                    checkpoint=False,
                    pipeline_config=self.pipeline_config,
                    span=span,
                )
            )
        return torch.cat(out)

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
        prompt = PromptInputs(batch.prompt_embeds, batch.prompt_embeds_mask, batch.prompt_image_mask)
        return self.family.denoise(
            model,
            self.scheduler if scheduler is None else scheduler,
            noise,
            prompt=prompt,
            negative=None,
            controls=batch.control_latents,
            steps=int(steps),
            true_cfg_scale=1.0,
            checkpoint=checkpoint,
            pipeline_config=self.pipeline_config,
        )

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return rgb(self.family.decode(self._decoder(), latents, "pt").float().clamp(0, 1))

    def pixels_per_latent(self) -> int:
        return int(self.family.vae_scale(self._decoder()))

    def _decoder(self) -> Any:
        if "decoder" not in self.built:
            if self.decoder is None:
                raise ValueError("this run builds no decoder (RunContext.decoder)")
            self.built["decoder"] = self.decoder()
        return self.built["decoder"]

    # --- rows and rewards -------------------------------------------------------------------------------------

    def row(self, sample_id: str, size: tuple[int, int] | None = None, needs: Collection[str] = ()) -> Row:
        if self.rows is None:
            raise ValueError("this run reads no rows (RunContext.rows)")
        if needs and size is None:
            raise ValueError(f"a row's {' and '.join(sorted(needs))} are read at an edit's size: give size")
        return self.rows(sample_id, size, needs)

    def reward_inputs(self, batch: Batch, copies: int = 1) -> tuple[list[list[torch.Tensor]], list[str]]:
        rows = [self.row(sample_id) for sample_id in batch.ids]
        controls = [[rgb(c) for c in row.controls] for row in rows for _ in range(copies)]
        return controls, [row.prompt for row in rows for _ in range(copies)]

    def reward(self, node: Mapping[str, Any]) -> Reward:
        if self.rewards is None:
            raise ValueError("this run builds no reward (RunContext.rewards)")
        return self.rewards(node)

    def score(self, reward: Reward, images: torch.Tensor, batch: Batch, copies: int = 1) -> torch.Tensor:
        size = (images.shape[-1], images.shape[-2])
        out = []
        for i, sample_id in enumerate(batch.ids):
            row = self.row(sample_id, size, reward.needs)  # the target and region only where needed
            targets, masks = references(reward, row, copies)
            call = RewardCall(
                setting=REWARD_SETTING,
                images=images[i * copies : (i + 1) * copies],
                controls=[[rgb(c) for c in row.controls]] * copies,
                prompts=[row.prompt] * copies,
                targets=targets,
                masks=masks,
            )
            # one finite score per edit, or one line naming the reward; a stop signal does not wait for it
            out.append(reward_value(reward, score(reward, call, unmeasured=False)))
        return torch.cat(out)

    # --- the reference model and stores -------------------------------------------------------------------------

    def reference(self, lora: str | None = None) -> Reference:
        if self.sealed or self.transformer is None:
            raise ValueError(
                "ask for the reference model in the objective's __init__: it is added to the model before the model "
                "is wrapped for training"
            )
        reference = Reference(lora)
        reference.prepare(self.transformer)
        return reference

    def frozen_copy(self) -> FrozenCopy:
        if self.transformer is None:
            raise ValueError("this run gives no model to copy (RunContext.transformer)")
        copy = FrozenCopy(self.transformer)
        self.keep("frozen_copy", copy.tensors)
        return copy

    def keep(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        kept = self.built.setdefault("kept", {})
        if name in kept:
            raise ValueError(f"the objective keeps {name!r} already: give each kept state its own name")
        kept[name] = tensors

    def kept(self) -> dict[str, dict[str, torch.Tensor]]:
        """What the objective keeps in checkpoints, by name (`keep`)."""
        return self.built.get("kept", {})

    def store(self, entry_type: str) -> ObjectiveStore:
        stores = self.built.setdefault("stores", {})
        if entry_type not in stores:
            stores[entry_type] = NoStore(entry_type) if self.stores is None else self.stores(entry_type)
        return stores[entry_type]


def sample_inputs(
    batch: Batch, i: int, copies: int = 1, negatives: bool = False
) -> tuple[PromptInputs, PromptInputs | None, list[torch.Tensor]]:
    """Sample `i` of `batch` as the sampler takes `copies` of it: its prompt (and, with `negatives`, its empty
    prompt) unpadded (no mask) and its controls, each repeated `copies` times.

    Raises:
        ValueError: `negatives` and the batch holds no empty-prompt embeddings (`collate(negatives=True)`).
    """
    if negatives and batch.negative_prompt_embeds is None:
        raise ValueError(f"batch {batch.ids} holds no empty-prompt embeddings: require 'empty_prompt'")

    def unpadded(embeds: torch.Tensor, mask: torch.Tensor | None, image_mask: torch.Tensor | None) -> PromptInputs:
        n = embeds.shape[1] if mask is None else int(mask[i].sum())
        image = None if image_mask is None else image_mask[i : i + 1, :n].expand(copies, -1)
        return PromptInputs(embeds[i : i + 1, :n].expand(copies, -1, -1), None, image)

    prompt = unpadded(batch.prompt_embeds, batch.prompt_embeds_mask, batch.prompt_image_mask)
    negative = None
    if negatives:
        masks = (batch.negative_prompt_embeds_mask, batch.negative_prompt_image_mask)
        negative = unpadded(batch.negative_prompt_embeds, *masks)
    return prompt, negative, [c[i : i + 1].expand(copies, -1, -1, -1, -1) for c in batch.control_latents]


def references(reward: Reward, row: Row, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The row's target and edit region for each of its `n` edits, where `reward` needs them.

    Raises:
        DataError: the reward needs what the row lacks (a row without a target).
    """
    have = {"target": row.target, "mask": row.region}
    missing = [{"mask": "edit region"}.get(k, k) for k in sorted(reward.needs) if have.get(k) is None]
    if missing:
        raise DataError(
            f"sample {row.id!r} has no {' or '.join(missing)}, which train.objective.reward "
            f"({type(reward).__name__}) compares each edit with: give it rows with targets, or choose a reward that "
            "reads the edit, its controls and its prompt"
        )
    targets = None if row.target is None else rgb(row.target)[None].expand(n, -1, -1, -1)
    masks = None if row.region is None else row.region[None].expand(n, -1, -1)
    return targets, masks


__all__ = ["RunContext", "references", "sample_inputs"]
