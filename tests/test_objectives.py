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
from qie.models.qwen_image import flow_matching_loss
from qie.training.objectives import DEFAULT_TARGET, ObjectiveInputs, build_objective
from qie.training.objectives.flow_matching import noise_and_sigmas
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
            ["train.objective._target_=qie.training.objectives.flow_matching.noise_and_sigmas"],
            "train.objective._target_='qie.training.objectives.flow_matching.noise_and_sigmas' is not a class",
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
    objective = build_objective({"_target_": DEFAULT_TARGET}, ObjectiveInputs(family, sigmas, "sigma_sqrt"))
    batch = fixed_batch()
    got = objective.loss(Recorder(0.5), batch, torch.Generator().manual_seed(3))
    noise, s = noise_and_sigmas(batch, sigmas, torch.Generator().manual_seed(3), family.patch_size)
    want = flow_matching_loss(Recorder(0.5), batch, noise, s, "sigma_sqrt")
    assert torch.equal(got, want)
    heavy = dataclasses.replace(batch, loss_weight=0.25)  # a regularisation batch
    assert torch.equal(objective.loss(Recorder(0.5), heavy, torch.Generator().manual_seed(3)), want * 0.25)
