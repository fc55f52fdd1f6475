"""Published architecture sizes of Qwen-Image-Edit's transformer and VAE, for benchmarks and memory counts
(built from config with random weights; no checkpoint needed): `random_model` builds one."""

from __future__ import annotations

from typing import Any

import torch


def random_model(cls: type, config: dict, device: str | torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """`cls(**config)` with random weights, made parameter by parameter on `device` in `dtype`: the host never
    holds a float32 copy, so a real-size transformer builds straight onto a GPU (or into host memory, for swap).

    Matrices are drawn from N(0, 0.02), norm scales are 1, other vectors 0. The module is constructed with its
    parameters on the meta device (accelerate's `init_empty_weights`, as diffusers loads checkpoints), so
    buffers and plain tensor attributes (rotary tables) are computed as usual.
    """
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    with init_empty_weights(include_buffers=False):
        model = cls(**config)
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in list(model.named_parameters()):
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if p.ndim >= 2:
            t.normal_(0.0, 0.02, generator=g)
        else:
            t.fill_(1.0 if name.endswith("weight") and "norm" in name else 0.0)
        set_module_tensor_to_device(model, name, device, value=t, dtype=dtype)
    return model.to(device).eval()


TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    axes_dims_rope=(16, 56, 56),
)
VAE = dict(base_dim=96, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True], z_dim=16)

# Qwen-Image-2.1 (`Qwen/Qwen-Image-2.1`): its transformer and VAE are diffusers 0.42.1's defaults for these
# classes (QwenImage21Transformer2DModel, AutoencoderKLQwenImage21). The text encoder is Qwen3-VL-8B's
# published config: the transformer reads 4096-wide embeddings (context_in_dim), Qwen3-VL-8B's hidden size.
TRANSFORMER_21 = dict(
    patch_size=1,
    in_channels=64,
    out_channels=64,
    num_layers=32,
    attention_head_dim=128,
    num_attention_heads=32,
    context_in_dim=4096,
    mlp_ratio=3,
    axes_dims_rope=(16, 56, 56),
    causal_condition=True,
)
VAE_21 = dict(
    base_dim=96,
    decoder_base_dim=144,
    z_dim=64,
    dim_mult=[1, 2, 4, 8, 8],
    num_res_blocks=2,
    temperal_downsample=[False, True, True, True],
    in_channels=4,
    out_channels=4,
)
TEXT_ENCODER_21 = dict(
    text_config=dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    ),
    vision_config=dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=4096,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[8, 16, 24],
    ),
    tie_word_embeddings=False,
)
# Qwen2.5-VL-7B-Instruct (Qwen-Image's text encoder): 8.29 B parameters.
TEXT_ENCODER = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
    max_position_embeddings=128000,
    rope_theta=1000000.0,
    vision_config=dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        in_chans=3,
    ),
)
