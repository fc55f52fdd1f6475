"""The eval stage (`python -m qie.eval`): edit each held-out row with the base model and with each LoRA of
`eval.loras`, at the seeds of `eval.seeds` and the model's sampling settings (the `predict` group), score the edits
with every reward of `eval.rewards`, and write eval.json, eval.md and eval.png.

The rows are encoded through the run's embedding source, as validation's are: entries the cache holds are read
(no encoder is built for them); `cache.mode=lazy` (the stage's default) encodes the others once and writes them. The
edits are sampled by validation's code (`qie.training.validation.Validator`: the sampler inference runs), row i
at seed + i. The transformer is freed before the rewards are built: a judge's VL model is not in memory beside it.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from PIL import Image

from qie.adapters.fused_base import check_lora_base
from qie.adapters.lora import LORA_FILE, load_lora, lora_file
from qie.adapters.lora_files import COMFYUI_FILE, KOHYA_FILE
from qie.checks import Checked, check
from qie.components import LoadSettings, load_parts
from qie.config.data import DataConfig
from qie.config.evaluation import EvalConfig
from qie.config.model import ModelConfig
from qie.config.predict import PredictConfig
from qie.data.categories import row_categories
from qie.data.images import open_image
from qie.data.samples import Sample
from qie.errors import ConfigError, check_writable
from qie.evaluation import report as reports
from qie.evaluation.build import build_rewards
from qie.evaluation.image_metrics import to_tensor
from qie.evaluation.reward import Reward, direction
from qie.evaluation.rows import reference_row
from qie.evaluation.scoring import Row, score_row, summarize
from qie.models import ModelSpec
from qie.models.sampling import SamplingOptions
from qie.stages.datasets import read_data
from qie.stages.edge import Edge
from qie.stages.infer import resolve_output
from qie.stages.recipe import Recipe
from qie.stages.settings import data_source, fused_base, sampling_options
from qie.stages.validation import validation_inputs
from qie.training.validation import Validator

BASE = "base"


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Evaluate as `cfg` says (the stage from code: `cfg` checked once, `qie.checks.check`, then `start`); returns the
    report also written to eval.json.

    Raises:
        QieError subclasses naming the key, file or row at fault (before any model is built where the config or
        the data says it).
    """
    return start(check(cfg), run_dir)


def start(checked: Checked, run_dir: Path) -> dict:
    """The stage's edge: a checked config's typed groups handed to the `EvalRecipe`. See `run`."""
    groups = checked.groups
    edge = Edge.of(groups, masks=False)  # first: a checkpoint of another model is named before anything else
    return EvalRecipe(edge, groups.eval, groups.predict, Path(run_dir)).execute()


class EvalRecipe(Recipe):
    """The eval stage: `setup()` checks the settings, reads the LoRAs, builds the rewards and reads the rows (before
    any model is built); `run()` edits the rows with each run, scores the edits and writes the outputs.

    Args:
        edge: the model, data and cache groups with the model's spec (`Edge`).
        settings: the `eval` group; predict: the `predict` group (the sampling settings).
    """

    def __init__(self, edge: Edge, settings: EvalConfig, predict: PredictConfig, run_dir: Path) -> None:
        self.edge, self.e, self.p, self.run_dir = edge, settings, predict, run_dir

    def setup(self) -> None:
        edge, e = self.edge, self.e
        model, data, spec = edge.model, edge.data, edge.spec
        if spec.family.outputs.demo_data(spec) == "layered":
            raise ConfigError(f"model {model.name!r} splits images into layers: the eval stage scores single edits")
        if not data.path:
            raise ConfigError("data.path is not set: point it at the held-out rows (a data set folder or manifest)")
        if not e.rewards:
            raise ConfigError("eval.rewards is empty: name at least one metric (see conf/eval.yaml)")
        self.runs = lora_runs(e.loras, model, self.p, spec)
        self.rewards = build_rewards(e.rewards, "eval.rewards", model=model)
        self.samples, self.skipped = heldout_rows(data, edge.cache.state_folder(), self.rewards)
        self.out = resolve_output(e.output_dir, self.run_dir)
        check_writable(self.out, "eval.output_dir")

    def run(self) -> dict:
        edge, e, p, rewards, runs, samples = self.edge, self.e, self.p, self.rewards, self.runs, self.samples
        model, data, spec = edge.model, edge.data, edge.spec
        source = edge.source()
        options = eval_options(p, spec)
        edits = generate(model, p, spec, (source, samples), runs, [int(s) for s in e.seeds])
        categories = row_categories(data.path, samples)
        rows = [
            reference_row(s, edits[next(iter(runs))][0][i].size, spec, categories.get(s.id))
            for i, s in enumerate(samples)
        ]
        report = {
            "data": {"path": str(data.path), "rows": len(samples), "skipped": self.skipped},
            "seeds": [int(s) for s in e.seeds],
            "sampling": asdict(options),
            "directions": {name: direction(r) for name, r in rewards.items()},
            "rewards": {name: describe(e.rewards[name], r) for name, r in rewards.items()},
            "runs": {
                name: {"lora": None if lora is None else str(lora), **score_run(rewards, rows, edits[name], e)}
                for name, lora in runs.items()
            },
        }
        write_outputs(report, rows, edits, samples, e, self.out)
        return report


