"""The memory planner: its simulated step memory against a real CPU step's peak RSS, and the real-size plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from qie.checks import compose
from qie.config.model import ModelConfig
from qie.models import families
from qie.stages import plan
from qie.stages.memory_plan import GIB, Workload, build_fake, simulate_step, weight_bytes

# A tiny model's classes at a size where a step's memory (100-300 MiB) dwarfs the allocator's noise.
CONFIG = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 4, "attention_head_dim": 64,
          "num_attention_heads": 8, "joint_attention_dim": 256, "axes_dims_rope": (8, 28, 28)}  # fmt: skip
# Qwen-Image-2.1 at the same width: one token per latent pixel, the references in the prompt's image slots.
CONFIG_21 = {"patch_size": 1, "in_channels": 64, "out_channels": 64, "num_layers": 4, "attention_head_dim": 64,
             "num_attention_heads": 8, "context_in_dim": 256, "mlp_ratio": 3, "axes_dims_rope": (8, 28, 28),
             "causal_condition": True}  # fmt: skip
CONFIGS = {"qwen_image": CONFIG, "qwen_image_21": CONFIG_21}
WORK = Workload(batch=1, target_tokens=1024, control_tokens=(1024,), prompt_tokens=300, dtype=torch.float32)
TARGETS = ModelConfig().lora_target_modules  # the LoRA default: the model's targets

# One warm-up step (optimizer states, thread pools), then the peak RSS above the settled RSS of a second step.
MEASURE = """
import gc, json, sys, torch
from qie.stages.memory_plan import Workload
from qie.models import families
from qie.adapters.lora import add_lora
name, config, work, targets, checkpointing = json.loads(sys.argv[1])
family = families()[name]
work = Workload(work[0], work[1], tuple(work[2]), work[3], torch.float32)
torch.manual_seed(0)
model = family.part_class("transformer")(**config).requires_grad_(False)
params = add_lora(model, 16, 16, targets)
if checkpointing:
    model.enable_gradient_checkpointing()
optimizer = torch.optim.AdamW(params, lr=1e-4)
batch, noise, sigmas = family.planner.step_inputs(config, work, torch.randn)

def step():
    family.loss(model, batch, noise, sigmas, "none").backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

step()
gc.collect()
base = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
step()
print(status("VmHWM:") - base)
"""


def measured_step_bytes(family: str, targets: list[str], checkpointing: bool) -> int:
    work = [WORK.batch, WORK.target_tokens, list(WORK.control_tokens), WORK.prompt_tokens]
    arg = json.dumps([family, CONFIGS[family], work, targets, checkpointing])
    # Large blocks straight from mmap and back: RSS then follows the live tensors instead of malloc's heap.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, "-c", MEASURE, arg], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("name", "checkpointing"),
    [
        pytest.param("qwen_image", False, marks=pytest.mark.slow),
        ("qwen_image", True),
        pytest.param("qwen_image_21", False, marks=pytest.mark.slow),
    ],
)
def test_simulated_step_memory_is_within_20_percent_of_the_measured_peak(name: str, checkpointing: bool) -> None:
    """The simulation runs each family's own step: 2.1's masks stay real on the fake tensors (their values decide
    shapes), and its estimate holds as well as Qwen-Image's."""
    family = families()[name]
    targets = TARGETS if name == "qwen_image" else compose("plan", ["model=qwen_image_21"]).model.lora_target_modules
    model, fake = build_fake(family, CONFIGS[name], torch.float32, 16, list(targets), checkpointing)
    estimate, _ = simulate_step(family, model, fake, WORK)
    measured = measured_step_bytes(name, list(targets), checkpointing)
    assert measured > 50 * 2**20  # the step is large enough for the comparison to mean something
    assert abs(estimate - measured) <= 0.2 * measured, (estimate / 2**20, measured / 2**20)


