"""The training step: what the transformer is fed, the loss, timestep sampling, and LoRA-only updates."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from stage_edges import parts_of

from qie.adapters.lora import add_lora
from qie.data.collate import collate
from qie.models.qwen_image import FAMILY, pack_latents, packed
from qie.training.timesteps import SigmaSampling, loss_weights
from qie.types import Batch, SampleEmbeddings, pad_prompt_embeds

C, H, W = 4, 8, 8  # tiny latents: 4 channels, 64 px / 8


def fixed_batch(batch_size: int = 2, seed: int = 0, control_hw: tuple[int, int] = (H, W)) -> Batch:
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(batch_size, 7, 16, generator=g)
    mask = torch.ones(batch_size, 7, dtype=torch.long)
    mask[0, 5:] = 0
    embeds[0, 5:] = 0
    return Batch(
        ids=[f"s{i}" for i in range(batch_size)],
        latents=torch.randn(batch_size, C, 1, H, W, generator=g),
        control_latents=[torch.randn(batch_size, C, 1, *control_hw, generator=g)],
        prompt_embeds=embeds,
        prompt_embeds_mask=mask,
    )


class Recorder(torch.nn.Module):
    """Stands in for the transformer: records its inputs, predicts a fixed tensor."""

    def __init__(self, prediction: float = 0.0) -> None:
        super().__init__()
        self.prediction, self.calls = prediction, []

    def forward(self, **kwargs):
        self.calls.append(kwargs)
        hidden = kwargs["hidden_states"]
        return (torch.full(hidden.shape, self.prediction),)  # packed: 4C values per token


def test_transformer_gets_target_then_control_tokens_and_their_shapes() -> None:
    batch = fixed_batch(control_hw=(H, 2 * W))  # a control of another size than the target
    noise = torch.randn_like(batch.latents)
    sigmas = torch.tensor([0.25, 0.8])
    model = Recorder()
    loss = FAMILY.loss(model, batch, noise, sigmas)
    call = model.calls[0]
    target_tokens, control_tokens = (H // 2) * (W // 2), (H // 2) * (2 * W // 2)
    assert call["hidden_states"].shape == (2, target_tokens + control_tokens, 4 * C)
    s = sigmas.view(-1, 1, 1, 1)
    noisy = pack_latents((1 - s) * batch.latents[:, :, 0] + s * noise[:, :, 0], 2, C, H, W)
    control = pack_latents(batch.control_latents[0][:, :, 0], 2, C, H, 2 * W)
    torch.testing.assert_close(call["hidden_states"], torch.cat([noisy, control], dim=1), rtol=0, atol=0)
    assert call["img_shapes"] == [[(1, H // 2, W // 2), (1, H // 2, W)]] * 2
    torch.testing.assert_close(call["timestep"], sigmas)  # σ itself: the model scales by 1000
    assert torch.equal(call["encoder_hidden_states_mask"], batch.prompt_embeds_mask)
    # A zero prediction leaves the whole velocity noise - x0 as the error, on the target's tokens only.
    assert loss.item() == pytest.approx(((noise - batch.latents) ** 2).mean().item(), rel=1e-6)


class Echo(torch.nn.Module):
    """Stands in for the transformer: its prediction is its input, target and control tokens alike."""

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        return (hidden_states,)


def test_the_loss_reads_the_target_tokens_and_nothing_else() -> None:
    batch = fixed_batch(control_hw=(H, 2 * W))  # more control tokens than target tokens
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(batch.latents.shape, generator=g)
    sigmas = torch.tensor([0.25, 0.8])
    loss = FAMILY.loss(Echo(), batch, noise, sigmas)
    # The echoed prediction for the target's tokens is x_t itself; the velocity target is noise - x0, so the
    # error is x_t - (noise - x0) = (2 - σ)·x0 - (1 - σ)·noise, in every latent value of the target.
    s = sigmas.view(-1, 1, 1, 1, 1)
    x0 = batch.latents
    assert loss.item() == pytest.approx((((2 - s) * x0 - (1 - s) * noise) ** 2).mean().item(), rel=1e-6)
    # The control tokens, also echoed, count for nothing; any change to the target does.
    other = Batch(
        ids=batch.ids,
        latents=batch.latents,
        control_latents=[torch.randn(batch.control_latents[0].shape, generator=g) * 9],
        prompt_embeds=batch.prompt_embeds,
        prompt_embeds_mask=batch.prompt_embeds_mask,
    )
    assert FAMILY.loss(Echo(), other, noise, sigmas).item() == loss.item()
    shifted = Batch(
        ids=batch.ids,
        latents=batch.latents + 1,
        control_latents=batch.control_latents,
        prompt_embeds=batch.prompt_embeds,
        prompt_embeds_mask=batch.prompt_embeds_mask,
    )
    assert FAMILY.loss(Echo(), shifted, noise, sigmas).item() != pytest.approx(loss.item(), rel=1e-3)


def test_a_padded_sample_gives_the_transformer_output_it_gives_alone(tiny_path: Path) -> None:
    """Training pads prompts in a batch and sampling passes one unpadded: the same sample must give the
    transformer the same output either way (both pad with `qie.types.pad_prompt_embeds`)."""
    from diffusers import QwenImageTransformer2DModel

    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_path, subfolder="transformer")
    g = torch.Generator().manual_seed(0)

    def sample(name: str, tokens: int) -> SampleEmbeddings:
        def latent() -> torch.Tensor:
            return torch.randn(C, 1, H, W, generator=g)

        embed = torch.randn(tokens, 16, generator=g)
        return SampleEmbeddings(name, latent(), (latent(),), embed, embed[:2])

    short, long = sample("short", 5), sample("long", 9)
    alone, padded = collate([short]), collate([short, long])
    assert alone.prompt_embeds_mask is None and padded.prompt_embeds_mask[0].tolist() == [1] * 5 + [0] * 4
    embeds, mask = pad_prompt_embeds([short.prompt_embed])  # what sampling passes for one prompt
    assert mask is None and torch.equal(embeds, alone.prompt_embeds)

    def output(batch: Batch) -> torch.Tensor:
        hidden = torch.cat([packed(x)[0] for x in (batch.latents, *batch.control_latents)], dim=1)
        with torch.no_grad():
            return transformer(
                hidden_states=hidden, timestep=torch.full((hidden.shape[0],), 0.6),
                encoder_hidden_states=batch.prompt_embeds, encoder_hidden_states_mask=batch.prompt_embeds_mask,
                img_shapes=[[(1, H // 2, W // 2)] * 2] * hidden.shape[0], return_dict=False,
            )[0]  # fmt: skip

    single, batched = output(alone), output(padded)
    assert (batched[0] - single[0]).abs().max() <= 1e-5
    assert (batched[1] - single[0]).abs().max() > 1e-3  # the other sample's output differs


def test_loss_weighting_scales_each_sample() -> None:
    batch = fixed_batch()
    noise = torch.randn_like(batch.latents)
    sigmas = torch.tensor([0.5, 0.5])
    plain = FAMILY.loss(Recorder(), batch, noise, sigmas, "none")
    weighted = FAMILY.loss(Recorder(), batch, noise, sigmas, "sigma_sqrt")
    assert weighted.item() == pytest.approx(4.0 * plain.item(), rel=1e-6)  # σ^-2 = 4
    assert torch.allclose(loss_weights("cosmap", sigmas), torch.full((2,), 2 / (math.pi * 0.5)))


def test_timestep_sampling_methods() -> None:
    def draw(method: str, image_seq_len: int = 4096, **kw) -> torch.Tensor:
        return SigmaSampling(method, **kw).sample(4096, torch.Generator().manual_seed(0), image_seq_len)

    uniform, logit = draw("uniform"), draw("logit_normal")
    assert 0 < uniform.min() and uniform.max() <= 1 and abs(uniform.mean() - 0.5) < 0.03
    assert logit.std() < uniform.std()  # logit-normal concentrates around the middle
    shifted = draw("shift", shift=3.0)
    u = torch.rand(4096, generator=torch.Generator().manual_seed(0)).double()  # before clamping
    torch.testing.assert_close(shifted.double(), (3 * u / (1 + 2 * u)).clamp(1e-4, 1), rtol=1e-6, atol=1e-6)
    cfg = {"base_image_seq_len": 256, "max_image_seq_len": 8192, "base_shift": 0.5, "max_shift": 0.9}
    small = draw("shift", dynamic_shift=True, image_seq_len=256, scheduler_config=cfg)
    large = draw("shift", dynamic_shift=True, image_seq_len=8192, scheduler_config=cfg)
    s = math.exp(0.9)  # mu = max_shift at max_image_seq_len
    torch.testing.assert_close(large.double(), (s * u / (1 + (s - 1) * u)).clamp(1e-4, 1), rtol=1e-6, atol=1e-6)
    assert large.mean() > small.mean() > uniform.mean()  # bigger images train at higher noise
    assert torch.equal(draw("mode"), draw("mode"))  # the generator alone decides


def test_loss_falls_on_a_fixed_batch_and_only_lora_changes(small_cfg) -> None:
    cfg = small_cfg("train")
    transformer = parts_of(cfg.model, ["transformer"]).transformer
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    params = add_lora(transformer, rank=4, alpha=4, target_modules=list(cfg.train.lora.target_modules))
    optimizer = torch.optim.AdamW(params, lr=2e-2)
    batch = fixed_batch()
    g = torch.Generator().manual_seed(1)
    noise, sigmas = torch.randn(batch.latents.shape, generator=g), torch.tensor([0.3, 0.7])
    losses = []
    for _ in range(20):
        loss = FAMILY.loss(transformer, batch, noise, sigmas)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    after = transformer.state_dict()
    lora_keys = [k for k in after if "lora_B" in k]
    assert lora_keys and all(after[k].abs().sum() > 0 for k in lora_keys)  # B starts at zero
    base = {k.replace(".base_layer", ""): v for k, v in after.items() if "lora_" not in k}
    assert base.keys() == before.keys()
    changed = [k for k in before if not torch.equal(before[k], base[k])]
    assert not changed, f"frozen weights changed: {changed[:3]}"


def test_saved_lora_keeps_its_alpha(tiny_path, tmp_path) -> None:
    """A LoRA with alpha != rank reloads (diffusers' lora_state_dict + metadata) at its trained strength."""
    from diffusers import QwenImageTransformer2DModel

    from qie.adapters.lora import add_lora, load_lora, save_lora

    trained = QwenImageTransformer2DModel.from_pretrained(tiny_path, subfolder="transformer")
    params = add_lora(trained, rank=4, alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    torch.manual_seed(0)
    for p in params:
        p.data.normal_(0, 0.2)
    path = save_lora(trained, tmp_path)
    loaded = QwenImageTransformer2DModel.from_pretrained(tiny_path, subfolder="transformer")
    load_lora(loaded, path)
    base = QwenImageTransformer2DModel.from_pretrained(tiny_path, subfolder="transformer")
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 32, 16, generator=g),
        encoder_hidden_states=torch.randn(1, 5, 16, generator=g),
        encoder_hidden_states_mask=torch.ones(1, 5, dtype=torch.long),
        timestep=torch.tensor([0.5]),
        img_shapes=[[(1, 4, 4), (1, 4, 4)]],
        return_dict=False,
    )
    with torch.no_grad():
        want, got, plain = (m(**inputs)[0] for m in (trained, loaded, base))
    assert (want - plain).abs().max() > 1e-3  # the LoRA matters
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
