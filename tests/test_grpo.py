"""Online RL (`train/objective=grpo`): the SDE step's log-probability, the group advantages, the objective's loss on
the tiny edit model (pinned), the demo's reward, and what the objective refuses."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from stage_edges import parts_of
from test_step import fixed_batch

from qie.adapters.lora import add_lora
from qie.config import typed
from qie.data.images import open_image as rows_module_open
from qie.data.images import rgb
from qie.data.scan import scan_dataset
from qie.demo.reward import RecolourReward, named_colour, shape_region
from qie.errors import ConfigError, DataError
from qie.evaluation.scoring import Row
from qie.models import model_spec
from qie.stages.train_model import objective_reward
from qie.training.flow_sde import SdeRun, clipped_loss, gaussian_log_prob, group_advantages, sde_mean, sde_std
from qie.training.objectives import ObjectiveUse, check_use
from qie.training.objectives.grpo import Grpo
from qie.training.objectives.run_context import RunContext
from qie.training.timesteps import SigmaSampling

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
SETTINGS = {
    "group_size": 3,
    "sampling_steps": 3,
    "train_timesteps": 2,
    "noise_level": 0.7,
    "kl_weight": 0.04,
    "reward": {"_target_": "qie.demo.reward.RecolourReward"},
}


def demo_control(size: int = 64) -> torch.Tensor:
    """A white control image with a blue square in the middle, (3, size, size) in [0, 1]."""
    image = torch.full((3, size, size), 245 / 255)
    image[:, size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = torch.tensor([40, 80, 220])[:, None, None] / 255
    return image


def rows(sample_id: str, size: tuple[int, int], needs=()) -> Row:
    """Every sample's row: the demo's blue square to make red (64 px), its target and edit region at `size`
    (square): the square red."""
    at_size = demo_control(size[0])
    region = shape_region(at_size)
    target = torch.where(region, named_colour("make the square red")[:, None, None].float(), at_size)
    return Row(sample_id, "make the square red", None, [demo_control()], target, region)


@pytest.fixture(scope="module")
def tiny(small_cfg):
    cfg = small_cfg("train")
    spec = model_spec(typed(cfg.model))
    return cfg, spec, parts_of(cfg.model, ["transformer", "scheduler", "vae"], spec=spec)


def grpo_objective(spec, parts, policy, **options) -> Grpo:
    context = RunContext(
        family=spec.family,
        sigmas=SigmaSampling(method="uniform"),
        scheduler=parts.scheduler,
        pipeline_config=parts.pipeline_config,
        sampling_defaults=spec.call_defaults(),
        transformer=policy,
        decoder=lambda: parts.vae,
        rows=rows,
        rewards=objective_reward,
    )
    return Grpo(context, **{**SETTINGS, **options})


def rollout_batch(batch_size: int = 1, seed: int = 0):
    batch = fixed_batch(batch_size, seed)
    return dataclasses.replace(
        batch,
        latents=torch.zeros_like(batch.latents),
        negative_prompt_embeds=torch.zeros_like(batch.prompt_embeds),
        negative_prompt_embeds_mask=batch.prompt_embeds_mask,
    )


def lora_model(cfg, seed: int = 1):
    transformer = parts_of(cfg.model, ["transformer"]).transformer
    torch.manual_seed(seed)  # the A matrices' initialisation
    add_lora(transformer, 4, 4, TARGETS)
    g = torch.Generator().manual_seed(seed)
    for name, p in transformer.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.05
    return transformer


def test_the_sde_steps_log_probability_is_the_gaussian_log_density_of_the_step_taken() -> None:
    g = torch.Generator().manual_seed(0)
    sigmas = torch.tensor([1.0, 0.6, 0.25, 0.0])
    run = SdeRun("rollout", 0.7, g)
    sample, velocity = torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 3, generator=g)
    taken = run.step(sigmas, velocity, sample)
    std = sde_std(sigmas[0], sigmas[1], 0.7)
    assert float(std) == pytest.approx(0.7 * math.sqrt(1 / (1 - 0.6)))  # sigma = 1 taken as sigma_1
    mean = sde_mean(sample, velocity, sigmas[0], sigmas[1], std)
    normal = torch.distributions.Normal(mean, std * math.sqrt(1.0 - 0.6))
    torch.testing.assert_close(run.log_probs[0], normal.log_prob(taken).flatten(1).mean(1))
    torch.testing.assert_close(gaussian_log_prob(taken, mean, run.scales[0]), run.log_probs[0])
    # noise_level -> 0: the ODE's Euler step x + v dt
    torch.testing.assert_close(
        sde_mean(sample, velocity, sigmas[1], sigmas[2], torch.tensor(0.0)), sample + velocity * (0.25 - 0.6)
    )


def test_a_rollout_draws_noise_only_at_its_noisy_steps_and_takes_the_odes_step_elsewhere() -> None:
    g = torch.Generator().manual_seed(0)
    sigmas = torch.tensor([1.0, 0.6, 0.25, 0.0])
    run = SdeRun("rollout", 0.7, g, noisy=[1])
    sample, velocity = torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 3, generator=g)
    state = torch.Generator().get_state()
    first = run.step(sigmas, velocity, sample)
    torch.testing.assert_close(first, sample + velocity * (0.6 - 1.0))  # the ODE's Euler step, no noise drawn
    second = run.step(sigmas, velocity, first)
    assert set(run.log_probs) == {1}  # only a noisy step has a log-probability
    mean = sde_mean(first, velocity, sigmas[1], sigmas[2], sde_std(sigmas[1], sigmas[1], 0.7))
    assert float((second - mean).abs().max()) > 1e-3  # noise was drawn at step 1
    assert torch.equal(torch.Generator().get_state(), state)
    third = run.step(sigmas, velocity, second)
    torch.testing.assert_close(third, second + velocity * (0.0 - 0.25))
    assert len(run.states) == 4


def test_advantages_are_normalised_within_each_group_and_the_ratio_clipped() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 10.0])
    adv = group_advantages(rewards, 3)
    first = torch.tensor([1.0, 2.0, 3.0])
    torch.testing.assert_close(adv[:3], (first - 2) / (first.std(unbiased=False) + 1e-4))
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]  # a group of equal rewards teaches nothing
    old = torch.zeros(2, 1)
    loss, fraction = clipped_loss(torch.tensor([1.0, -1.0]), old + torch.tensor([[0.5], [0.0]]), old, 0.1)
    assert float(fraction) == 0.5 and float(loss) == pytest.approx((-1.1 + 1.0) / 2)


def test_the_demo_reward_reads_the_instruction_and_the_control() -> None:
    control = demo_control()
    region = shape_region(control)
    assert int(region.sum()) == 32 * 32
    red = named_colour("make the square red")
    perfect = torch.where(region, red[:, None, None].float(), control)
    reward = RecolourReward()
    scores = reward(torch.stack([perfect, control]), [[control]] * 2, ["make the square red"] * 2)
    assert float(scores[0]) == pytest.approx(1.0) and float(scores[1]) < 0.9
    assert math.isnan(float(reward(control[None], [[control]], ["no colour named"])[0]))


def test_the_first_loss_of_the_edit_family_is_pinned_and_trains_the_lora_only(tiny) -> None:
    cfg, spec, parts = tiny
    policy = lora_model(cfg)
    objective = grpo_objective(spec, parts, policy)
    loss = objective.loss(policy, rollout_batch(), torch.Generator().manual_seed(7))
    loss.backward()
    assert all(p.grad is not None for n, p in policy.named_parameters() if "lora_B" in n)
    assert all(p.grad is None for n, p in policy.named_parameters() if "lora" not in n)
    metrics = objective.step_metrics()
    timing = {"rollout_seconds", "reward_seconds", "rewards_per_second"}
    assert set(metrics) == {"reward_mean", "reward_std", "reward_best", "kl", "clip_fraction", *timing}
    assert metrics["clip_fraction"] == 0.0 and metrics["kl"] > 0  # one optimisation per rollout: the ratio is 1
    # The policy-gradient term is -mean(A) = 0 up to rounding at the first optimisation; the KL term is the loss.
    assert loss.item() == pytest.approx(0.04 * metrics["kl"], abs=1e-7)
    assert metrics["kl"] == pytest.approx(3.078278268731083e-06, rel=1e-4)
    assert metrics["reward_mean"] == pytest.approx(0.6183055730310597, rel=1e-6)
    assert metrics["reward_best"] == pytest.approx(0.6203033424273979, rel=1e-6)
    assert metrics["reward_std"] == pytest.approx(0.0015105739233745817, rel=1e-4)


def test_the_same_generator_gives_the_same_loss(tiny) -> None:
    cfg, spec, parts = tiny
    policy = lora_model(cfg)
    objective = grpo_objective(spec, parts, policy)
    first = objective.loss(policy, rollout_batch(), torch.Generator().manual_seed(3))
    again = objective.loss(policy, rollout_batch(), torch.Generator().manual_seed(3))
    assert float(first.detach()) == float(again.detach())


def test_with_noise_only_at_the_trained_steps_a_shared_start_group_differs_only_there(tiny) -> None:
    cfg, spec, parts = tiny
    policy = lora_model(cfg)
    objective = grpo_objective(spec, parts, policy, noisy_steps="trained", shared_start=True, train_timesteps=1)
    run, rewards = objective.rollout(policy, rollout_batch(), 0, torch.Generator().manual_seed(5), noisy=[1])
    start, after_first, after_second = run.states[0], run.states[1], run.states[2]
    assert all(torch.equal(start[0], start[k]) for k in range(3))  # one starting noise for the group
    for k in (1, 2):  # step 0 is the ODE's: alike (up to the batch's rounding)
        torch.testing.assert_close(after_first[k], after_first[0], atol=1e-6, rtol=0)
    assert float((after_second[0] - after_second[1]).abs().max()) > 1e-2  # step 1 drew each edit's noise
    assert set(run.log_probs) == {1} and rewards.shape == (3,)
    loss = objective.loss(policy, rollout_batch(), torch.Generator().manual_seed(7))
    assert torch.isfinite(loss) and objective.step_metrics()["reward_std"] > 0


def test_a_reward_that_compares_with_the_target_is_given_the_rows_target_and_refused_without_one(tiny) -> None:
    cfg, spec, parts = tiny
    policy = lora_model(cfg)
    objective = grpo_objective(spec, parts, policy, reward={"_target_": PIXEL})
    batch = rollout_batch()
    latents = torch.randn((3, *batch.latents.shape[1:]), generator=torch.Generator().manual_seed(2))
    images = rgb(spec.family.decode(parts.vae, latents, "pt").float().clamp(0, 1))
    target = rows("0", (images.shape[-1], images.shape[-2])).target
    expected = -(images.double() - target.double()).abs().flatten(1).mean(1)  # an error: its negative
    torch.testing.assert_close(objective._rewards(batch, latents), expected)
    assert torch.isfinite(objective.loss(policy, batch, torch.Generator().manual_seed(7)))

    def without_target(sample_id, size, needs):
        return dataclasses.replace(rows(sample_id, size), target=None, region=None)

    objective.context.rows = without_target
    with pytest.raises(DataError, match=r"sample 's0' has no target, which train.objective.reward \(PixelError\)"):
        objective.rollout(policy, batch, 0, torch.Generator().manual_seed(5))


def test_a_rows_target_and_edit_region_are_read_only_for_a_reward_that_needs_them(tiny, tmp_path, monkeypatch) -> None:
    """GRPO reads a sample's row each step: its target and edit region only where the reward `needs` them."""
    from qie.demo.synthetic import make_dataset
    from qie.evaluation import rows as rows_module
    from qie.stages.train_data import sample_rows

    _, spec, _ = tiny
    sample = scan_dataset(make_dataset(tmp_path, train=1, heldout=0, size=32) / "train").samples[0]
    opened = []
    monkeypatch.setattr(rows_module, "open_image", lambda p: opened.append(Path(p)) or rows_module_open(p))
    row = sample_rows([sample], spec)
    bare = row(sample.id, (32, 32), frozenset())
    assert (bare.target, bare.region) == (None, None) and opened == list(sample.controls)
    opened.clear()
    region = row(sample.id, (32, 32), frozenset({"mask"}))
    assert region.target is None and region.region is not None and region.region.any()
    assert opened == [*sample.controls, sample.target, sample.controls[0]]  # the region is where they differ
    whole = row(sample.id, (32, 32), frozenset({"target", "mask"}))
    assert whole.target.shape == (3, 32, 32) and torch.equal(whole.region, region.region)


