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
