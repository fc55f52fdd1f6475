"""Trust, fourth round (data): preference pairs whose rejected image is their target are left out; rejected images
are checked at start and never cost a sample that does not train on them; every image kind of every layout is
confined to its data set's folder, symbolic links followed; a LoRA key that does not fit is named as its file
writes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qie.errors import ModelLoadError

# --- a LoRA for another model: the file's own key --------------------------------------------------------


def test_a_lora_for_another_model_is_named_by_the_key_its_file_holds(tiny_path: Path, tmp_path: Path) -> None:
    """A kohya file of another model's modules: diffusers reads `double_blocks_0_img_attn_qkv` as
    `transformer_blocks..attn.qkv`; the message names the file's key."""
    from diffusers import QwenImageTransformer2DModel

    from qie.training.lora import load_lora

    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_path / "transformer")
    file = tmp_path / "flux.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 16),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(48, 4),
               "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(4.0)}, str(file))  # fmt: skip
    with pytest.raises(ModelLoadError) as info:
        load_lora(transformer, file)
    assert str(info.value) == (
        f"LoRA {str(file)!r} does not fit this model: key 'lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight' "
        "names a module the transformer does not have (a LoRA for another model?)"
    )