def test_weighted_rewards_sum_their_parts_values_and_need_what_their_parts_need() -> None:
    control = demo_control()
    row = rows("0", (64, 64))
    images = torch.stack([row.target, control])
    parts = {"colour": {"_target_": "qie.demo.reward.RecolourReward"}, "pixel": {"_target_": PIXEL}}
    weighted = objective_reward({"_target_": "qie.evaluation.weighted.Weighted", "rewards": parts,
                                 "weights": {"colour": 2.0}})  # fmt: skip
    assert weighted.needs == {"target"} and weighted.weights == {"colour": 2.0, "pixel": 1.0}
    colour = RecolourReward()(images, [[control]] * 2, ["make the square red"] * 2)
    error = (images.double() - row.target.double()).abs().flatten(1).mean(1)
    scores = weighted(images, [[control]] * 2, ["make the square red"] * 2, targets=row.target.expand(2, -1, -1, -1))
    torch.testing.assert_close(scores, 2.0 * colour.double() - error)
    assert float(scores[0]) == pytest.approx(2.0) and float(scores[1]) < 1.8
    with pytest.raises(ConfigError, match=r"unknown key .*rewards.colour.shade: .*RecolourReward's parameters"):
        objective_reward({"_target_": "qie.evaluation.weighted.Weighted", "rewards": {"colour": {
            "_target_": "qie.demo.reward.RecolourReward", "shade": 1}}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"weights names \['judge'\], which are not among the rewards"):
        objective_reward({"_target_": "qie.evaluation.weighted.Weighted", "rewards": parts, "weights": {"judge": 1}})


PIXEL = "qie.evaluation.metrics.PixelError"


def test_a_judge_is_built_from_the_runs_model_alone_and_inside_a_weighted_reward(small_cfg) -> None:
    from qie.config import typed
    from qie.evaluation.judge import VlmJudge

    model = typed(small_cfg("train").model)
    judge = {"_target_": "qie.evaluation.judge.VlmJudge", "question": "preservation"}
    built = objective_reward(judge, model=model)
    assert isinstance(built, VlmJudge) and built.model == model and built.question == "preservation"
    weighted = objective_reward({"_target_": "qie.evaluation.weighted.Weighted", "rewards": {"judge": judge}}, model)
    assert weighted.parts["judge"].model == model and weighted.needs == frozenset()


@pytest.mark.parametrize(
    ("lora", "regularization", "options", "message"),
    [
        (False, False, SETTINGS, "train/objective=grpo needs train.mode=lora"),
        (True, True, SETTINGS, "train/objective=grpo does not mix in data.regularization"),
        (True, False, {**SETTINGS, "group_size": 1}, r"train.objective.group_size=1 is out of range"),
        (True, False, {**SETTINGS, "train_timesteps": 4}, r"train.objective.train_timesteps=4 is out of range"),
        (True, False, {"group_size": 2}, r"train/objective=grpo needs a reward"),
        (True, False, {**SETTINGS, "noisy_steps": "some"}, r"train.objective.noisy_steps=some is out of range"),
        (True, False, {**SETTINGS, "reference_lora": "/no/such.safetensors"}, r"reference_lora=.* does not exist"),
    ],
)
def test_what_grpo_refuses_in_one_line(small_cfg, lora, regularization, options, message) -> None:
    family = model_spec(typed(small_cfg("train").model)).family
    with pytest.raises(ConfigError, match=message) as info:
        check_use(
            {"_target_": "qie.training.objectives.grpo.Grpo", **options}, ObjectiveUse(family, lora, regularization)
        )
    assert "\n" not in str(info.value)


def test_caption_dropout_is_refused_when_the_config_is_composed(small_cfg) -> None:
    """A dropped caption would sample a group without the instruction its reward reads."""
    with pytest.raises(
        ConfigError, match=r"data.caption_dropout_rate=0.1 would hide .*: set data.caption_dropout_rate=0"
    ):
        small_cfg("train", *GRPO, "data.caption_dropout_rate=0.1")


# --- the stages: rows without targets ---------------------------------------------------------------------------

GRPO = [
    "train/objective=grpo",
    "train.objective.group_size=2",
    "train.objective.sampling_steps=2",
    "train.objective.train_timesteps=1",
    "train.max_steps=2",
]


@pytest.fixture(scope="module")
def targetless(tmp_path_factory):
    """Four demo edits as manifest rows without targets (controls and prompts only)."""
    from qie.demo.synthetic import make_dataset

    root = tmp_path_factory.mktemp("targetless")
    make_dataset(root, train=4, heldout=0, size=64)
    rows = []
    for control in sorted((root / "train" / "control_images").glob("*.png")):
        prompt = (root / "train" / "training_images" / f"{control.stem}.txt").read_text().strip()
        rows.append({"controls": [str(control.relative_to(root))], "prompt": prompt})
    manifest = root / "rows.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


def test_rows_without_targets_fill_only_their_prompt_and_control_entries_and_train_with_the_decoder_alone(
    small_cfg, targetless, tmp_path, monkeypatch
) -> None:
    from qie.stages import precompute, sources, train, train_model

    cache = tmp_path / "cache"
    data = [f"data.path={targetless}", f"cache.dir={cache}"]
    precompute.run(small_cfg("precompute", *data, *GRPO), tmp_path / "pre")
    filled = {p.name for p in cache.iterdir() if any(p.rglob("*.safetensors"))} - {"state"}
    assert filled == {"prompt_embed", "control_latent", "empty_prompt_embed"}, filled
    plain = tmp_path / "plain"  # a run that trains on targets skips every such row
    with pytest.raises(DataError, match="target"):
        precompute.run(small_cfg("precompute", f"data.path={targetless}", f"cache.dir={plain}"), tmp_path / "pre2")

    loaded, built = [], []
    real = train_model.load_parts

    def load_parts(load, spec, names, *args):
        loaded.append(list(names))
        built.append(real(load, spec, names, *args))
        return built[-1]

    monkeypatch.setattr(train_model, "load_parts", load_parts)
    monkeypatch.setattr(sources, "build_encoder", lambda *a: pytest.fail("built the encoders"))
    result = train.run(small_cfg("train", *data, *GRPO), tmp_path / "run")
    # The decoder is built when the objective first decodes, after the transformer.
    assert loaded == [["transformer", "scheduler"], ["vae"]] and len(result["losses"]) == 2
    vae = built[1].vae  # the decoder alone: the encoder's weights dropped
    assert not list(vae.encoder.parameters()) and list(vae.decoder.parameters())
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"reward_mean", "reward_std", "reward_best", "kl", "clip_fraction"} <= set(logged[-1])


