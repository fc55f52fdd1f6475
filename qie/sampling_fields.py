"""The sampling options' fields, spelled once: the `predict` group's schema (`qie.config.predict.PredictConfig`) and
the options a sampler takes (`qie.models.sampling.SamplingOptions`) both take theirs from here. A leaf module that
imports nothing, so that the schema loads without torch and a training step without OmegaConf."""

from dataclasses import dataclass


@dataclass(kw_only=True)
class SamplingFields:
    """How an image is sampled: the fields the `predict` group sets (`predict.seed`, ...) and
    `qie.models.sampling.SamplingOptions` carries, spelled once here.

    The empty negative prompt is the one the cache stores, so CFG runs where the scale is above 1 (validation
    from cached inputs too); set negative_prompt=null to turn CFG off. The scale and the step count left None are
    the model's (`model.true_cfg_scale`, `model.num_inference_steps`: its pipeline's own; 2.1 samples its
    checkpoint's `sample_sigmas` where it has them), filled in by `SamplingOptions.resolved`."""

    negative_prompt: str | None = ""
    true_cfg_scale: float | None = None
    num_inference_steps: int | None = None
    seed: int = 0
    # Output size; None: the model's rule (the condition size of its output image, see ModelSpec.output_size).
    height: int | None = None
    width: int | None = None
    num_images: int = 1
    # Layers to split the input into (a layered model, e.g. Qwen-Image-Layered; its default 4; other models refuse
    # it); `predict.output` is then a folder of layer_0.png, layer_1.png, ...
    layers: int | None = None
