"""The export folder of a run: the LoRA in diffusers, ComfyUI and kohya formats, the sample pictures under
`samples/`, and the model card `README.md` (`qie.publish.card`).

The ComfyUI and kohya files the run wrote beside its LoRA (`train.export_comfyui`, `train.export_kohya`) are copied;
otherwise they are made from the diffusers file, whose weights already hold the trained strength
(`qie.adapters.lora_files`). A DoRA needs its base's weights for ComfyUI's `dora_scale`: without the run's own files
it is exported in the diffusers format alone, and the card says so.
"""

from __future__ import annotations

import functools
import shutil
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from qie.adapters.lora import LORA_FILE, PREFIX
from qie.adapters.lora_files import COMFYUI_FILE, KOHYA_FILE, base_header, comfyui_state, kohya_state, recorded_base
from qie.errors import ConfigError
from qie.output_files import real_folder, replace_file
from qie.publish.card import input_name, model_card
from qie.publish.run_facts import EXTRACT_REPORT, BaseModel, RunFacts

CARD_FILE = "README.md"
READERS = {
    LORA_FILE: "diffusers `load_lora_weights`, `qie.infer`, ai-toolkit, ComfyUI",
    COMFYUI_FILE: "ComfyUI (`LoraLoaderModelOnly`), DiffSynth-Studio, `qie.infer`",
    KOHYA_FILE: "musubi-tuner, kohya-style loaders, ComfyUI, `qie.infer`",
}


@dataclass(frozen=True)
class Export:
    """What `write_export` wrote: the folder, its LoRA files, and the formats it could not write (with why)."""

    folder: Path
    files: list[Path]
    missing: dict[str, str]


def write_export(facts: RunFacts, base: BaseModel, out: Path, license: str, where: str | None = None) -> Export:
    """Write the export folder `out` of the run `facts` describes, for the `base` model. Each file is written beside
    its place and renamed onto it (`qie.output_files`): a link of its name is replaced, never written through.

    Args:
        license: the card's license field.
        where: the repo id the card's examples load from (None: the folder's path).

    Raises:
        ConfigError: the LoRA file is not in the diffusers format (`transformer.` keys), or no safetensors file.
    """
    out.mkdir(parents=True, exist_ok=True)
    files, missing = lora_files(facts.lora, out)
    samples = out / "samples"
    if facts.samples or facts.pictures:
        real_folder(samples)
    for picture, _ in facts.pictures:
        copy(picture, samples / picture.name)
    for sample in facts.samples:
        copy(sample.image, samples / sample.image.name)
        if sample.control is not None:
            copy(sample.control, samples / input_name(sample.image))
    if facts.extraction is not None:
        copy(facts.lora.parent / EXTRACT_REPORT, out / EXTRACT_REPORT)
    readers = {f.name: READERS[f.name] for f in files}
    readers.update({name: f"not written: {why}" for name, why in missing.items()})
    card = model_card(facts, base, license, readers, where or str(out))
    replace_file(out / CARD_FILE, lambda tmp: tmp.write_text(card, encoding="utf-8"), "export.out's")
    return Export(out, files, missing)


def planned_files(facts: RunFacts, out: Path) -> list[Path]:
    """The files `write_export` may write into `out` for `facts` (the LoRA formats, the card, the pictures)."""
    pictures = [p for p, _ in facts.pictures] + [s.image for s in facts.samples]
    pictures += [s.image.with_name(input_name(s.image)) for s in facts.samples if s.control is not None]
    names = [LORA_FILE, COMFYUI_FILE, KOHYA_FILE, CARD_FILE, *([EXTRACT_REPORT] if facts.extraction else [])]
    return [out / n for n in names] + [out / "samples" / p.name for p in pictures]


def input_files(facts: RunFacts) -> dict[str, Path]:
    """What the export reads, by what it is: the LoRA and the files beside it, the pictures and their inputs."""
    found = {"the LoRA": facts.lora}
    found.update({f"the LoRA's {name}": facts.lora.parent / name for name in (COMFYUI_FILE, KOHYA_FILE)})
    found.update({f"a sample picture ({p.name})": p for p, _ in facts.pictures})
    for sample in facts.samples:
        found[f"a sample picture ({sample.image.name})"] = sample.image
        if sample.control is not None:
            found[f"a sample's input ({sample.control.name})"] = sample.control
    if facts.extraction is not None:
        found["its extraction report"] = facts.lora.parent / EXTRACT_REPORT
    return found


def copy(source: Path, target: Path) -> Path:
    """Copy `source` onto `target` (a link there replaced, not written through), with the user's mode."""
    return replace_file(target, lambda tmp: shutil.copyfile(source, tmp), "export.out's")


def lora_files(lora: Path, out: Path) -> tuple[list[Path], dict[str, str]]:
    """Copy the diffusers LoRA `lora` into `out` with its ComfyUI and kohya files (copied from beside it, or made
    from it); returns the files written and the formats not written, with why."""
    try:
        with safe_open(str(lora), "pt") as f:
            keys = list(f.keys())
    except SafetensorError as e:
        raise ConfigError(
            f"{str(lora)!r} is not a readable safetensors file ({e}): give export.lora the {LORA_FILE} qie wrote"
        ) from None
    if not keys or not all(k.startswith(PREFIX) for k in keys):
        raise ConfigError(
            f"{str(lora)!r} is not a diffusers-format LoRA (keys '{PREFIX}<module>.lora_A.weight'): give export.lora "
            f"the {LORA_FILE} qie wrote"
        )
    written, missing = [copy(lora, out / LORA_FILE)], {}
    state = None
    for name, convert in ((COMFYUI_FILE, comfyui_state), (KOHYA_FILE, kohya_state)):
        if (lora.parent / name).is_file():
            copy(lora.parent / name, out / name)
        elif any("lora_magnitude_vector" in k for k in keys):
            missing[name] = "a DoRA's ComfyUI scale needs its base weights: train with train.export_comfyui=true"
            continue
        else:
            state = state if state is not None else {k[len(PREFIX) :]: v for k, v in load_file(str(lora)).items()}
            converted, header = convert(state), base_header(recorded_base(lora))
            replace_file(out / name, functools.partial(_save, converted, header), "export.out's")
        written.append(out / name)
    return written, missing


def _save(state: dict, header: dict | None, path: Path) -> None:
    save_file(state, str(path), metadata=header)
