"""A transformer from one safetensors file, as users have them: diffusers' single-file layout or ComfyUI's.

ComfyUI's `diffusion_models/*.safetensors` files use diffusers' module names, optionally under
`model.diffusion_model.`, and are often stored as fp8 e4m3fn: plain, or "fp8 scaled" with a per-tensor
`<module>.scale_weight` (newer files: `weight_scale`) and a `scaled_fp8` marker. qie removes the prefix and the
markers, upcasts fp8 weights (times their scale) to the model's dtype, and hands the state dict to diffusers'
own `from_single_file` of the family's transformer class, which maps the rest of a family's layout (2.1's fused
`gate_up`) and takes the config from the base model's transformer folder.

Which family a file is from is read off its header alone (names and shapes, no weights): each family lists the
keys only its transformer has (`ModelFamily.weight_signature`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qie.errors import ConfigError, ModelLoadError

PREFIXES = ("model.diffusion_model.",)
SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
# Keys that describe how a file was quantized, not weights of the model.
MARKER_KEYS = ("scaled_fp8",)
MARKER_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_single_file(path: str | Path) -> bool:
    """Whether `path` names a file (a single-file checkpoint) rather than a folder."""
    return Path(path).expanduser().is_file()


def module_name(key: str) -> str:
    """A file's key without ComfyUI's `model.diffusion_model.` prefix."""
    for prefix in PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _is_marker(key: str) -> bool:
    return key in MARKER_KEYS or key.endswith(MARKER_SUFFIXES)


def file_shapes(path: str | Path, key: str = "model.transformer_path") -> dict[str, tuple[int, ...]]:
    """Module names (prefix removed, markers and scales left out) -> shapes, read from the file's header only.

    Raises:
        ModelLoadError: the file is not a safetensors file.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(Path(path).expanduser()), framework="pt") as f:
            names = [k for k in f.keys() if not _is_marker(k) and not k.endswith(SCALE_SUFFIXES)]
            return {module_name(k): tuple(f.get_slice(k).get_shape()) for k in names}
    except Exception as e:  # safetensors raises its own error types for a file that is not one
        raise ModelLoadError(
            f"{key}={str(path)!r} is not a safetensors file ({e}): give a .safetensors file or a diffusers folder"
        ) from None


def recognise(shapes: dict[str, tuple[int, ...]]) -> Any:
    """The family (`qie.models.family.ModelFamily`) whose transformer keys the file holds, or None."""
    from qie.models import families

    # A family whose transformer adds modules to another's (Layered to Qwen-Image) matches both signatures: the
    # longest match is the most specific.
    matches = [f for f in families().values() if all(k in shapes for k in f.weight_signature)]
    return max(matches, key=lambda f: len(f.weight_signature), default=None)


def check_transformer_file(spec: Any, path: str) -> None:
    """Refuse a transformer file of another family than `spec`'s (a ModelSpec), naming the `model=` that fits.

    Raises:
        ConfigError: the file is of another family, or of none qie knows.
    """
    family = recognise(file_shapes(path))
    if family is None:
        raise ConfigError(
            f"model.transformer_path={path!r} holds no transformer of a model family qie knows (none of "
            f"{_signatures()} is in it): give a Qwen-Image or Qwen-Image-2.1 transformer file"
        )
    if family.name != spec.family.name:
        fits = ", ".join(f"model={name}" for name in _models_of(family.name))
        raise ConfigError(
            f"model.transformer_path={path!r} is a {family.name} transformer, model={spec.name} a "
            f"{spec.family.name} one: use {fits} (or set model.check=false to load it anyway)"
        )


