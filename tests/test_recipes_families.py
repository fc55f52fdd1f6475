"""Every training recipe at once through the train stage, for each family's tiny model (live mode, 2 steps):
masked / edit-region loss, EMA, regularisation data, reference dropout, starting from a kohya LoRA file, the
exports. (LoHa / LoKr / DoRA per family: test_lora_files.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from diffusers import AutoModel
from helpers import small_config
from PIL import Image
from safetensors.torch import load_file

from qie.adapters.lora import add_lora, save_lora
from qie.demo.synthetic import make_dataset
from qie.stages import train as train_stage

FAMILIES = {  # preset -> (its fixture, takes control images, may drop them)
    "tiny_edit_2511": ("tiny_2511_path", True, True),
    "tiny_t2i": ("tiny_t2i_path", False, False),
    "tiny_qwen_image_21": ("tiny21_path", True, True),
}


def data_set(root: Path, seed: int, controls: bool) -> Path:
    make_dataset(root, train=2, heldout=0, size=64, seed=seed)
    data = root / "train"
    if not controls:
        shutil.rmtree(data / "control_images")
    (data / "masks").mkdir()
    for target in (data / "training_images").glob("*.png"):
        mask = Image.new("L", (64, 64), 0)
        mask.paste(255, (0, 0, 32, 64))
        mask.save(data / "masks" / target.name)
    return data


@pytest.mark.parametrize("preset", list(FAMILIES))
def test_every_recipe_trains_each_family(preset: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    fixture, controls, drops = FAMILIES[preset]
    path = request.getfixturevalue(fixture)
    data, reg = data_set(tmp_path / "main", 0, controls), data_set(tmp_path / "reg", 1, controls)
    common = [f"model={preset}", "cache=none", f"data.path={data}", "train.max_steps=2", "train.learning_rate=1e-3"]
    # A kohya-format LoRA (rank 4, alpha 8) to start from, as another tool would hand it over.
    transformer = AutoModel.from_pretrained(str(path), subfolder="transformer")
    add_lora(transformer, 4, 8, list(small_config("train", f"model={preset}").model.lora_target_modules))
    save_lora(transformer, tmp_path / "first", ("kohya",))
    recipes = [
        f"train.init_lora={tmp_path / 'first' / 'kohya_lora.safetensors'}",
        "train.export_comfyui=true",
        f"train.mask.source={'edit' if controls else 'file'}",
        "train.mask.outside_weight=0.2",
        "train.ema.decay=0.9",
        f"data.regularization.path={reg}",
        "data.regularization.ratio=0.5",
        *(["data.control_dropout_rate=0.5"] if drops else []),
    ]
    result = train_stage.run(small_config("train", *common, *recipes), tmp_path / "run")
    assert result["step"] == 2 and len(result["losses"]) == 2
    assert load_file(result["ema_lora"]).keys() == load_file(result["lora"]).keys()
    assert (Path(result["lora"]).parent / "comfyui_lora.safetensors").is_file()