@pytest.fixture(scope="module")
def targetless_cache(small_cfg, targetless, tmp_path_factory):
    """The targetless rows precomputed for a GRPO run: (the data and cache overrides)."""
    from qie.stages import precompute

    cache = tmp_path_factory.mktemp("targetless_cache")
    data = [f"data.path={targetless}", f"cache.dir={cache}"]
    precompute.run(small_cfg("precompute", *data, *GRPO), cache / "run")
    return data


def test_a_resumed_run_repeats_the_straight_runs_steps(small_cfg, targetless_cache, tmp_path) -> None:
    from qie.stages import train

    run = [*targetless_cache, *GRPO, "train.max_steps=4", "train.checkpoint_every=2", "train.learning_rate=1e-2"]
    straight = train.run(small_cfg("train", *run), tmp_path / "straight")
    checkpoint = tmp_path / "straight" / "checkpoints" / "step-000002"
    resumed = train.run(small_cfg("train", *run, f"train.resume={checkpoint}"), tmp_path / "resumed")
    assert resumed["losses"] == straight["losses"][2:]
    assert resumed["param_checksums"] == straight["param_checksums"]


@pytest.mark.usefixtures("small_conditions")
def test_the_trained_lora_loads_in_the_diffusers_pipeline_and_a_reward_from_outside_qie_trains(
    small_cfg, targetless_cache, tiny_path, tmp_path
) -> None:
    """A reward named by its `_target_` from outside qie (tests/plugins/colour.py) scores the rollouts; the LoRA
    the run writes loads into the family's diffusers pipeline and changes its output."""
    import numpy as np
    from PIL import Image
    from test_family_battery import pipeline_of

    from qie.stages import train

    outside = ["train.objective.reward._target_=plugins.colour.Colour", "+train.objective.reward.rgb=[0,0,255]"]
    run = [*targetless_cache, *GRPO, *outside, "train.learning_rate=1e-2"]
    lora = Path(train.run(small_cfg("train", *run), tmp_path / "run")["lora"])
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["reward_mean"] <= 1 for r in logged if "reward_mean" in r)

    control = Image.new("RGB", (64, 64), (245, 245, 240))
    sampling = dict(
        prompt="make the square red",
        image=[control],
        true_cfg_scale=1.0,
        num_inference_steps=2,
        height=64,
        width=64,
        output_type="np",
    )
    pipe = pipeline_of(tiny_path)
    base = pipe(generator=torch.Generator().manual_seed(3), **sampling).images
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    tuned = pipe(generator=torch.Generator().manual_seed(3), **sampling).images
    assert np.abs(tuned - base).max() > 1e-6


