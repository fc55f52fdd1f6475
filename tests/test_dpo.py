"""Preference training (`train/objective=dpo`): the pair data, the objective against its formula computed by hand
with separate models, the reference switch, and the refusals."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import hf_extra_image_column, write_noise_image
from stage_edges import parts_of
from test_step import fixed_batch

from qie.adapters.lora import add_lora, load_lora, save_lora
from qie.checks import compose
from qie.config import typed
from qie.data.manifest import scan_manifest
from qie.data.scan import scan_folder
from qie.errors import ConfigError
from qie.models import model_spec
from qie.training.objectives import ObjectiveUse, build_objective, check_use, field_names
from qie.training.objectives.dpo import Dpo, DpoSettings, accuracy
from qie.training.objectives.flow_matching import FlowMatching
from qie.training.objectives.run_context import RunContext
from qie.training.timesteps import SigmaSampling

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def pairs_batch(seed: int = 0):
    batch = fixed_batch(seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    mask = torch.ones(2, 1, 1, 8, 8)
    mask[..., :4] = 0.25  # a loss mask: the left half counts a quarter
    rejected = torch.randn(batch.latents.shape, generator=g)
    return dataclasses.replace(batch, fields={"rejected": rejected}, loss_mask=mask)


def randomised(transformer, seed: int) -> None:
    """Give the adapter's B matrices values, so the adapter changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    for name, p in transformer.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.05


def by_hand(policy, reference, family, batch, noise, sigmas, beta: float, sft: float = 0.0) -> torch.Tensor:
    """The DPO loss from four separate per-sample errors: each result on its own batch, each model on its own."""
    preferred, rejected = batch, dataclasses.replace(batch, latents=batch.fields["rejected"])

    def err(model, b):
        return family.loss(model, dataclasses.replace(b, fields={}), noise, sigmas, "none",
                           per_sample=True)  # fmt: skip

    with torch.no_grad():
        ref_w, ref_l = err(reference, preferred), err(reference, rejected)
    won, lost = err(policy, preferred), err(policy, rejected)
    z = -0.5 * beta * ((won - ref_w) - (lost - ref_l))
    return -torch.nn.functional.logsigmoid(z).mean() + sft * won.mean()


DPO = {"_target_": "qie.training.objectives.dpo.Dpo"}
FLOW_MATCHING = {"_target_": "qie.training.objectives.flow_matching.FlowMatching"}


@pytest.fixture(scope="module")
def tiny(small_cfg):
    cfg = small_cfg("train")
    return cfg, model_spec(typed(cfg.model)).family


def objective(family, policy, **options):
    context = RunContext(family=family, sigmas=SigmaSampling(method="uniform"), transformer=policy)
    return build_objective({**DPO, **options}, context)


def test_dpo_loss_equals_its_formula_with_the_base_as_reference_and_leaves_the_trained_set_alone(tiny) -> None:
    cfg, family = tiny
    base = parts_of(cfg.model, ["transformer"]).transformer
    policy = parts_of(cfg.model, ["transformer"]).transformer
    params = add_lora(policy, 4, 4, TARGETS)
    randomised(policy, 1)
    dpo = objective(family, policy, beta=500.0, sft_weight=0.3)
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    batch, g = pairs_batch(), torch.Generator().manual_seed(5)
    loss = dpo.loss(policy, batch, g)
    noise, sigmas = dpo.context.noise_and_sigmas(batch, torch.Generator().manual_seed(5))
    want = by_hand(policy, base, family, batch, noise, sigmas, 500.0, 0.3)
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=0)  # β magnifies the float rounding of other batchings
    assert abs(loss.item() - math.log(2)) > 1e-3  # the adapter made policy and reference differ
    loss.backward()  # the gradient reaches the trained weights only, through the policy pass
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_B" in n)
    assert (
        {n for n, p in policy.named_parameters() if p.requires_grad}
        == trained
        == {n for n, p in policy.named_parameters() if any(p is q for q in params)}
    )
    metrics = dpo.step_metrics()
    assert set(metrics) == {"reward_accuracy", "reward_margin"} and dpo.step_metrics() == {}  # read once
    assert metrics["reward_accuracy"] in (0.0, 0.5, 1.0)


def test_a_fresh_adapter_is_its_own_reference_so_the_first_loss_is_log_2(tiny) -> None:
    cfg, family = tiny
    policy = parts_of(cfg.model, ["transformer"]).transformer
    add_lora(policy, 4, 4, TARGETS)  # B = 0: the policy is the base
    dpo = objective(family, policy, beta=2000.0)
    batch = pairs_batch(1)
    noise, sigmas = torch.randn(batch.latents.shape), torch.tensor([0.3, 0.7])
    out = dpo.evaluate(policy, batch, noise, sigmas)
    assert out == {"loss": pytest.approx(math.log(2), abs=1e-7), "reward_accuracy": 0.5, "reward_margin": 0.0}


def test_a_reference_lora_is_the_base_with_that_lora_and_is_neither_trained_nor_saved(tiny, tmp_path: Path) -> None:
    cfg, family = tiny
    donor = parts_of(cfg.model, ["transformer"]).transformer
    add_lora(donor, 2, 2, ["to_q", "to_v"])
    randomised(donor, 2)
    file = save_lora(donor, tmp_path / "ref")
    reference = parts_of(cfg.model, ["transformer"]).transformer
    load_lora(reference, file)
    policy = parts_of(cfg.model, ["transformer"]).transformer
    add_lora(policy, 4, 4, TARGETS)
    randomised(policy, 3)
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    dpo = objective(family, policy, beta=300.0, reference_lora=str(file))
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trained  # the reference is frozen
    batch = pairs_batch(2)
    loss = dpo.loss(policy, batch, torch.Generator().manual_seed(9))
    noise, sigmas = dpo.context.noise_and_sigmas(batch, torch.Generator().manual_seed(9))
    torch.testing.assert_close(loss, by_hand(policy, reference, family, batch, noise, sigmas, 300.0), rtol=1e-4,
                               atol=0)  # fmt: skip
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trained
    from qie.adapters.lora import lora_state_dict

    assert not any("reference" in k for k in lora_state_dict(policy))  # only the trained adapter is saved