def lora_runs(loras: list[str], model: ModelConfig, predict: PredictConfig, spec: ModelSpec) -> dict[str, Path | None]:
    """Run name -> LoRA file (None: the base model), in the order of `eval.loras`; a LoRA's name is the shortest end
    of its path that tells it from the others, qie's own file names left out (`lora` for a run's final
    `lora/pytorch_lora_weights.safetensors`, `step-000100` for a checkpoint's, `a/lora` and `b/lora` for two runs').

    Raises:
        ConfigError: no runs, a LoRA trained on another fused base (unless `predict.allow_other_base`);
        ModelLoadError: a LoRA file that does not exist.
    """
    if not loras:
        raise ConfigError("eval.loras is empty: list the runs, e.g. 'eval.loras=[none,lora.safetensors]'")
    base, files = fused_base(model, spec), []
    for entry in loras:
        file = None if str(entry).lower() in ("none", "base") else lora_file(entry)
        if file is not None and (warning := check_lora_base(file, base, predict.allow_other_base)):
            print(f"eval: warning: {warning}")
        files.append(file)
    return dict(zip(run_names(files), files))


def run_names(files: list[Path | None]) -> list[str]:
    """Each LoRA file's name among `files` (None: the base model, `BASE`): the fewest last parts of its path, its
    suffix and qie's own file names (`pytorch_lora_weights`, ...) left out, that no other file's name shares."""
    generic = {Path(name).stem for name in (LORA_FILE, COMFYUI_FILE, KOHYA_FILE)}
    whole = [None if f is None else [*f.parent.resolve().parts[1:], f.stem] for f in files]
    short = [None if p is None else p[:-1] + [s for s in p[-1:] if s not in generic] for p in whole]
    # Two files of one folder, both of qie's own names: their stems tell them apart.
    parts = [
        p if p is None or not any(q == p and w != whole[i] for q, w in zip(short, whole)) else whole[i]
        for i, p in enumerate(short)
    ]
    names = []
    for i, own in enumerate(parts):
        if own is None:
            names.append(BASE)
            continue
        others = [p for j, p in enumerate(parts) if j != i and p is not None and p != own]
        depth = 1
        while depth < len(own) and any(o[-depth:] == own[-depth:] for o in others):
            depth += 1
        names.append("/".join(own[-depth:]))
    return names


def heldout_rows(data: DataConfig, state_dir: str | None, rewards: dict[str, Reward]) -> tuple[list[Sample], list]:
    """The rows of `data.path` (targets optional) and the rows skipped ("id: why").

    Raises:
        ConfigError: rows without a target (or, for a reward that needs the edit region, without a target or a
            mask) while such a reward is configured, naming the first row and the rewards.
    """
    dataset = read_data(data_source(data, state_dir), require_target=False)
    skipped = [f"{d.id}: {d.reason}" for d in dataset.problems]
    for line in skipped:
        print(f"eval: skipped {line}")
    for need, lacks, what in (
        ("target", lambda s: s.target is None, "no target"),
        ("mask", lambda s: s.target is None and s.mask is None, "neither a target nor a mask"),  # the edit region's
    ):
        users = [name for name, r in rewards.items() if need in r.needs]
        missing = [s for s in dataset.samples if lacks(s)]
        if users and missing:
            names = " ".join(f"~eval.rewards.{n}" for n in users)
            raise ConfigError(
                f"{len(missing)} row(s) of {data.path} have {what} (first: {missing[0].id!r}), which "
                f"eval.rewards.{users[0]} compares with: give them targets, or drop those metrics ({names})"
            )
    return dataset.samples, skipped


