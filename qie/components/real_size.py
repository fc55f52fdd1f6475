"""Published architecture sizes of Qwen-Image-Edit's transformer and VAE, for benchmarks and memory counts
(built from config with random weights; no checkpoint needed)."""

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
