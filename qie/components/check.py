"""The start-up check: does the checkpoint hold the model the `model` config describes?

A Qwen-Image checkpoint paired with an Edit config (or an Edit-2509 config with a 2511 checkpoint) loads
and runs, but trains and samples wrongly. The check reads only JSON files (model_index.json and the
transformer and VAE configs; for a hub id those alone are fetched) and fails before any part is built.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from qie.components.fingerprint import config_file
from qie.config.model import ModelConfig
from qie.errors import ConfigError, ModelLoadError
from qie.models import CheckpointFacts, ModelSpec, model_spec


def read_facts(source: str, revision: str | None = None) -> CheckpointFacts:
    """What the checkpoint at `source` says about itself; a file it lacks leaves its fields None."""
    index = _read_json(source, "model_index.json", revision)
    if not isinstance(index.get("_class_name", ""), str):
        raise ModelLoadError(
            f"{source}: model_index.json's _class_name is {index['_class_name']!r}, not a "
            "pipeline class name: fix that file or point model.pretrained_model_name_or_path "
            "elsewhere"
        )
    transformer = _read_json(source, "transformer/config.json", revision)
    vae = _read_json(source, "vae/config.json", revision)
    return CheckpointFacts(
        pipeline_class=index.get("_class_name"),
        zero_cond_t=bool(transformer.get("zero_cond_t", False)) if transformer else None,
        patch_size=transformer.get("patch_size"),
        in_channels=transformer.get("in_channels"),
        out_channels=transformer.get("out_channels"),
        latent_channels=vae.get("z_dim"),
    )


def check_checkpoint(spec: ModelSpec, model: ModelConfig, source: str) -> None:
    """Compare the checkpoint at `source` with the model `spec` describes (skipped when `model.check=false`):
    first whether it is that pipeline at all, then the transformer's facts, then the family's own rules on the
    checkpoint's files (`ModelFamily.checkpoint_problems`).

    Raises:
        ConfigError: naming the config, what the checkpoint is, the `model=` that fits it, and the override.
    """
    if not model.check:
        return
    revision = model.revision
    found = read_facts(source, revision)
    problems = spec.mismatches(found)
    if not problems:
        problems = spec.family.checkpoint_problems(spec, lambda relative: _read_json(source, relative, revision))
        if problems:
            raise ConfigError(
                f"model={spec.name} cannot use the checkpoint {source}: {'; '.join(problems)}.\n"
                "Or set model.check=false to use it anyway"
            )
        return
    fits = fitting_models(found)
    hint = (
        f"use {' or '.join(f'model={name}' for name in fits)} (with model.pretrained_model_name_or_path={source})"
        if fits
        else "no model config of qie describes this checkpoint"
    )
    raise ConfigError(
        f"model={spec.name} does not match the checkpoint {source}: {'; '.join(problems)}.\n"
        f"{hint}, or set model.check=false to use it anyway"
    )


def pipeline_config(source: str, revision: str | None = None) -> dict:
    """The checkpoint's model_index.json (the pipeline's settings, e.g. 2.1's `sample_sigmas`); {} without one."""
    return _read_json(source, "model_index.json", revision)


def fitting_models(found: CheckpointFacts) -> list[str]:
    """The `model=` names of qie's model yamls that describe a checkpoint like `found` (real models first,
    then the tiny ones), for the hint of a mismatch."""
    from omegaconf import OmegaConf

    from qie.config.tree import conf_dir

    fits = []
    for path in conf_dir().joinpath("model").iterdir():
        if path.name.endswith(".yaml"):
            model = ModelConfig.of_values(OmegaConf.to_container(OmegaConf.create(path.read_text(encoding="utf-8"))))
            if not model_spec(model).mismatches(found):
                fits.append((bool(model.tiny), model.name))
    return [name for _, name in sorted(fits)]


def _read_json(source: str, relative: str, revision: str | None) -> dict:
    # A local folder is read each time (it may change within a process); a hub snapshot is fetched once.
    text = _read_text(source, relative, revision) if Path(source).is_dir() else _hub_text(source, relative, revision)
    try:
        data = json.loads(text or "{}")
    except ValueError:  # a broken file: loading the part will say what is wrong
        return {}
    return data if isinstance(data, dict) else {}


@lru_cache(maxsize=64)
def _hub_text(source: str, relative: str, revision: str | None) -> str | None:
    return _read_text(source, relative, revision)


def _read_text(source: str, relative: str, revision: str | None) -> str | None:
    try:
        path = config_file(source, relative, revision)
        return path.read_text(encoding="utf-8") if path.is_file() else None
    except (OSError, ValueError):  # an unreachable hub: loading the part will say what is wrong
        return None
