"""Training objectives behind the loop's protocol: chosen by `train.objective`, each one module."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_step import Recorder, fixed_batch

from qie.config import compose
from qie.errors import ConfigError
from qie.models import model_spec
from qie.models.qwen_image import flow_matching_loss
from qie.training.objectives import ObjectiveInputs, build_objective, objective_names
from qie.training.objectives.flow_matching import noise_and_sigmas
from qie.training.timesteps import SigmaSampling


def test_objectives_are_the_modules_of_the_package_and_others_are_refused() -> None:
    assert "flow_matching" in objective_names()
    assert compose("train", []).train.objective == "flow_matching"
    with pytest.raises(ConfigError, match="is not an objective: choose one of distill, dpo, flow_matching"):
        compose("train", ["train.objective=dpo_typo"])


def test_flow_matching_draws_noise_then_sigmas_from_the_batch_generator_and_weighs_regularisation() -> None:
    family = model_spec(compose("train", []).model).family
    sigmas = SigmaSampling(method="uniform")
    objective = build_objective("flow_matching", ObjectiveInputs(family, sigmas, "sigma_sqrt"))
    batch = fixed_batch()
    got = objective.loss(Recorder(0.5), batch, torch.Generator().manual_seed(3))
    noise, s = noise_and_sigmas(batch, sigmas, torch.Generator().manual_seed(3), family.patch_size)
    want = flow_matching_loss(Recorder(0.5), batch, noise, s, "sigma_sqrt")
    assert torch.equal(got, want)
    heavy = dataclasses.replace(batch, loss_weight=0.25)  # a regularisation batch
    assert torch.equal(objective.loss(Recorder(0.5), heavy, torch.Generator().manual_seed(3)), want * 0.25)