# --- cheaper rollouts ---------------------------------------------------------------------------------------------


def calls_of(model) -> list[int]:
    """The batch size of each call of `model`, from now on."""
    sizes: list[int] = []
    model.register_forward_pre_hook(lambda m, a, k: sizes.append(k["hidden_states"].shape[0]), with_kwargs=True)
    return sizes


def test_a_groups_shared_prefix_is_sampled_once_and_gives_the_same_step(tiny) -> None:
    cfg, spec, parts = tiny
    late = {"sampling_steps": 4, "train_timesteps": 1, "window": [2, 4]}  # the noisy step is the third or fourth
    policy = lora_model(cfg)
    plain = grpo_objective(spec, parts, policy, shared_prefix=False, **late)
    plain_calls = calls_of(policy)
    want = plain.loss(policy, rollout_batch(), torch.Generator().manual_seed(7))
    assert plain_calls == [3] * 6  # 4 rollout steps, then the trained step under the policy and the reference
    policy = lora_model(cfg)
    shared = grpo_objective(spec, parts, policy, **late)
    shared_calls = calls_of(policy)
    got = shared.loss(policy, rollout_batch(), torch.Generator().manual_seed(7))
    assert shared_calls[:2] == [1, 1] and len(shared_calls) == 6  # the first two steps once, for one edit
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)  # the same edits, up to the batch's rounding
    assert shared.step_metrics()["reward_mean"] == pytest.approx(plain.step_metrics()["reward_mean"], rel=1e-5)


