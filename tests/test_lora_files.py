"""LoRA files as other tools read them: trained at rank 4 / alpha 8, every file written (diffusers, ComfyUI,
kohya) gives the trained weight change in qie, in diffusers and under ComfyUI's key mapping, for every family."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from diffusers import AutoModel
from helpers import small_config
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file

from qie.adapters.kinds import is_adapter_param
from qie.adapters.lora import LORA_FILE, add_lora, load_lora, save_lora
from qie.adapters.lora_files import COMFYUI_FILE, KOHYA_FILE
from qie.errors import ModelLoadError

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
KINDS = {"lora": {}, "dora": {"use_dora": True}, "loha": {"adapter": "loha"}, "lokr": {"adapter": "lokr"}}


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


def comfyui_patch(lora: dict[str, torch.Tensor], name: str, weight: torch.Tensor) -> tuple[torch.Tensor, set] | None:
    """The weight ComfyUI makes of `weight` from the tensors under `name` at strength 1, and the keys it read;
    None when the file holds none. LoRA: up @ down; LoHa: (w1_a @ w1_b) * (w2_a @ w2_b); LoKr: kron(w1, w2) with
    w1 / w2 given whole or as a product; times alpha / (rank or last decomposed inner size) when `.alpha` is there;
    DoRA (`.dora_scale` d per output row): (W + change) * d / ||W|| per row."""
    used: set[str] = set()

    def get(suffix: str) -> torch.Tensor | None:
        key = name + suffix
        if key in lora:
            used.add(key)
            return lora[key].float()
        return None

    alpha, change, inner = get(".alpha"), None, None
    for up_key, down_key in UP_DOWN:
        if name + up_key in lora:
            up, down = get(up_key), get(down_key)
            change, inner = up @ down, down.shape[0]
            break
    if name + ".hada_w1_a" in lora:
        w1_b, w2_b = get(".hada_w1_b"), get(".hada_w2_b")
        change, inner = (get(".hada_w1_a") @ w1_b) * (get(".hada_w2_a") @ w2_b), w1_b.shape[0]
    if any(name + f".lokr_{p}" in lora for p in ("w1", "w2", "w1_a", "w2_a")):
        w1, w2 = get(".lokr_w1"), get(".lokr_w2")
        if w1 is None:
            w1_b = get(".lokr_w1_b")
            w1, inner = get(".lokr_w1_a") @ w1_b, w1_b.shape[0]
        if w2 is None:
            w2_b = get(".lokr_w2_b")
            w2, inner = get(".lokr_w2_a") @ w2_b, w2_b.shape[0]
        change = torch.kron(w1, w2)
    if change is None:
        return None
    scale = alpha.item() / inner if alpha is not None and inner is not None else 1.0
    patched = weight + scale * change.reshape(weight.shape)
    dora_scale = get(".dora_scale")
    if dora_scale is not None:
        patched = patched * dora_scale / (weight.norm(dim=1, keepdim=True) + torch.finfo(weight.dtype).eps)
    return patched, used


def comfyui_weights(lora: dict[str, torch.Tensor], model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], set]:
    """(module -> patched weight, the file's keys ComfyUI leaves unused ("lora key not loaded"))."""
    modules, weights, used = dict(model.named_modules()), {}, set()
    for name, module in comfyui_names(model).items():
        found = comfyui_patch(lora, name, modules[module].weight.detach().float())
        if found is not None:
            weights[module], keys = found
            used |= keys
    return weights, set(lora) - used


def trained_transformer(path: Path, targets: list[str], kind: str = "lora") -> tuple[torch.nn.Module, dict]:
    """A tiny transformer with a rank-4 / alpha-8 adapter of random weights; its merged weights per module."""
    transformer = AutoModel.from_pretrained(str(path), subfolder="transformer")
    add_lora(transformer, RANK, ALPHA, targets, **KINDS[kind])
    generator = torch.Generator().manual_seed(0)
    for name, p in transformer.named_parameters():
        if is_adapter_param(name):
            noise = torch.randn(p.shape, generator=generator) * 0.1
            p.data = p.data * (1 + noise) if "magnitude" in name else noise
    return transformer, merged_weights(transformer)


def merged_weights(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Per adapted module, its weight with the adapter merged in (peft's own merge)."""
    out = {}
    for name, m in transformer.named_modules():
        if isinstance(m, BaseTunerLayer):
            merged = copy.deepcopy(m)
            merged.merge()
            out[name] = merged.get_base_layer().weight.detach().float()
    return out


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, weight in expected.items():
        torch.testing.assert_close(got[name], weight, rtol=1e-5, atol=2e-6, msg=name)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("preset", list(FAMILIES))
def test_every_file_gives_the_trained_weights(
    preset: str, kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    path = request.getfixturevalue(FAMILIES[preset])
    targets = list(small_config("train", f"model={preset}").model.lora_target_modules)
    transformer, expected = trained_transformer(path, targets, kind)
    assert {m.scaling["default"] for m in transformer.modules() if isinstance(m, BaseTunerLayer)} == {ALPHA / RANK}
    save_lora(transformer, tmp_path, ("comfyui", "kohya"))

    base = AutoModel.from_pretrained(str(path), subfolder="transformer")
    for file in (LORA_FILE, COMFYUI_FILE, KOHYA_FILE):
        if kind != "lora" and file == LORA_FILE:
            continue  # peft's names (DoRA: lora_magnitude_vector) under `transformer.`; ComfyUI reads the other two
        # ComfyUI: every key is used, and the strength is the trained one (the bug: 0.5x at rank 4 / alpha 8).
        weights, unused = comfyui_weights(load_file(str(tmp_path / file)), base)
        assert unused == set(), file
        assert_same(weights, expected)

    # qie (what qie.infer and train.init_lora load) reproduces the trained weights from its own file, and
    # from the other tools' files for a plain LoRA
    for file in (LORA_FILE, COMFYUI_FILE, KOHYA_FILE):
        fresh = AutoModel.from_pretrained(str(path), subfolder="transformer")
        if kind == "lora" or file == LORA_FILE:
            load_lora(fresh, tmp_path / file)
            assert_same(merged_weights(fresh), expected)
        else:
            with pytest.raises(ModelLoadError, match="load the pytorch_lora_weights.safetensors"):
                load_lora(fresh, tmp_path / file)

    if kind in ("lora", "dora"):  # diffusers' own loader, reading the adapter metadata from the file
        fresh = AutoModel.from_pretrained(str(path), subfolder="transformer")
        fresh.load_lora_adapter(str(tmp_path), weight_name=LORA_FILE, prefix="transformer", adapter_name="d")
        assert_same(merged_weights(fresh), expected)


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
