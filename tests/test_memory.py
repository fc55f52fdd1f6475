"""Memory levers on the tiny model: block swap and activation offload train to the plain run's losses, the
quantized text encoder's entries key apart, optimizer presets (and a missing extra), predict with swapped blocks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import CachedData
from stage_edges import hasher_for, key_context_for, source_for

from qie.checks import compose
from qie.data.keys import sample_keys
from qie.data.scan import scan_dataset
from qie.errors import CacheMissError, ConfigError
from qie.runtime import memory, offload
from qie.stages import precompute
from qie.stages import train as train_stage

# What decides the losses of every run compared here. Checkpointing on: block swap needs it.
TRAINING = ["train.max_steps=4", "train.learning_rate=1e-3", "data.batch_size=2", "train.seed=7",
            "train.gradient_checkpointing=true", "logging.report_to=none", "train.checkpoint_every=0"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tiny_path: Path, cached_data: CachedData) -> dict:
    """The shared cached data set (read only), the model named by its folder."""
    model = f"model.pretrained_model_name_or_path={tiny_path}"
    return {"root": cached_data.root, "base": [model, *cached_data.overrides, "data.num_workers=0"]}


def train(data: dict, overrides: list[str], run_dir: Path) -> dict:
    return train_stage.run(compose("train", data["base"] + TRAINING + overrides), run_dir)


@pytest.fixture(scope="module")
def plain(data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference runs' losses, with full-precision and with fp8 weights; and the LoRA of the first."""
    runs = {q: train(data, [f"model.quantize={q}"], tmp_path_factory.mktemp(f"plain_{q}")) for q in ("none", "fp8")}
    return {"lora": runs["none"]["lora"], **{q: run["losses"] for q, run in runs.items()}}


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The swappers and activation offloaders the train stage makes."""
    made: dict[str, list] = {"swappers": [], "offloads": []}

    class Swapper(offload.BlockSwapper):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made["swappers"].append(self)

    def offload_activations(model):
        made["offloads"].append(offload.offload_activations(model))
        return made["offloads"][-1]

    monkeypatch.setattr(memory, "BlockSwapper", Swapper)
    monkeypatch.setattr(memory, "offload_activations", offload_activations)
    return made


@pytest.mark.parametrize(
    "quantize,levers",
    [
        ("none", ["train.blocks_to_swap=1"]),
        ("none", ["train.blocks_to_swap=2"]),
        ("none", ["train.activation_offload=true"]),
        ("none", ["train.blocks_to_swap=2", "train.activation_offload=true"]),
        ("fp8", ["train.blocks_to_swap=2"]),
    ],
)
def test_block_swap_and_activation_offload_give_the_plain_losses(
    data: dict, plain: dict, spies: dict, tmp_path: Path, quantize: str, levers: list[str]
) -> None:
    result = train(data, [f"model.quantize={quantize}", *levers], tmp_path / "run")
    assert result["losses"] == plain[quantize]  # exactly: the same arithmetic on the same weights
    swap = next((int(o.split("=")[1]) for o in levers if o.startswith("train.blocks_to_swap")), 0)
    if swap:
        (swapper,) = spies["swappers"]
        # The first forward brings block 0 in; then each step moves blocks 1..N-1 in for the forward pass
        # and 0..N-2 for the backward pass (the last swapped block stays between the two, block 0 between steps).
        assert swapper.loads == 1 + 4 * 2 * (swap - 1)
    if "train.activation_offload=true" in levers:
        (offloaded,) = spies["offloads"]
        assert offloaded.offloaded_bytes > 0


def test_a_block_the_schedule_did_not_bring_in_cannot_be_used(tiny_path: Path) -> None:
    from qie.components import build_parts
    from qie.models import families

    transformer = build_parts(str(tiny_path), ["transformer"], families()["qwen_image"].part_classes).transformer
    swapper = offload.BlockSwapper(transformer, transformer.transformer_blocks, 2, torch.device("cpu"))
    inputs = {
        "hidden_states": torch.randn(1, 16, 16),
        "encoder_hidden_states": torch.randn(1, 5, 16),
        "timestep": torch.tensor([0.5]),
        "img_shapes": [[(1, 4, 4)]],
        "return_dict": False,
    }
    with torch.no_grad():
        before = transformer(**inputs)[0]
        for handle in swapper.handles:  # the schedule gone, the blocks still parked
            handle.remove()
        with pytest.raises(RuntimeError):
            transformer(**inputs)
        swapper.remove()
        assert torch.equal(transformer(**inputs)[0], before)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.blocks_to_swap=4"], "needs train.gradient_checkpointing=true"),
        (["train.gradient_checkpointing=true", "train.blocks_to_swap=4", "train.mode=full"], "train.mode=lora only"),
        (["train.gradient_checkpointing=true", "train.blocks_to_swap=4", "train.fsdp=true"], "cannot be combined"),
        (["train.fsdp=true", "model.quantize=fp8"], "set model.quantize=none"),
    ],
)
def test_combinations_that_cannot_work_are_refused(overrides: list[str], message: str) -> None:
    """Refused when the config is composed (`qie.checks.validate`), before the stage builds anything."""
    with pytest.raises(ConfigError, match=message):
        compose("train", overrides)


def test_quantized_text_encoder_entries_key_apart(data: dict, tmp_path: Path) -> None:
    sample = scan_dataset(data["root"] / "train", "folder").samples[0]
    cfgs = {q: compose("train", data["base"] + [f"model.text_encoder_quantize={q}"]) for q in ("none", "fp8", "int8")}
    keys = {q: sample_keys(sample, key_context_for(cfg), hasher_for(cfg)) for q, cfg in cfgs.items()}
    text = {"prompt_embed", "prompt_embeds_mask", "empty_prompt_embed", "empty_prompt_embeds_mask"}
    for kind in keys["none"]:
        assert (len({keys[q][kind] for q in keys}) == 3) == (kind in text), kind
    # The cache filled unquantized serves an unquantized run, and is a miss for an int8 one.
    source_for(cfgs["none"], "cached").get([sample])
    with pytest.raises(CacheMissError, match="prompt_embed"):
        source_for(cfgs["int8"], "cached").get([sample])
    # Precompute with the int8 text encoder writes the entries an int8 run reads.
    int8 = data["base"][:2] + [f"cache.dir={tmp_path / 'cache'}", "model.text_encoder_quantize=int8"]
    precompute.run(compose("precompute", int8), tmp_path / "precompute")
    source_for(compose("train", int8), "cached").get([sample])


def test_optimizer_presets_compose_and_adafactor_trains(data: dict, plain: dict, tmp_path: Path) -> None:
    from hydra.utils import instantiate

    for preset, cls in (("adamw", "AdamW"), ("adafactor", "Adafactor"), ("sgd", "SGD")):
        optimizer = instantiate(compose("train", [f"train/optimizer={preset}"]).train.optimizer)
        assert type(optimizer([torch.nn.Parameter(torch.ones(2))], lr=1e-3)).__name__ == cls
    cfg = compose("train", ["train/optimizer=adafactor", "train.optimizer.weight_decay=0.1"])
    assert cfg.train.optimizer._target_ == "transformers.optimization.Adafactor"
    assert cfg.train.optimizer.weight_decay == 0.1 and cfg.train.optimizer.relative_step is False
    result = train(data, ["train/optimizer=adafactor"], tmp_path / "run")
    assert result["losses"][0] == plain["none"][0]  # the first loss comes before any update
    assert np.all(np.isfinite(result["losses"])) and result["losses"][1:] != plain["none"][1:]


def test_a_missing_optimizer_extra_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed, wherever the tests run
    with pytest.raises(ConfigError, match=r'pip install "qie\[bnb\]"'):
        compose("train", ["train/optimizer=adamw8bit"])


def test_the_cli_reports_a_missing_optimizer_extra(data: dict, tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['bitsandbytes'] = None; "
        "from qie.train import main; "
        f"sys.argv = ['qie.train', *{data['base'] + ['train/optimizer=adamw8bit', f'hydra.run.dir={tmp_path}']!r}]; "
        "main()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("qie: error: train.optimizer (bitsandbytes.optim.AdamW8bit) needs the package")
    assert 'pip install "qie[bnb]"' in done.stderr and "Traceback" not in done.stderr


def test_predict_with_swapped_blocks_gives_the_same_images(plain: dict, tmp_path: Path) -> None:
    from PIL import Image
    from stage_edges import predictor_for

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    fast = ["model=tiny", "predict.num_inference_steps=2", "predict.true_cfg_scale=4.0"]  # CFG: two passes a step
    predictors = [predictor_for(compose("infer", fast + [f"predict.blocks_to_swap={n}"])) for n in (0, 2)]
    outputs = [p.predict(image, "make it red", output_type="np", num_inference_steps=2) for p in predictors]
    assert np.array_equal(outputs[0], outputs[1])
    for p in predictors:  # a LoRA loaded later is swapped with its blocks
        p.load_lora(plain["lora"])
    with_lora = [p.predict(image, "make it red", output_type="np", num_inference_steps=2) for p in predictors]
    assert np.array_equal(with_lora[0], with_lora[1]) and not np.array_equal(with_lora[0], outputs[0])