def test_the_trained_steps_are_drawn_from_the_window(tiny) -> None:
    cfg, spec, parts = tiny
    objective = grpo_objective(spec, parts, lora_model(cfg), sampling_steps=6, train_timesteps=2, window=[1, 4])
    g = torch.Generator().manual_seed(0)
    drawn = [objective._chosen(g) for _ in range(50)]
    assert {tuple(d) for d in drawn} == {(1, 2), (1, 3), (2, 3)}  # every pair of the window, none outside


def test_rollouts_at_their_own_size_are_scored_at_it_and_scoring_beside_sampling_changes_nothing(tiny) -> None:
    cfg, spec, parts = tiny
    policy = lora_model(cfg)
    objective = grpo_objective(spec, parts, policy, rollout_pixels=32 * 32)
    sizes = []
    score = objective.context.score
    objective.context.score = lambda reward, images, *a: (
        sizes.append(tuple(images.shape[-2:])) or score(reward, images, *a)
    )
    loss = objective.loss(policy, rollout_batch(), torch.Generator().manual_seed(7))
    assert torch.isfinite(loss) and sizes == [(32, 32)]  # the batch's edits are 64 px: a quarter of the area
    alone = grpo_objective(spec, parts, policy, rollout_pixels=32 * 32, overlap_rewards=False)
    assert torch.equal(alone.loss(policy, rollout_batch(), torch.Generator().manual_seed(7)), loss)
    metrics = objective.step_metrics()
    assert metrics["rollout_seconds"] > 0 and metrics["reward_seconds"] > 0 and metrics["rewards_per_second"] > 0