def test_accuracy_counts_ties_half() -> None:
    assert accuracy(torch.tensor([1.0, -1.0, 0.0, 2.0])).item() == pytest.approx(0.625)


def test_dpo_settings_and_uses_are_refused_in_one_line(tiny, tmp_path: Path) -> None:
    cfg, family = tiny
    assert compose("train", ["train/objective=dpo"]).train.objective.beta == DpoSettings().beta
    assert field_names(Dpo) == {"target", "rejected"} and field_names(FlowMatching) == {"target"}
    check_use(DPO, ObjectiveUse(family, lora=True, regularization=False))
    layered = model_spec(typed(compose("train", ["model=tiny_qwen_image_layered"]).model)).family
    cases = [
        (ObjectiveUse(family, False, False), "train/objective=dpo needs train.mode=lora"),
        (ObjectiveUse(layered, True, False), "train/objective=dpo does not train a layered model"),
        (ObjectiveUse(family, True, True), "does not mix in data.regularization"),
        (ObjectiveUse(family, True, False), r"train.objective.beta=0 is out of range", {"beta": 0}),
        (ObjectiveUse(family, True, False), r"train.objective.sft_weight=-1 is out of range", {"sft_weight": -1}),
        (ObjectiveUse(family, True, False), "does not exist", {"reference_lora": str(tmp_path / "no.safetensors")}),
        (ObjectiveUse(family, True, False), "unknown key train.objective.bta: .*Dpo takes beta", {"bta": 1}),
    ]
    for use, message, *settings in cases:
        with pytest.raises(ConfigError, match=message) as info:
            check_use({**DPO, **(settings[0] if settings else {})}, use)
        assert "\n" not in str(info.value)
    check_use(FLOW_MATCHING, ObjectiveUse(layered, False, True))  # the default takes everything


def test_pairs_are_read_from_a_folder_and_a_manifest_and_a_rejected_image_needs_its_target(tmp_path: Path) -> None:
    root = tmp_path / "folder"
    for sub, seed in (("training_images", 1), ("control_images", 2), ("rejected_images", 3)):
        (root / sub).mkdir(parents=True)
        write_noise_image(root / sub / "a.png", seed)
    (root / "training_images" / "a.txt").write_text("edit a")
    write_noise_image(root / "rejected_images" / "orphan.png", 4)
    data = scan_folder(root, require_target=True)
    assert [(s.id, s.fields.get("rejected")) for s in data.samples] == [("a", root / "rejected_images" / "a.png")]
    assert [(p.id, p.reason) for p in data.problems] == [("orphan", "target image is missing (rejected image found)")]

    (tmp_path / "m").mkdir()
    for name, seed in (("t.png", 1), ("c.png", 2), ("r.png", 3)):
        write_noise_image(tmp_path / "m" / name, seed)
    rows = [{"target": "t.png", "controls": ["c.png"], "prompt": "p", "rejected": "r.png"},
            {"target": "t.png", "controls": ["c.png"], "prompt": "q"},
            {"target": "t.png", "controls": ["c.png"], "prompt": "x", "rejected": "gone.png"},
            {"target": "t.png", "controls": ["c.png"], "prompt": "y", "rejected": 3}]  # fmt: skip
    manifest = tmp_path / "m" / "pairs.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = scan_manifest(manifest, require_target=True)
    assert [s.fields.get("rejected") for s in data.samples] == [tmp_path / "m" / "r.png", None]
    reasons = [p.reason for p in data.problems]
    assert reasons == [f"manifest row 3: image {str(tmp_path / 'm' / 'gone.png')!r} does not exist",
                       "manifest row 4 'rejected' must be a path, got 3"]  # fmt: skip


def test_a_hugging_face_data_set_gives_rejected_results_from_its_column(tmp_path: Path, monkeypatch) -> None:
    rejected, (first, second) = hf_extra_image_column(tmp_path, monkeypatch, "rejected")
    assert first.fields["rejected"].read_bytes() == rejected and "rejected" not in second.fields


def test_the_benchmark_makes_each_demo_edit_a_pair_whose_rejected_shape_has_a_wrong_colour(tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image
    from test_bench_scripts import script

    from qie.demo.synthetic import COLORS, make_dataset

    bench = script("bench_dpo")
    root = make_dataset(tmp_path, train=6, heldout=0) / "train"
    assert bench.add_rejected(root) == 6
    for caption in sorted((root / "training_images").glob("*.txt")):
        wanted = COLORS[caption.read_text().split()[-1]]
        target = np.asarray(Image.open(caption.with_suffix(".png")).convert("RGB"))
        control = np.asarray(Image.open(root / "control_images" / caption.with_suffix(".png").name).convert("RGB"))
        rejected = np.asarray(Image.open(root / "rejected_images" / caption.with_suffix(".png").name).convert("RGB"))
        shape = (target == wanted).all(axis=-1)
        assert shape.any() and (rejected[~shape] == target[~shape]).all()  # the background as the target's
        colour = tuple(int(c) for c in rejected[shape][0])
        assert (rejected[shape] == colour).all() and colour in COLORS.values()  # one of the demo's colours,
        assert colour != tuple(wanted) and colour != tuple(int(c) for c in control[shape][0])  # but not these
