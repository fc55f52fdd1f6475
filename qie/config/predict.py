"""Schema of the `predict` group: inference inputs, sampling options and part placement."""

from dataclasses import dataclass, field

from qie.config.ranges import first, out_of_range


@dataclass
class PredictDevices:
    vae: str = "auto"
    text_encoder: str = "auto"
    transformer: str = "auto"


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


@dataclass
class PredictConfig(SamplingFields):
    # The sampling options come first, from `SamplingFields`.
    image: str | None = None
    # Several control images (Edit-Plus); takes precedence over `image`.
    images: list[str] | None = None
    prompt: str | None = None
    # Batch mode: a data set folder or manifest; one output per row, written under `output_dir`.
    input: str | None = None
    output: str = "output.png"
    output_dir: str = "predictions"
    lora: str | None = None
    lora_scale: float = 1.0
    # Use `lora` although its run fused other LoRAs into the base than `model.fuse_loras` does (by default refused).
    allow_other_base: bool = False
    merge_to: str | None = None
    devices: PredictDevices = field(default_factory=PredictDevices)
    # Keep N transformer blocks in pinned CPU memory, copied to the GPU just before they run.
    blocks_to_swap: int = 0
    # Compile the transformer's repeated block (regional compilation, as train.compile).
    compile: bool = False

    def problem(self) -> str | None:
        """`blocks_to_swap` from 0; the step and image counts and the output's sides from 1."""
        return first(
            out_of_range("predict.blocks_to_swap", self.blocks_to_swap, 0),
            out_of_range("predict.num_inference_steps", self.num_inference_steps, 1),
            out_of_range("predict.num_images", self.num_images, 1),
            out_of_range("predict.height", self.height, 1),
            out_of_range("predict.width", self.width, 1),
        )
