"""Training objectives behind the loop's protocol: chosen by `train.objective`, each one module."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_step import Recorder, fixed_batch

from qie.checks import compose
from qie.config import typed
from qie.errors import ConfigError
from qie.models import model_spec
from qie.models.qwen_image import FAMILY
from qie.training.objectives import DEFAULT_TARGET, build_objective
from qie.training.objectives.run_context import RunContext
from qie.training.timesteps import SigmaSampling


def test_an_objective_is_a_component_chosen_by_its_group_and_odd_ones_are_refused_in_one_line() -> None:
    assert compose("train", []).train.objective == {"_target_": DEFAULT_TARGET}
    assert compose("train", ["train/objective=dpo"]).train.objective._target_ == "qie.training.objectives.dpo.Dpo"
    cases = [
        (["train.objective=dpo"], "train.objective=dpo is an old spelling: the preset is chosen as "
         "train/objective=dpo"),
        (["train.objective._target_=qie.training.objectives.nothing.Nothing"],
         "train.objective._target_='qie.training.objectives.nothing.Nothing' cannot be imported"),
        (
            ["train.objective._target_=qie.training.objectives.context.sample_inputs"],
            "train.objective._target_='qie.training.objectives.context.sample_inputs' is not a class",
        ),
        (["+train.objective.beta=1"], "unknown key train.objective.beta: "
         "qie.training.objectives.flow_matching.FlowMatching takes no settings"),
    ]  # fmt: skip
    for overrides, message in cases:
        with pytest.raises(ConfigError) as info:
            compose("train", overrides)
        assert str(info.value).startswith(message), str(info.value)


def test_flow_matching_draws_noise_then_sigmas_from_the_batch_generator_and_weighs_regularisation() -> None:
    family = model_spec(typed(compose("train", []).model)).family
    sigmas = SigmaSampling(method="uniform")
    context = RunContext(family=family, sigmas=sigmas, loss_weighting="sigma_sqrt")
    objective = build_objective({"_target_": DEFAULT_TARGET}, context)
    batch = fixed_batch()
    got = objective.loss(Recorder(0.5), batch, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(batch.latents.shape, generator=g)  # noise first, then the sigmas: what the loss draws
    tokens = (batch.latents.shape[-2] // family.patch_size) * (batch.latents.shape[-1] // family.patch_size)
    s = sigmas.sample(batch.latents.shape[0], g, tokens)
    want = FAMILY.loss(Recorder(0.5), batch, noise, s, "sigma_sqrt")
    assert torch.equal(got, want)
    heavy = dataclasses.replace(batch, loss_weight=0.25)  # a regularisation batch
    assert torch.equal(objective.loss(Recorder(0.5), heavy, torch.Generator().manual_seed(3)), want * 0.25)
