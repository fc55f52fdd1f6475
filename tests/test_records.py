"""Wide records are built by keyword only; the sampling options are spelled once, in the `predict` schema."""

from __future__ import annotations

from dataclasses import fields

import pytest

from qie.config.predict import PredictConfig
from qie.data.formats import DataSource
from qie.data.samples import Sample
from qie.models.sampling import SamplingOptions
from qie.sampling_fields import SamplingFields
from qie.stages.settings import sampling_options
from qie.stages.train_setup import TrainSetup
from qie.types import Batch


@pytest.mark.parametrize("record", [TrainSetup, Sample, Batch, DataSource, SamplingOptions])
def test_a_wide_record_refuses_positional_arguments(record: type) -> None:
    required = [f for f in fields(record) if f.init]
    with pytest.raises(TypeError, match="positional argument"):
        record(*[None] * len(required))


def test_the_sampling_options_are_the_predict_groups_sampling_fields() -> None:
    assert issubclass(SamplingOptions, SamplingFields) and issubclass(PredictConfig, SamplingFields)
    assert not {f.name for f in fields(SamplingOptions)} - {f.name for f in fields(PredictConfig)}
    values = {
        "negative_prompt": "blurry",
        "true_cfg_scale": 3,
        "num_inference_steps": 7,
        "seed": 11,
        "height": 96,
        "width": 80,
        "num_images": 2,
        "layers": 3,
    }
    assert set(values) == {f.name for f in fields(SamplingFields)}
    options = sampling_options(PredictConfig(**values), seed=5, width=None)
    assert options == SamplingOptions(**{**values, "true_cfg_scale": 3.0, "seed": 5})
    assert isinstance(options.true_cfg_scale, float)
