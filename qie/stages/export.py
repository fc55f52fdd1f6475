"""The export stage: a Hub-ready folder of a training run (`qie.publish`), uploaded when asked.

    python -m qie.export RUN_DIR OUT [export.push_to_hub=USER/NAME] [export.lora=RUN/checkpoints/step-NNNNNN]

The run's config is the one Hydra recorded (`RUN_DIR/.hydra/config.yaml`; a demo's training run `RUN/train` reads its
demo's), resolved here, at the stage's edge; the library below takes plain values.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from qie.adapters.lora_files import recorded_base
from qie.checks import Checked, check, register
from qie.config.export import ExportConfig
from qie.config.model import ModelConfig
from qie.errors import ConfigError, check_writable
from qie.models import model_spec, variants
from qie.output_files import inputs_problem
from qie.publish.folder import Export, input_files, planned_files, write_export
from qie.publish.hub import push_folder
from qie.publish.run_facts import BaseModel, RunFacts, dataset_instructions, read_run
from qie.reporting.environment import RUN_INFO
from qie.reporting.run_files import read_json
from qie.stages.recipe import Recipe

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# A snapshot folder of the Hugging Face cache: `.../models--Org--Name/snapshots/REV`.
HF_CACHE = re.compile(r"(?:^|/)models--([A-Za-z0-9][\w.-]*?)--([A-Za-z0-9][\w.-]*)/snapshots(?:/|$)")


def run(cfg: DictConfig, run_dir: Path | None = None) -> dict:
    """Write the export folder, print what it holds, and upload it with `export.push_to_hub` (the stage from code:
    `cfg` checked once, `qie.checks.check`, then `start`); returns {"folder", "files", "missing", "url"}.

    Raises:
        ConfigError: `export.run_dir` or `export.out` unset, a run folder without a LoRA to export, an `export.out`
            that holds files already (without `export.overwrite=true`) or one of the export's inputs.
        HubError: the upload cannot be made (offline included): the folder is kept.
    """
    return start(check(cfg), run_dir)


def start(checked: Checked, run_dir: Path | None = None) -> dict:
    """The stage's edge: the checked config's `export` group handed to the `ExportRecipe`. See `run`."""
    return ExportRecipe(checked.root.export).execute()


class ExportRecipe(Recipe):
    """The export stage: `setup()` checks the settings and reads the run folder (its config, LoRA and pictures), and
    refuses an `export.out` that is one of the export's inputs or holds files already (without
    `export.overwrite=true`); `run()` writes the export folder and uploads it when asked.

    Args:
        settings: the `export` group.
    """

    def __init__(self, settings: ExportConfig) -> None:
        self.settings = settings

    def setup(self) -> None:
        settings = self.settings
        for key, value in (("run_dir", settings.run_dir), ("out", settings.out)):
            if not value:
                raise ConfigError(f"export.{key} is not set: python -m qie.export RUN_DIR OUT (or export.{key}=...)")
        run, out = Path(settings.run_dir).expanduser(), Path(settings.out).expanduser()
        if out.resolve() == run.resolve():
            raise ConfigError(f"export.out={settings.out!r} is the run folder itself: give a new folder")
        config = run_config(run)
        facts = read_run(run, config, settings.lora, settings.samples)
        facts.instructions = dataset_instructions((config.get("data") or {}).get("path"))
        if problem := inputs_problem(planned_files(facts, out), input_files(facts), "export.out"):
            raise ConfigError(problem)
        held = sorted(out.iterdir()) if out.is_dir() else []
        if held and not settings.overwrite:
            raise ConfigError(
                f"export.out={settings.out!r} holds files already (first: {held[0].name}): set export.overwrite=true "
                "to replace the export's files there (links among them are replaced, not written through), or choose "
                "an empty or new folder"
            )
        self.out, self.facts = out, facts

    def run(self) -> dict:
        settings, out = self.settings, self.out
        check_writable(out, "export.out")
        written = export_folder(self.facts, out, settings.license, settings.push_to_hub, settings.base_model)
        url = push_folder(out, settings.push_to_hub, settings.private) if settings.push_to_hub else None
        if url:
            print(f"qie: uploaded to {url}")
        return {"folder": str(out), "files": [str(f) for f in written.files], "missing": written.missing, "url": url}


def export_folder(
    facts: RunFacts, out: Path, license: str = "apache-2.0", repo_id: str | None = None, hub_id: str | None = None
) -> Export:
    """Write the export folder of `facts` into `out` (the demo's entry too) and print what it holds; `hub_id`
    (`export.base_model`) names the base's Hub repo where the run's model source does not."""
    written = write_export(facts, base_model(facts.config, facts.lora, hub_id), out, license, repo_id)
    pictures = len(facts.samples) + len(facts.pictures)
    names = ", ".join(f.name for f in written.files)
    print(f"qie: exported {facts.lora} to {out}: {names}, README.md (model card), {pictures} sample picture(s)")
    for name, why in written.missing.items():
        print(f"qie: warning: {name} not written: {why}")
    return written


def run_config(run: Path) -> dict:
    """The run's config as plain values: Hydra's record in the run folder (or in the demo run holding it); {} when
    none is there (a run started from Python). A run of a tiny model on the built-in data set, which Hydra recorded
    without `data.path`, gets the path the run itself recorded (`run_info.json`)."""
    for folder in (run, run.parent) if run.name == "train" else (run,):
        file = folder / ".hydra" / "config.yaml"
        if file.is_file():
            register()  # the `qie_home` resolver its model paths use
            config = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
            recorded = ((read_json(run / RUN_INFO) or {}).get("config") or {}).get("data") or {}
            if isinstance(config.get("data"), dict) and not config["data"].get("path") and recorded.get("path"):
                config["data"]["path"] = recorded["path"]
            return config
    return {}


def hub_id_of(source: str) -> str | None:
    """The Hub id a model source names: itself (`Org/Name`, not a local folder), or the repo of a Hugging Face cache
    snapshot it lies in (`.../models--Org--Name/snapshots/REV`); None for another local folder."""
    if HUB_ID.match(source) and not Path(source).expanduser().exists():
        return source
    found = HF_CACHE.search(Path(source).expanduser().as_posix())
    return f"{found.group(1)}/{found.group(2)}" if found else None


def base_model(config: dict, lora: Path, hub_id: str | None = None) -> BaseModel:
    """The base the LoRA belongs to, from the run's `model` config (else the checkpoints' record of it); `hub_id`
    (`export.base_model`) names its Hub repo where its source does not."""
    fused = tuple((str(r.get("file")), float(r.get("scale", 1.0))) for r in recorded_base(lora) or [])
    model = config.get("model")
    if not model:
        record = _recorded_model(lora)
        pipeline = str(record.get("pipeline", "DiffusionPipeline"))
        takes_images = [v.output_image is not None for _, v in variants().values() if v.pipeline_class == pipeline]
        task = "image-to-image" if any(takes_images) or not takes_images else "text-to-image"
        return BaseModel("(not recorded)", hub_id, pipeline, task, str(record.get("name", "...")), fused)
    spec = model_spec(ModelConfig.of_values(model))
    source = str(model.get("pretrained_model_name_or_path"))
    hub_id = hub_id or hub_id_of(source)
    task = "text-to-image" if spec.family.outputs.demo_data(spec) == "t2i" else "image-to-image"
    return BaseModel(source, hub_id, spec.pipeline_class, task, spec.name, fused)


def _recorded_model(lora: Path) -> dict:
    """The model record of the run's newest checkpoint (`trainer_state.json`), or {}."""
    run = lora.parent.parent
    for state in sorted(run.glob("checkpoints/step-*/trainer_state.json"), reverse=True):
        try:
            return dict(json.loads(state.read_text(encoding="utf-8")).get("model") or {})
        except (OSError, ValueError):
            continue
    return {}
