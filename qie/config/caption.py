"""Schema of the caption stage: the `caption` group (what the VL model is asked) and how the stage runs."""

from dataclasses import dataclass, field

from qie.config.cache import CacheConfig, OnError
from qie.config.data import DataConfig
from qie.config.model import ModelConfig
from qie.config.ranges import at_least


@dataclass
class CaptionConfig:
    # The group's choice: edit_instruction, describe or layered.
    name: str = "edit_instruction"
    # The text after the images; {inputs} names the control images ("Picture 1"), {target} the target.
    instruction: str | None = None
    # The text for a sample without control images (text-to-image data); null: `instruction`.
    no_controls: str | None = None
    # Show the control images before the target (false: the target alone).
    show_controls: bool = True
    # "PipelineClass.attribute": a complete prompt read off that diffusers pipeline (one image: the target),
    # used instead of the chat template and `instruction`.
    pipeline_prompt: str | None = None
    # Generation: greedy unless do_sample (then each caption is generated alone from `seed`).
    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int = 0
    # Samples per generate call.
    batch_size: int = 4
    # Replace captions that exist (a <stem>.txt, a manifest row's prompt); never otherwise.
    overwrite: bool = False
    # Print the first `dry_run_samples` captions and write nothing.
    dry_run: bool = False
    dry_run_samples: int = 3
    start: int = 0
    end: int | None = None
    on_error: OnError = OnError.skip
    # Manifest / Hugging Face input: the manifest written (null: <name>.captioned.jsonl beside the input,
    # captions.jsonl beside a glob of parquet files).
    output: str | None = None

    def problem(self) -> str | None:
        """The counts: each at least 1; a range of samples from `start` (0 or more) to an `end` not before it."""
        return at_least(
            "caption",
            [
                ("batch_size", self.batch_size, 1),
                ("max_new_tokens", self.max_new_tokens, 1),
                ("dry_run_samples", self.dry_run_samples, 1),
                ("start", self.start, 0),
            ],
        ) or (None if self.end is None else at_least("caption", [("end", self.end, self.start)]))


@dataclass
class CaptionRoot:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    caption: CaptionConfig = field(default_factory=CaptionConfig)
