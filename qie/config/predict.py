"""Schema of the `predict` group: inference inputs, sampling options and part placement."""

from dataclasses import dataclass, field


@dataclass
class PredictDevices:
    vae: str = "auto"
    text_encoder: str = "auto"
    transformer: str = "auto"


@dataclass
class PredictConfig:
    image: str | None = None
    # Several control images (Edit-Plus); takes precedence over `image`.
    images: list[str] | None = None
    prompt: str | None = None
    # Batch mode: a data set folder or manifest; one output per row, written under `output_dir`.
    input: str | None = None
    output: str = "output.png"
    output_dir: str = "predictions"
    # Sampling options (qie.sampling.SamplingOptions); the empty negative prompt is the one the cache
    # stores, so CFG runs by default; set negative_prompt=null to turn CFG off.
    negative_prompt: str | None = ""
    true_cfg_scale: float = 4.0
    num_inference_steps: int = 50
    seed: int = 0
    height: int | None = None
    width: int | None = None
    num_images: int = 1
    lora: str | None = None
    lora_scale: float = 1.0
    merge_to: str | None = None
    devices: PredictDevices = field(default_factory=PredictDevices)
    # Keep N transformer blocks in pinned CPU memory, copied to the GPU just before they run.
    blocks_to_swap: int = 0
