"""`model.transformer_path` as one safetensors file: diffusers' layout and ComfyUI's (prefixed, fp8, fp8 scaled),
for every family, through diffusers' `from_single_file`; a file of another family is refused with the right hint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import CachedData, small_config
from safetensors.torch import load_file, save_file

from qie.config import typed
from qie.errors import ConfigError, ModelLoadError

FAMILY_MODELS = {"qwen_image": ("tiny", "tiny_path"), "qwen_image_21": ("tiny_qwen_image_21", "tiny21_path")}
# fp8 scaled: one scale per tensor (`scale_weight`, ComfyUI's fp8_scaled files), or one per row (`weight_scale`).
LAYOUTS = ("diffusers", "comfyui", "comfyui_fp8", "comfyui_fp8_scaled", "comfyui_fp8_scaled_rows")
# fp8 e4m3 rounds a weight to 3 mantissa bits: off by at most 1/16 of it, or by half the subnormal step
# (2^-10) below 2^-6. A per-tensor scale (absmax / 448) moves a tensor into fp8's range: then each weight is off
# by at most half fp8's top step (16) times the scale. The training loss of a fixed batch then moves by < 1e-3
# of itself (measured: <= 4e-5 on both tiny families).
FP8_LOSS_TOLERANCE = 1e-3


def fp8_error_bound(state: dict[str, torch.Tensor], key: str, scaled: bool) -> torch.Tensor:
    weight = state[key]
    if scaled:  # 2.1's gate and up projections share the fused matrix's scale
        fused = [
            state.get(key.replace(a, b), weight) for a, b in (("gate_layer", "proj"), ("mlp.proj", "mlp.gate_layer"))
        ]
        return torch.full_like(weight, 16 * max(t.abs().max() for t in [weight, *fused]) / 448.0)
    return torch.maximum(weight.abs() / 16, torch.full_like(weight, 2.0**-10))


def write_layout(state: dict[str, torch.Tensor], layout: str, path: Path) -> Path:
    """Writes `state` (a diffusers transformer's) as a single file in one of the layouts users have."""
    out = {k: v.clone().contiguous() for k, v in state.items()}
    if layout != "diffusers":
        fused = {}
        for key, value in out.items():
            # ComfyUI fuses 2.1's SwiGLU gate and up projections into one matrix, gate rows first.
            if key.endswith("img_mlp.gate_layer.weight"):
                fused[key.replace("gate_layer", "gate_up")] = torch.cat([value, out[key.replace("gate_layer", "proj")]])
            elif not key.endswith("img_mlp.proj.weight") or key.replace("proj", "gate_layer") not in out:
                fused[key] = value
        out = {f"model.diffusion_model.{k}": v for k, v in fused.items()}
    if layout.startswith("comfyui_fp8"):
        for key in [k for k, v in out.items() if "transformer_blocks" in k and k.endswith(".weight") and v.ndim == 2]:
            weight = out[key].float()
            if layout.endswith("scaled"):
                scale = weight.abs().max() / 448.0
                out[key.removesuffix(".weight") + ".scale_weight"] = scale.reshape(1)
                weight = weight / scale
            elif layout.endswith("rows"):
                scale = weight.abs().amax(dim=1, keepdim=True) / 448.0
                out[key.removesuffix(".weight") + ".weight_scale"] = scale
                weight = weight / scale
            out[key] = weight.to(torch.float8_e4m3fn)
        if "scaled" in layout:
            out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(out, str(path))
    return path


def step_loss(spec, transformer) -> float:
    """The family's training loss of one fixed small batch."""
    from qie.stages.memory_plan import Workload

    gen = torch.Generator().manual_seed(0)
    work = Workload(batch=1, target_tokens=16, control_tokens=(16,), prompt_tokens=8, dtype=torch.float32)
    make = lambda *shape, dtype: torch.randn(*shape, generator=gen, dtype=dtype)  # noqa: E731
    batch, noise, sigmas = spec.family.planner.step_inputs(dict(transformer.config), work, make)
    with torch.no_grad():
        return float(spec.family.loss(transformer, batch, noise, sigmas, "none"))


@pytest.mark.parametrize("family", sorted(FAMILY_MODELS))
def test_a_single_file_in_every_layout_loads_like_the_folder(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from stage_edges import parts_of

    from qie.components import prepare_model

    model, fixture = FAMILY_MODELS[family]
    request.getfixturevalue(fixture)
    cfg = small_config("train", f"model={model}")
    spec = prepare_model(typed(cfg.model))
    folder = parts_of(cfg.model, ["transformer"], spec=spec).transformer
    want = step_loss(spec, folder)
    for layout in LAYOUTS:
        path = write_layout(folder.state_dict(), layout, tmp_path / f"{layout}.safetensors")
        cfg = small_config("train", f"model={model}", f"model.transformer_path={path}")
        prepare_model(typed(cfg.model))  # the start-up check recognises the family from the file's keys
        loaded = parts_of(cfg.model, ["transformer"], spec=spec).transformer
        config = {k: v for k, v in folder.config.items() if k != "_name_or_path"}
        assert type(loaded) is type(folder) and {k: loaded.config[k] for k in config} == config
        got = step_loss(spec, loaded)
        saved, fp8 = folder.state_dict(), layout.startswith("comfyui_fp8")
        for key, value in loaded.state_dict().items():
            if fp8 and "transformer_blocks" in key and value.ndim == 2:
                bound = fp8_error_bound(saved, key, "scaled" in layout)
                assert ((value - saved[key]).abs() <= bound * 1.0001).all(), (layout, key)
            else:
                assert torch.equal(value, saved[key]), (layout, key)
        if fp8:
            assert abs(got - want) <= FP8_LOSS_TOLERANCE * abs(want) and got != want, (layout, got, want)
        else:
            assert got == want, layout


def test_a_file_of_another_family_is_refused_naming_the_right_model(
    tiny_path: Path, tiny21_path: Path, tmp_path: Path
) -> None:
    from diffusers import QwenImage21Transformer2DModel, QwenImageTransformer2DModel

    from qie.components import prepare_model

    f21 = write_layout(
        QwenImage21Transformer2DModel.from_pretrained(tiny21_path / "transformer").state_dict(),
        "comfyui",
        tmp_path / "q21.safetensors",
    )
    with pytest.raises(ConfigError, match=r"qwen_image_21 transformer.*use model=qwen_image_21, model=tiny_qwen"):
        prepare_model(typed(small_config("train", f"model.transformer_path={f21}").model))
    edit = write_layout(
        QwenImageTransformer2DModel.from_pretrained(tiny_path / "transformer").state_dict(),
        "comfyui_fp8_scaled",
        tmp_path / "edit.safetensors",
    )
    with pytest.raises(ConfigError, match=r"qwen_image transformer.*use model=qwen_image, model=qwen_image_2512, "):
        prepare_model(typed(small_config("train", "model=tiny_qwen_image_21", f"model.transformer_path={edit}").model))


def test_a_file_that_is_not_a_whole_transformer_is_one_line(tiny_path: Path, tmp_path: Path) -> None:
    from diffusers import QwenImageTransformer2DModel
    from stage_edges import parts_of

    from qie.components import prepare_model

    state = QwenImageTransformer2DModel.from_pretrained(tiny_path / "transformer").state_dict()
    part = {k: v for k, v in state.items() if "transformer_blocks.1." not in k}
    path = write_layout(part, "diffusers", tmp_path / "part.safetensors")
    cfg = small_config("train", f"model.transformer_path={path}")
    prepare_model(typed(cfg.model))
    with pytest.raises(ModelLoadError, match=r"lacks \d+ weight\(s\).*transformer_blocks\.1\."):
        parts_of(cfg.model, ["transformer"])
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="is not a safetensors file"):
        prepare_model(typed(small_config("train", f"model.transformer_path={tmp_path / 'junk.safetensors'}").model))


@pytest.mark.parametrize(
    "override,says",
    [
        ("model.vae_path=/models/vae/qwen_image_vae.safetensors", "no Qwen-Image VAE class"),
        ("model.text_encoder_path=/models/text_encoders/qwen_2.5_vl_7b.safetensors", "no single-file loader"),
    ],
)
def test_a_vae_or_text_encoder_file_is_refused_saying_what_to_pass(override: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        small_config("train", "model=qwen_image_edit_2511", override)
    message = str(err.value)
    assert "\n" not in message and says in message
    assert "model.pretrained_model_name_or_path='Qwen/Qwen-Image-Edit-2511'" in message


def test_a_file_as_the_base_model_is_refused_saying_what_to_pass(tmp_path: Path) -> None:
    path = tmp_path / "qwen_image_edit_2511_fp8_scaled.safetensors"
    save_file({"x": torch.zeros(1)}, str(path))
    with pytest.raises(ConfigError, match="is one file: give a hub id or a diffusers folder.*model.transformer_path"):
        small_config("train", f"model.pretrained_model_name_or_path={path}")


@pytest.mark.parametrize("family", sorted(FAMILY_MODELS))
def test_fp8_files_can_keep_their_fp8_bytes_and_scales(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from optimum.quanto import QLinear
    from stage_edges import parts_of

    from qie.components import prepare_model

    model, fixture = FAMILY_MODELS[family]
    request.getfixturevalue(fixture)
    cfg = small_config("train", f"model={model}")
    spec = prepare_model(typed(cfg.model))
    state = parts_of(cfg.model, ["transformer"], spec=spec).transformer.state_dict()
    for layout in ("comfyui_fp8", "comfyui_fp8_scaled", "comfyui_fp8_scaled_rows"):
        path = write_layout(state, layout, tmp_path / f"{layout}.safetensors")
        common = [f"model={model}", f"model.transformer_path={path}"]
        upcast = parts_of(small_config("train", *common).model, ["transformer"], spec=spec).transformer
        kept = parts_of(
            small_config("train", *common, "model.single_file_fp8=keep").model, ["transformer"], spec=spec
        ).transformer
        file = load_file(str(path))
        fp8 = [k.removeprefix("model.diffusion_model.") for k, v in file.items() if v.dtype == torch.float8_e4m3fn]
        fp8 = [k for k in fp8 if k.endswith(".weight")]  # not the "scaled_fp8" marker
        modules = dict(kept.named_modules())
        fp8_modules = {n for n, m in modules.items() if isinstance(m, QLinear)}
        # Every fp8 tensor of the file is held as fp8 (2.1's fused gate/up as its two halves), nothing else is.
        split = {k.replace("gate_up", p) for k in fp8 if "gate_up" in k for p in ("gate_layer", "proj")}
        assert fp8_modules == {k.removesuffix(".weight") for k in fp8 if "gate_up" not in k} | {
            k.removesuffix(".weight") for k in split
        }
        for name in fp8_modules:
            weight = modules[name].weight
            assert weight._data.dtype == torch.float8_e4m3fn
            # Its value is the file's fp8 times the file's scale: what upcasting gives, to the last bit.
            assert torch.equal(weight.dequantize(), dict(upcast.named_parameters())[f"{name}.weight"]), name
            raw = file.get(f"model.diffusion_model.{name}.weight")
            if raw is not None:  # the file's own bytes
                assert torch.equal(weight._data.view(torch.uint8), raw.view(torch.uint8)), name
        assert step_loss(spec, kept) == pytest.approx(step_loss(spec, upcast), rel=1e-6)
    with pytest.raises(ConfigError, match="single_file_fp8=keep.*set model.quantize=none"):
        small_config("train", f"model={model}", "model.single_file_fp8=keep", "model.quantize=int4")


def test_a_kept_fp8_file_trains_a_lora(cached_data: CachedData, tmp_path: Path) -> None:
    from diffusers import QwenImageTransformer2DModel

    from qie.stages import train as train_stage

    folder = Path(small_config("train").model.pretrained_model_name_or_path) / "transformer"
    state = QwenImageTransformer2DModel.from_pretrained(folder).state_dict()
    path = write_layout(state, "comfyui_fp8_scaled", tmp_path / "fp8_scaled.safetensors")
    common = [*cached_data.overrides, "train.max_steps=2", "train.learning_rate=1e-3", f"model.transformer_path={path}"]
    runs = {
        how: train_stage.run(small_config("train", *common, f"model.single_file_fp8={how}"), tmp_path / how)
        for how in ("keep", "upcast")
    }
    np.testing.assert_allclose(runs["keep"]["losses"], runs["upcast"]["losses"], rtol=1e-5)
    lora = load_file(str(tmp_path / "keep" / "lora" / "pytorch_lora_weights.safetensors"))
    assert [v for k, v in lora.items() if "lora_B" in k] and all(
        v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k
    )


@pytest.mark.parametrize(
    "stage,override",
    [("train", "train.fsdp=true"), ("train", "train.mode=full"), ("infer", "predict.merge_to=merged")],
)
def test_kept_fp8_weights_refuse_what_needs_plain_weights(stage: str, override: str) -> None:
    keep = ["model.transformer_path=/models/x_fp8_scaled.safetensors", "model.single_file_fp8=keep"]
    with pytest.raises(ConfigError, match=f"{override.split('=')[0]}.*set model.single_file_fp8=upcast"):
        small_config(stage, *keep, override)
    small_config(stage, *keep)  # alone it composes