def test_a_reward_that_scores_a_groups_edits_alike_is_said_then_stops_the_run_with_its_state_kept(
    small_cfg, targetless_cache, tmp_path, capsys
) -> None:
    from qie.errors import QieError
    from qie.stages import train
    from qie.stages.train_hooks import ZERO_SPREAD_STEPS

    broken = ["train.objective.reward._target_=plugins.colour.Constant", "train.checkpoint_every=1000"]
    run = [*targetless_cache, *GRPO, *broken, "train.max_steps=40"]
    with pytest.raises(
        QieError, match=r"train.objective.reward \(plugins.colour.Constant\) scored every edit of"
    ) as info:
        train.run(small_cfg("train", *run), tmp_path / "run")
    assert f"for {ZERO_SPREAD_STEPS} steps in a row" in str(info.value) and "\n" not in str(info.value)
    out = capsys.readouterr().out
    assert "qie: warning: step 1: train.objective.reward (plugins.colour.Constant) scored every edit" in out
    assert (tmp_path / "run" / "checkpoints" / f"step-{ZERO_SPREAD_STEPS:06d}").is_dir()  # the state is kept


def test_the_progress_line_shows_a_loss_near_zero_and_the_mean_reward() -> None:
    from qie.training.loop import progress_measures

    assert progress_measures(3.1e-7, {"reward_mean": 0.61234, "kl": 1.0}) == {"loss": "3.1e-07", "reward": "0.6123"}
    assert progress_measures(1.29347, {}) == {"loss": "1.293"}  # was 0.0000 for GRPO's, with no reward