def read_state(path: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The file's weights under diffusers' module names, fp8 weights upcast to `dtype` times their scales (read
    one tensor at a time, so the host holds the fp8 file's bytes once at most, not beside the upcast copy).

    Raises:
        ModelLoadError: a file that is no readable safetensors file; a scale that fits neither a whole tensor nor
            one value per row.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(Path(path).expanduser()), framework="pt") as f:
            return _read_tensors(f, path, dtype)
    except SafetensorError as e:
        raise ModelLoadError(
            f"model.transformer_path={str(path)!r} is not a readable safetensors file ({e}): give the transformer's "
            "diffusers folder or a whole .safetensors file of it"
        ) from None


def _read_tensors(f: Any, path: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`read_state` of the open safetensors file `f`."""
    state = {}
    keys = set(f.keys())
    for key in sorted(keys):
        if _is_marker(key) or key.endswith(SCALE_SUFFIXES):
            continue
        value = f.get_tensor(key)
        if value.dtype in FP8_DTYPES:
            base = key.removesuffix(".weight")
            scale = next((f.get_tensor(base + s) for s in SCALE_SUFFIXES if base + s in keys), None)
            value = value.to(torch.float32)
            if scale is not None:
                column = _scale_column(scale.float(), value.shape[0], key, path) if value.ndim == 2 else scale
                value = value * column.float()
            value = value.to(dtype)
        state[module_name(key)] = value
    return state


def load_transformer_file(
    cls: type,
    path: str,
    config_source: str,
    revision: str | None,
    dtype: torch.dtype,
    fp8: str = "upcast",
    **quantized: Any,
) -> Any:
    """The transformer of class `cls` from the single file `path`, its config from `config_source`'s transformer
    (the base model), through diffusers' `from_single_file` (`quantized`: its quantization_config, device_map).

    Args:
        fp8: "upcast" (fp8 weights times their scales in `dtype`) or "keep" (those linear layers then hold the
            file's fp8 bytes and scales again, as optimum-quanto fp8 weights: `keep_file_fp8`).

    Raises:
        ModelLoadError: the file lacks some of the model's weights or holds them in other shapes.
    """
    state = read_state(path, dtype)
    model = _from_single_file(cls, state, path, config_source, revision, dtype, **quantized)
    return keep_file_fp8(model, path) if fp8 == "keep" else model


def _from_single_file(
    cls: type, state: dict, path: str, config_source: str, revision: str | None, dtype: torch.dtype, **quantized: Any
) -> Any:
    try:
        return cls.from_single_file(
            state,
            config=config_source,
            subfolder="transformer",
            config_revision=revision,
            torch_dtype=dtype,
            **quantized,
        )
    except NotImplementedError:  # weights the file lacks are left on the meta device
        missing = sorted(set(_empty_model(cls, config_source, revision).state_dict()) - set(state))
        raise ModelLoadError(
            f"model.transformer_path={path!r} lacks {len(missing)} weight(s) of the {cls.__name__} of "
            f"{config_source} (e.g. {missing[:3]}): is it a whole transformer of that model?"
        ) from None
    except (ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"model.transformer_path={path!r} does not fit the {cls.__name__} of {config_source}: {first}"
        ) from None


def keep_file_fp8(model: Any, path: str | Path) -> Any:
    """Give the linear layers whose weights `path` stores in fp8 those fp8 bytes and scales back (optimum-quanto
    fp8 weights, a per-row scale column; a per-tensor scale repeated per row), in place of their upcast copies.

    The file's fp8 tensors and scale columns go through the same key mapping diffusers' `from_single_file` gives
    the family's class (2.1's fused gate/up rows split in two), so each lands on the module it was loaded into.
    """
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
    from safetensors import safe_open

    from qie.components.quantize import keep_fp8_weights

    weights, scales = {}, {}
    with safe_open(str(Path(path).expanduser()), framework="pt") as f:
        keys = set(f.keys())
        for key in keys:
            if key.endswith(".weight") and not _is_marker(key) and f.get_slice(key).get_dtype().startswith("F8"):
                weight = f.get_tensor(key)
                base = key.removesuffix(".weight")
                found = next((f.get_tensor(base + s) for s in SCALE_SUFFIXES if base + s in keys), torch.ones(1))
                weights[module_name(key)] = weight
                scales[module_name(key)] = _scale_column(found.float(), weight.shape[0], key, path)
    if not weights:
        return model
    mapping = SINGLE_FILE_LOADABLE_CLASSES[type(model).__name__]["checkpoint_mapping_fn"]
    weights = mapping(config=model.config, checkpoint=weights)
    scales = mapping(config=model.config, checkpoint=scales)
    keep_fp8_weights(model, {k.removesuffix(".weight"): (w, scales[k]) for k, w in weights.items()})
    return model


def _scale_column(scale: torch.Tensor, rows: int, key: str, path: str | Path) -> torch.Tensor:
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1).clone()
    if scale.numel() == rows:
        return scale.reshape(rows, 1)
    raise ModelLoadError(
        f"{path}: the scale of {key} holds {scale.numel()} values for {rows} rows: not a per-tensor or per-row "
        "fp8 scale; use model.single_file_fp8=upcast"
    )


def _empty_model(cls: type, source: str, revision: str | None) -> Any:
    from accelerate import init_empty_weights

    with init_empty_weights():
        return cls.from_config(cls.load_config(source, subfolder="transformer", revision=revision))


def _signatures() -> list[str]:
    from qie.models import families

    return [k for f in families().values() for k in f.weight_signature]


def _models_of(family: str) -> list[str]:
    """The real (not tiny) model yamls of `family`, then the tiny ones."""
    from omegaconf import OmegaConf

    from qie.config.tree import conf_dir
    from qie.models import variants

    found = []
    for path in sorted(conf_dir().joinpath("model").iterdir(), key=lambda p: p.name):
        if path.name.endswith(".yaml"):
            node = OmegaConf.create(path.read_text(encoding="utf-8"))
            pair = variants().get(str(node.get("variant", "edit")))
            if pair and pair[0].name == family:
                found.append((bool(node.get("tiny")), str(node.name)))
    return [name for _, name in sorted(found)]
