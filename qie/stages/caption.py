"""The caption stage: write one caption per sample with the model's own VL text encoder.

Edit data gets the instruction that turns the control images into the target, text-to-image data a
description (`caption=describe`), and `caption=layered` the Layered pipeline's own caption prompt. The text
encoder and processor are built as precompute builds them (`cache.text_encoder_device`,
`model.text_encoder_quantize`), only when something is left to caption. Like precompute, the stage slices
the data set (`caption.start`/`end`), splits it across the processes of `torchrun` / `accelerate launch`,
skips what is done (resume) and what has a caption (unless `caption.overwrite`), records unreadable samples
(summary, failures.jsonl) and goes on unless `caption.on_error=raise`. `caption.dry_run` prints the first
captions and writes nothing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from qie.checks import Checked, check
from qie.components import LoadSettings, load_parts, prepare_model
from qie.config.cache import CacheConfig
from qie.config.caption import CaptionConfig
from qie.config.data import DataConfig
from qie.config.model import ModelConfig
from qie.data.formats import detect_format
from qie.data.images import fit_area, open_image, resize
from qie.data.samples import DataProblem, Sample
from qie.errors import ConfigError, DataError, check_writable
from qie.models import ModelSpec
from qie.models.captioning import Captioner, CaptionPrompt, GenerationSettings, caption_processor
from qie.progress import progress
from qie.stages.caption_output import FolderOutput, ManifestOutput
from qie.stages.datasets import read_data, sample_range, write_failures
from qie.stages.precompute_work import share
from qie.stages.processes import leave_process_group, warn_single_process
from qie.stages.recipe import Recipe
from qie.stages.settings import data_source


@dataclass
class CaptionSummary:
    samples: int = 0
    captioned: int = 0
    skipped_existing: int = 0  # had a caption (kept: caption.overwrite=false)
    skipped_done: int = 0  # captioned by an earlier run (resume)
    failures: list[DataProblem] = field(default_factory=list)
    processes: list[dict] = field(default_factory=list)
    # The first captions of a dry run: (sample id, caption).
    preview: list[tuple[str, str]] = field(default_factory=list)

    def merge(self, other: CaptionSummary) -> None:
        for name in ("samples", "captioned", "skipped_existing", "skipped_done"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("failures", "processes", "preview"):
            getattr(self, name).extend(getattr(other, name))


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The caption stage's own settings, read from the config once."""

    prompt: CaptionPrompt
    generation: GenerationSettings
    batch_size: int
    overwrite: bool
    dry_run: int  # samples to preview; 0: not a dry run
    raise_errors: bool
    start: int
    end: int | None
    output: str | None


def read_settings(c: CaptionConfig) -> Settings:
    """The stage's settings (of the `caption` group; its counts were checked when the config was composed).

    Raises:
        ConfigError: a prompt with nothing to ask.
    """
    prompt, generation = prompt_settings(c)
    dry = c.dry_run_samples if c.dry_run else 0
    raise_errors = c.on_error == "raise"
    return Settings(
        prompt=prompt,
        generation=generation,
        batch_size=c.batch_size,
        overwrite=c.overwrite,
        dry_run=dry,
        raise_errors=raise_errors,
        start=c.start,
        end=c.end,
        output=c.output,
    )


def prompt_settings(c: CaptionConfig) -> tuple[CaptionPrompt, GenerationSettings]:
    """What a `caption` node asks and how the text is generated.

    Raises:
        ConfigError: a prompt with nothing to ask.
    """
    if not c.instruction and not c.pipeline_prompt:
        raise ConfigError("caption.instruction is empty: choose caption=edit_instruction|describe|layered or set it")
    prompt = CaptionPrompt(c.name, c.instruction, c.no_controls, c.show_controls, c.pipeline_prompt)
    generation = GenerationSettings(c.max_new_tokens, c.do_sample, c.temperature, c.top_p, c.seed)
    return prompt, generation


def run(cfg: DictConfig, run_dir: Path) -> CaptionSummary:
    """Caption `cfg.data` with `cfg.model`'s text encoder (the stage from code: `cfg` checked once,
    `qie.checks.check`, then `start`); returns (and, unless a dry run, writes) the summary.

    Raises:
        ConfigError: bad settings. DataError: no usable sample; with on_error=raise, the first bad sample.
        StorageError: an output or run folder that cannot be written (found before any model is built).
    """
    return start(check(cfg), run_dir)


def start(checked: Checked, run_dir: Path) -> CaptionSummary:
    """The stage's edge: a checked config's typed groups handed to the `CaptionRecipe`. See `run`."""
    g = checked.groups
    if not g.data.path:
        raise ConfigError("data.path is not set: point it at the data set folder or manifest to caption")
    return CaptionRecipe(g.model, g.data, g.cache, read_settings(g.caption), Path(run_dir)).execute()


