"""fp8 weights on the GPU: optimum-quanto's layers get their input in the weights' dtype (its CUDA kernels take
nothing else); fp8 compute (`model.quantize=fp8` through torchao's float8 layers): which layers convert, that
training stays within the fp8 tolerance of the full-precision run, and what is refused. On the CPU the float8
products are emulated (`model.fp8_compute=always`); `auto` keeps optimum-quanto's fp8 weights there, so the pinned
fp8 losses of the other tests do not move. The torchao tests need the `fp8` extra."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import CachedData
from stage_edges import parts_of

from qie.checks import compose
from qie.components.fp8_compute import fp8_compute_wanted
from qie.components.quantize import is_quantized, quantize_weights
from qie.errors import ConfigError
from qie.stages import train as train_stage

needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason='torchao is not installed (pip install "qie[fp8]")'
)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantized_layers_get_their_input_in_the_weights_dtype(kind: str) -> None:
    """A float32 activation (a timestep embedding's) reaches a bf16 model's quantized layer as bf16: on a GPU,
    optimum-quanto's fp8 kernel (Marlin) refuses anything but bf16 and fp16, and autocast does not reach it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)).to(torch.bfloat16)
    quantize_weights(model, kind)
    seen = []
    model[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    out = model(torch.randn(4, 32))
    assert seen == [torch.bfloat16] and out.dtype == torch.bfloat16


TRAINING = ["train.max_steps=4", "train.learning_rate=1e-3", "data.batch_size=2", "train.seed=7",
            "logging.report_to=none", "train.checkpoint_every=0", "data.num_workers=0"]  # fmt: skip


@needs_torchao
def test_auto_keeps_quanto_off_the_gpu_and_always_refuses_swap() -> None:
    assert fp8_compute_wanted("auto", "cpu") is False
    assert fp8_compute_wanted("auto", "cpu", compiled=True) is False  # auto: a GPU with fp8 tensor cores only
    assert fp8_compute_wanted("always", "cpu") is True
    assert fp8_compute_wanted("never", "cpu") is False
    with pytest.raises(ConfigError, match="block swap and FSDP cannot move them"):
        compose("train", ["model.quantize=fp8", "model.fp8_compute=always", "train.blocks_to_swap=1",
                          "train.gradient_checkpointing=true"])  # fmt: skip


@needs_torchao
def test_fp8_compute_converts_the_block_linears_and_keeps_the_projections(small_cfg) -> None:
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    cfg = small_cfg("train", "model.quantize=fp8", "model.fp8_compute=always")
    transformer = parts_of(cfg.model, ["transformer"]).transformer
    to_q = transformer.transformer_blocks[0].attn.to_q
    assert type(to_q) is Float8Linear and isinstance(to_q.weight, Float8TrainingTensor)
    assert to_q.weight._data.dtype == torch.float8_e4m3fn and not to_q.weight.requires_grad
    assert type(transformer.proj_out) is torch.nn.Linear  # the family's full-precision projections
    assert is_quantized(transformer)


@needs_torchao
def test_fp8_compute_trains_within_the_fp8_tolerance(tiny_path: Path, cached_data: CachedData, tmp_path: Path) -> None:
    base = [f"model.pretrained_model_name_or_path={tiny_path}", *cached_data.overrides, *TRAINING]
    runs = {
        name: train_stage.run(compose("train", base + overrides), tmp_path / name)["losses"]
        for name, overrides in {
            "none": ["model.quantize=none"],
            "fp8_compute": ["model.quantize=fp8", "model.fp8_compute=always"],
        }.items()
    }
    ref, fp8 = torch.tensor(runs["none"]), torch.tensor(runs["fp8_compute"])
    assert len(fp8) == 4 and torch.isfinite(fp8).all()
    assert not torch.equal(ref, fp8)  # the products really ran in fp8
    assert torch.allclose(fp8, ref, rtol=2e-2, atol=0)
