"""LoRA files as other tools read them: trained at rank 4 / alpha 8, every file written (diffusers, ComfyUI,
kohya) gives the trained weight change in qie, in diffusers and under ComfyUI's key mapping, for every family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import AutoModel
from helpers import small_config
from safetensors.torch import load_file

from qie.training.lora import LORA_FILE, add_lora, load_lora, save_lora
from qie.training.lora_files import COMFYUI_FILE, KOHYA_FILE

FAMILIES = {  # model preset -> the fixture that builds its tiny checkpoint
    "tiny": "tiny_path",
    "tiny_edit_2511": "tiny_2511_path",
    "tiny_t2i": "tiny_t2i_path",
    "tiny_qwen_image_21": "tiny21_path",
}
RANK, ALPHA = 4, 8


# ComfyUI's LoRA loading (comfy/lora.py: model_lora_keys_unet, load_lora; comfy/weight_adapter/lora.py), as far
# as a linear LoRA goes: each weight `diffusion_model.<m>.weight` of the model is reachable under several names
# (kohya's `lora_unet_<m, dots as underscores>`, `diffusion_model.<m>`, and for Qwen-Image `<m>`,
# `transformer.<m>`, `lycoris_<m_>`); a name with an up/down pair in the file patches that weight by
# up @ down, times alpha / rank when the file holds `<name>.alpha` and times 1 when it does not.
UP_DOWN = [
    (".lora_up.weight", ".lora_down.weight"),
    ("_lora.up.weight", "_lora.down.weight"),
    (".lora_B.weight", ".lora_A.weight"),
    (".lora.up.weight", ".lora.down.weight"),
    (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
]


def comfyui_names(model: torch.nn.Module) -> dict[str, str]:
    """Every name ComfyUI accepts for a model weight -> that weight's module name."""
    names = {}
    for module, m in model.named_modules():
        if isinstance(getattr(m, "weight", None), torch.Tensor) and module:
            flat = module.replace(".", "_")
            for name in (f"lora_unet_{flat}", f"diffusion_model.{module}", module, f"transformer.{module}",
                         f"lycoris_{flat}"):  # fmt: skip
                names[name] = module
    return names


def comfyui_deltas(lora: dict[str, torch.Tensor], names: dict[str, str]) -> tuple[dict[str, torch.Tensor], set]:
    """(module -> weight change ComfyUI applies at strength 1, the file's keys it leaves unused)."""
    deltas, used = {}, set()
    for name, module in names.items():
        alpha = lora.get(f"{name}.alpha")
        for up_key, down_key in UP_DOWN:
            up, down = lora.get(name + up_key), lora.get(name + down_key)
            if up is None or down is None:
                continue
            scale = alpha.item() / down.shape[0] if alpha is not None else 1.0
            deltas[module] = scale * (up.float() @ down.float())
            used |= {name + up_key, name + down_key} | ({f"{name}.alpha"} if alpha is not None else set())
            break
    return deltas, set(lora) - used


def trained_transformer(path: Path, targets: list[str]) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny transformer with a rank-4 / alpha-8 LoRA of random up and down weights; its weight changes."""
    transformer = AutoModel.from_pretrained(str(path), subfolder="transformer")
    add_lora(transformer, RANK, ALPHA, targets)
    generator = torch.Generator().manual_seed(0)
    for name, p in transformer.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape, generator=generator) * 0.1
    deltas = {n: m.get_delta_weight("default") for n, m in transformer.named_modules() if hasattr(m, "lora_A")}
    return transformer, deltas


def loaded_deltas(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.get_delta_weight(m.active_adapters[0]) for n, m in transformer.named_modules() if hasattr(m, "lora_A")}


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, delta in expected.items():
        torch.testing.assert_close(got[name], delta, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("preset", list(FAMILIES))
def test_every_file_gives_the_trained_weight_change(
    preset: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    path = request.getfixturevalue(FAMILIES[preset])
    targets = list(small_config("train", f"model={preset}").model.lora_target_modules)
    transformer, expected = trained_transformer(path, targets)
    assert {m.scaling["default"] for m in transformer.modules() if hasattr(m, "lora_A")} == {ALPHA / RANK}
    save_lora(transformer, tmp_path, ("comfyui", "kohya"))

    comfy_names = comfyui_names(AutoModel.from_pretrained(str(path), subfolder="transformer"))
    for file in (LORA_FILE, COMFYUI_FILE, KOHYA_FILE):
        # ComfyUI: every key is used, and the strength is the trained one (the bug: 0.5x at rank 4 / alpha 8).
        deltas, unused = comfyui_deltas(load_file(str(tmp_path / file)), comfy_names)
        assert unused == set(), file
        assert_same(deltas, expected)
        # qie (what qie.infer and train.init_lora load)
        fresh = AutoModel.from_pretrained(str(path), subfolder="transformer")
        load_lora(fresh, tmp_path / file)
        assert_same(loaded_deltas(fresh), expected)

    # diffusers' own loader, reading the adapter metadata from the file
    fresh = AutoModel.from_pretrained(str(path), subfolder="transformer")
    fresh.load_lora_adapter(str(tmp_path), weight_name=LORA_FILE, prefix="transformer", adapter_name="d")
    assert_same(loaded_deltas(fresh), expected)


def test_kohya_and_comfyui_key_names(tiny_path: Path, tmp_path: Path) -> None:
    transformer, _ = trained_transformer(tiny_path, ["to_q", "to_out.0", "img_mlp.net.0.proj"])
    save_lora(transformer, tmp_path, ("comfyui", "kohya"))
    kohya, comfy = load_file(str(tmp_path / KOHYA_FILE)), load_file(str(tmp_path / COMFYUI_FILE))
    stem = "lora_unet_transformer_blocks_0_img_mlp_net_0_proj"
    assert {f"{stem}.lora_down.weight", f"{stem}.lora_up.weight", f"{stem}.alpha"} <= set(kohya)
    assert kohya[f"{stem}.alpha"].item() == RANK  # the scale is in the weights: alpha = rank means 1.0
    assert "diffusion_model.transformer_blocks.0.attn.to_out.0.lora_up.weight" in comfy
    # the same modules in both: one down, up and alpha each
    pairs = sum(k.endswith(".lora_A.weight") for k in load_file(str(tmp_path / LORA_FILE)))
    assert len(kohya) == len(comfy) == 3 * pairs