class CaptionRecipe(Recipe):
    """The caption stage: `setup()` joins the processes, reads the range and picks this process's samples that
    need a caption; `run()` captions them with the model's VL text encoder and writes the summary."""

    def __init__(
        self, model: ModelConfig, data: DataConfig, cache: CacheConfig, settings: Settings, run_dir: Path
    ) -> None:
        self.model, self.data, self.cache, self.settings, self.run_dir = model, data, cache, settings, run_dir

    def setup(self) -> None:
        from accelerate import PartialState

        settings = self.settings
        self.spec = prepare_model(self.model)
        self.state = state = PartialState(cpu=not torch.cuda.is_available())  # see qie.stages.precompute
        warn_single_process(state.num_processes, "qie.caption")
        self.everything = read_data(data_source(self.data, self.cache.state_folder()), require_prompt=False)
        items = sample_range(self.everything, settings.start, settings.end, settings.raise_errors, "caption.on_error")
        self.output = make_output(self.data, settings, state.process_index)
        if not settings.dry_run:
            check_writable(self.run_dir, "the run directory (hydra.run.dir)")
        main = state.is_main_process
        self.summary = CaptionSummary()
        todo = pick(items, self.output, settings, self.summary, report=main)
        mine = [s for s, _ in share([(s, {"id": s.id}) for s in todo], state.num_processes, state.process_index)]
        if settings.dry_run:
            mine = mine[: settings.dry_run] if main else []
        self.mine = mine

    def run(self) -> CaptionSummary:
        settings, summary, state, mine = self.settings, self.summary, self.state, self.mine
        summary.samples = len(mine)
        if mine:
            captioner = build_captioner(self.model, self.spec, str(self.cache.text_encoder_device), settings)
            info = run_info(self.model, settings)
            caption_all(
                captioner, mine, spec=self.spec, settings=settings, output=self.output, summary=summary, info=info
            )
        summary.processes = [{"process": state.process_index, "captioned": summary.captioned}]
        summary = finish(state, summary, self.output, self.everything.samples, settings, self.run_dir)
        leave_process_group(state)
        return summary


def make_output(data: DataConfig, settings: Settings, process: int) -> FolderOutput | ManifestOutput:
    """Where captions go: the data set folder, or a manifest (`caption.output`, else `<name>.captioned.jsonl`
    beside the input manifest or Hugging Face data set, `captions.jsonl` beside a glob of parquet files); checked
    writable unless a dry run."""
    path = Path(str(data.path)).expanduser()
    kind = detect_format(path) if data.format == "auto" else str(data.format)
    if kind == "folder":
        out: FolderOutput | ManifestOutput = FolderOutput(path)
        folder = path / "training_images"
    else:
        default = path.with_name(f"{path.stem}.captioned.jsonl") if path.exists() else path.parent / "captions.jsonl"
        target = Path(settings.output).expanduser() if settings.output else default
        out = ManifestOutput(target, process)
        folder = target.parent
    if not settings.dry_run:
        check_writable(folder, "the caption output folder")
    return out


def pick(items: list, output, settings: Settings, summary: CaptionSummary, report: bool) -> list[Sample]:
    """The samples to caption: not captioned by an earlier run, and without a caption unless overwriting.
    Scan problems are recorded (by the `report`ing process)."""
    done = output.done()
    todo = []
    for item in items:
        if isinstance(item, DataProblem):
            if report:
                summary.failures.append(item)
        elif item.id in done and not settings.overwrite:
            summary.skipped_done += report
        elif output.has_caption(item) and not settings.overwrite:
            summary.skipped_existing += report
        else:
            todo.append(item)
    return todo


def build_captioner(model: ModelConfig, spec: ModelSpec, device: str, settings: Any) -> Captioner:
    """The text encoder (on `device`: `cache.text_encoder_device`) and processor, built through the registry as
    precompute builds them; `settings` has the caption prompt and generation settings (`.prompt`, `.generation`)."""
    names = ["text_encoder", *spec.prompt_parts]
    parts = load_parts(LoadSettings.of(model), spec, names, {"text_encoder": device})
    processor_class = spec.family.part_classes["processor"]
    return Captioner(
        parts.text_encoder, caption_processor(parts, processor_class), settings.prompt, settings.generation
    )