def generate(
    model: ModelConfig,
    predict: PredictConfig,
    spec: ModelSpec,
    held: tuple[Any, list[Sample]],
    runs: dict[str, Path | None],
    seeds: list[int],
) -> dict:
    """Run name -> per seed, each row's edit (its first image). `held`: the embedding source and the rows. The base
    model samples first, then each LoRA loaded in turn; the transformer is freed afterwards."""
    source, samples = held
    options = eval_options(predict, spec)
    # cache.mode=cached reads the cache only: a miss is refused, naming the precompute command (lazy: encoded).
    inputs, negatives = validation_inputs(source, samples, options.negative_prompt, encode=source.encodes)
    devices = {"transformer": predict.devices.transformer, "vae": predict.devices.vae}
    parts = load_parts(
        LoadSettings.of(model),
        spec,
        ["transformer", "scheduler", "vae"],
        devices,
        False,
        fused_base(model, spec).fuse_into,
    )
    edits = {}
    for name in sorted(runs, key=lambda n: runs[n] is not None):  # the base model before any LoRA is loaded
        if runs[name] is not None:
            load_lora(parts.transformer, runs[name], predict.lora_scale)
        edits[name] = []
        for seed in seeds:
            validator = Validator(
                inputs,
                negatives,
                scheduler=parts.scheduler,
                vae=parts.vae,
                logger=None,
                options=replace(options, seed=seed),
                spec=spec,
                pipeline_config=parts.pipeline_config,
            )
            edits[name].append([images[0] for images in validator.sample(parts.transformer)])
        print(f"eval: {name}: edited {len(samples)} row(s) at {len(seeds)} seed(s)")
    del parts
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return edits


def eval_options(predict: PredictConfig, spec: ModelSpec) -> SamplingOptions:
    """The sampling options of the `predict` group, the model's defaults where it leaves them None."""
    return sampling_options(predict).resolved(spec.call_defaults())


def score_run(rewards: dict[str, Reward], rows: list[Row], edits: list[list[Image.Image]], e: EvalConfig) -> dict:
    """A run's `metrics`, `categories` and `samples` (`qie.evaluation.scoring.summarize`), each reward given at
    most `eval.reward_timeout` seconds per edit."""
    timeout = e.reward_timeout
    scores = [
        [score_row(rewards, to_tensor(image).float(), row, "eval.rewards", timeout) for image, row in zip(images, rows)]
        for images in edits
    ]
    return summarize(rows, scores, [int(s) for s in e.seeds], list(rewards))


def describe(node: Mapping[str, Any], reward: Reward) -> dict[str, Any]:
    """What eval.json records of a reward: its class (`node`: its settings in the typed `eval` group), which way is
    better, what it compares with, `describe()`."""
    return {
        "target": str(node["_target_"]),
        "higher_is_better": bool(reward.higher_is_better),
        "needs": sorted(reward.needs),
        **reward.describe(),
    }


def write_outputs(report: dict, rows: list[Row], edits: dict, samples: list[Sample], e: EvalConfig, out: Path) -> None:
    """eval.json, eval.md and eval.png in `out`; prints the table and where they are."""
    blank = Image.new("RGB", edits[next(iter(edits))][0][0].size, "white")
    pictures = []
    for i, sample in enumerate(samples):
        control = open_image(sample.controls[0]) if sample.controls else blank
        target = open_image(sample.target) if sample.target is not None else blank
        pictures.append([control, target, *(edits[name][0][i] for name in report["runs"])])
    written = [
        reports.write_json(report, out),
        reports.write_markdown(report, out),
        reports.write_picture(pictures, [r.prompt for r in rows], list(report["runs"]), int(e.tile), out),
    ]
    print(reports.markdown(report), end="")
    print(f"eval: wrote {', '.join(str(p) for p in written)}")