def test_real_size_plan_for_a_24_gib_gpu(capsys: pytest.CaptureFixture) -> None:
    rows = plan.run(compose("plan", ["model=qwen_image_edit", "data.target_pixels=1048576", "gpu_memory_gb=24"]))
    out = capsys.readouterr().out
    by = {(r.levers.quantize, r.levers.gradient_checkpointing, r.levers.activation_offload): r for r in rows}
    weights = {q: by[(q, False, False)].parts["transformer weights"] / GIB for q in ("none", "fp8", "int4", "nf4")}
    # The 20.4 B parameters; 4 bits + a bf16 scale and shift per 128 (int4) or an fp32 absmax per 64 (nf4).
    assert weights == pytest.approx({"none": 38.05, "fp8": 19.08, "int4": 10.17, "nf4": 10.76}, abs=0.01)
    assert by[("none", False, False)].total > 24 * GIB  # bf16 without checkpointing fits no 24 GiB card
    step = [by[("fp8", *k)].parts["step: activations, gradients, temporaries"] for k in ((0, 0), (1, 0), (1, 1))]
    assert step[0] > 10 * step[1] and step[1] > step[2]  # checkpointing, then offload, shrink the step
    swapped = by[("none", True, False)]
    assert 0 < swapped.levers.blocks_to_swap < 60 and swapped.total <= 24 * GIB
    assert "recommended: model.quantize=" in out and "Qwen2.5-VL-7B: 15.4 GiB in bf16" in out


@pytest.mark.slow  # the 24 GiB plan runs in CI
def test_real_size_plan_of_qwen_image_21(capsys: pytest.CaptureFixture) -> None:
    rows = plan.run(compose("plan", ["model=qwen_image_21", "model.max_control_images=1", "gpu_memory_gb=24"]))
    out = capsys.readouterr().out
    weights = rows[0].parts["transformer weights"] / GIB
    assert 12 < weights < 16  # ~7 B parameters in bf16
    assert "published qwen_image_21 sizes" in out and "Qwen3-VL-8B" in out and "recommended:" in out


def test_weights_counted_on_meta_match_the_built_model() -> None:
    from diffusers import QwenImageTransformer2DModel

    counted = weight_bytes(families()["qwen_image"], CONFIG, torch.float32, "none", 16, TARGETS)
    model = QwenImageTransformer2DModel(**CONFIG)
    assert counted.other + counted.blocks * counted.block == sum(p.numel() * 4 for p in model.parameters())


def test_int4_weights_counted_on_meta_match_the_quantized_model() -> None:
    """optimum-quanto's qint4 as the planner counts it: half a byte per weight, a scale and a shift per 128."""
    from diffusers import QwenImageTransformer2DModel

    from qie.components.quantize import quantize_transformer

    family = families()["qwen_image"]
    config = {**CONFIG, "attention_head_dim": 64, "num_attention_heads": 2, "joint_attention_dim": 128}
    counted = weight_bytes(family, config, torch.float32, "int4", 16, TARGETS)
    model = quantize_transformer(QwenImageTransformer2DModel(**config), "int4", family.keep_full_precision)

    def nbytes(t: torch.Tensor) -> int:
        inner = t.__tensor_flatten__()[0] if hasattr(t, "__tensor_flatten__") else None
        return sum(nbytes(getattr(t, n)) for n in inner) if inner else t.numel() * t.element_size()

    assert counted.other + counted.blocks * counted.block == sum(nbytes(p) for p in model.parameters())
    assert weight_bytes(family, config, torch.float32, "none", 16, TARGETS).block > 3 * counted.block


def test_step_flops_count_the_linear_layers_and_the_attention_of_every_block() -> None:
    from qie.stages.memory_plan import step_flops

    family = families()["qwen_image"]
    config = dict(family.published.transformer)  # 60 blocks, width 3072: counted with 2 and 4, extrapolated
    work = Workload(batch=1, target_tokens=4096, control_tokens=(4096,), prompt_tokens=252, dtype=torch.bfloat16)
    flops = step_flops(family, config, work, 16, ["to_q", "to_k", "to_v", "to_out.0"])
    d, tokens = 3072, 4096 + 4096 + 252
    # Per block: each token through its stream's 12 d^2 weights (qkv, out, 4d MLP), forward and the backward's
    # input gradient: 2 x 2 x 12 d^2 FLOPs; joint attention 4 S^2 d forward, 2.5x that backward (torch's count).
    linear = 48 * d * d * tokens
    attention = 4 * tokens * tokens * d * 3.5
    assert flops == pytest.approx(60 * (linear + attention), rel=0.02)
    assert flops > 60 * linear * 1.5  # the attention is counted: the CPU flash kernel is not in torch's table