def run_info(m: ModelConfig, settings: Settings) -> dict[str, Any]:
    """What a caption's sidecar records besides the prompt text: enough to redo it."""
    return {
        "prompt_name": settings.prompt.name,
        "generation": settings.generation.to_dict(),
        "batch_size": 1 if settings.generation.do_sample else settings.batch_size,
        "model": {
            "name": str(m.name),
            "source": str(m.pretrained_model_name_or_path),
            "revision": m.revision,
            "dtype": str(m.dtype),
            "text_encoder_quantize": str(m.text_encoder_quantize),
        },
    }


def shown_images(sample: Sample, captioner: Captioner, spec: ModelSpec, vl_pixels: int) -> list:
    """The sample's images as the VL model sees them, resized to the model's VL area (alpha on white).

    Raises:
        DataError: an image that cannot be read, or a control count the model cannot take.
    """
    problem = spec.control_problem(len(sample.controls))
    if problem:
        raise DataError(f"sample {sample.id!r} has {problem}")
    if sample.target is None:
        raise DataError(f"sample {sample.id!r} has no target image: captions describe the target")
    images = []
    for path in captioner.shown(sample.controls, sample.target):
        img = open_image(path)
        images.append(resize(img, *fit_area(img.width, img.height, vl_pixels)))
    return images


def caption_all(
    captioner: Captioner,
    samples: list[Sample],
    spec: ModelSpec,
    settings: Settings,
    output,
    summary: CaptionSummary,
    info: dict,
) -> None:
    """Caption `samples` in batches; write each caption (or keep it for the dry run's preview)."""
    vl_pixels = int(spec.vl_image_pixels)
    info = {**info, "checkpoint_generation": captioner.checkpoint_generation()}
    with progress(len(samples), "caption", unit="sample") as bar:
        for start in range(0, len(samples), settings.batch_size):
            batch, images = [], []
            for sample in samples[start : start + settings.batch_size]:
                try:
                    images.append(shown_images(sample, captioner, spec, vl_pixels))
                    batch.append(sample)
                except DataError as e:
                    fail(summary, sample, e, settings)
            captions = captioner.caption(images) if batch else []
            for sample, imgs, text in zip(batch, images, captions):
                if not text:
                    fail(
                        summary, sample, DataError(f"sample {sample.id!r}: the model wrote an empty caption"), settings
                    )
                elif settings.dry_run:
                    summary.preview.append((sample.id, text))
                    summary.captioned += 1
                else:
                    shown = [str(p) for p in captioner.shown(sample.controls, sample.target)]
                    output.write(sample, text, {**info, "prompt": captioner.text(len(imgs) - 1), "images": shown})
                    summary.captioned += 1
            bar.update(len(batch))


def fail(summary: CaptionSummary, sample: Sample, error: DataError, settings: Settings) -> None:
    """Record a sample that could not be captioned; re-raise with on_error=raise."""
    if settings.raise_errors:
        raise error
    path = getattr(error, "path", None) or sample.target or (sample.controls[0] if sample.controls else "")
    summary.failures.append(DataProblem(sample.id, str(path), str(error)))


def finish(state, summary: CaptionSummary, output, samples: list[Sample], settings: Settings, run_dir: Path):
    """Gather the processes' summaries; the main process merges the output and writes the report."""
    from accelerate.utils import gather_object

    if state.num_processes > 1:
        state.wait_for_everyone()
        total = CaptionSummary()
        for part in gather_object([summary]):
            total.merge(part)
        summary = total
    if not state.is_main_process:
        return summary
    if settings.dry_run:
        print(format_summary(summary, None, "dry run: nothing written", "previewed"))
        return summary
    where = output.finish(samples)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "caption_summary.json").write_text(json.dumps(asdict(summary), indent=2))
    write_failures(run_dir, summary.failures)
    print(format_summary(summary, run_dir, where))
    return summary


def format_summary(summary: CaptionSummary, run_dir: Path | None, where: str, done: str = "captioned") -> str:
    """The end-of-run report: counts, a dry run's captions, the first failures, where the output is."""
    lines = [
        f"caption: {summary.captioned} {done}, {summary.skipped_existing} kept (had a caption; "
        f"caption.overwrite=true replaces them), {summary.skipped_done} done earlier, "
        f"{len(summary.failures)} failed"
    ]
    lines += [f"  {sid}: {text}" for sid, text in summary.preview]
    lines += [f"  failed: {p.id}: {p.path}: {p.reason}" for p in summary.failures[:10]]
    if len(summary.failures) > 10:
        lines.append(f"  ... {len(summary.failures) - 10} more in failures.jsonl")
    lines.append(f"  {where}")
    if run_dir is not None:
        lines.append(f"  summary: {run_dir / 'caption_summary.json'}, failures: {run_dir / 'failures.jsonl'}")
    return "\n".join(lines)
