"""Schema of the `predict` group: inference inputs, sampling options and part placement."""

from dataclasses import dataclass, field

from qie.config.ranges import first, out_of_range
from qie.sampling_fields import SamplingFields


@dataclass
class PredictDevices:
    vae: str = "auto"
    text_encoder: str = "auto"
    transformer: str = "auto"


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
