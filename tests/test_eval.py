"""The eval stage: the base model and LoRAs side by side on held-out rows, scored by rewards (built-in, a judge,
one from outside qie); its three outputs and their schema; what it refuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import small_config
from PIL import Image

from qie.demo.synthetic import make_dataset
from qie.errors import ConfigError
from qie.evaluation import grid
from qie.stages import evaluation

FAST = ["predict.true_cfg_scale=1.0", "eval.tile=64"]  # tiles at the images' size: the picture holds the edits
NO_JUDGE = ["~eval.rewards.judge_instruction", "~eval.rewards.judge_preservation"]
BUILT_IN = ["pixel_error", "edit_psnr", "edit_ssim", "outside_change", "judge_instruction", "judge_preservation"]
COLOUR = ["+eval.rewards.colour._target_=plugins.colour.Colour", "+eval.rewards.colour.rgb=[0,0,255]"]


def _manifest(root: Path, categories: list[str | None], targets: bool = True) -> Path:
    """A manifest over the synthetic rows in `root` (folder layout), one row per category given."""
    rows = []
    for i, category in enumerate(categories):
        prompt = (root / "training_images" / f"{i:05d}.txt").read_text().strip()
        row = {"controls": [f"control_images/{i:05d}.png"], "prompt": prompt}
        row.update({"target": f"training_images/{i:05d}.png"} if targets else {})
        row.update({"category": category} if category else {})
        rows.append(json.dumps(row))
    path = root / ("heldout.jsonl" if targets else "untargeted.jsonl")
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_dataset(tmp_path_factory.mktemp("eval_rows"), train=0, heldout=3, size=64) / "heldout"
    return _manifest(root, ["colour", "colour", None])


@pytest.fixture(scope="module")
def lora(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA of the tiny transformer with random (non-zero) weights: it changes every edit."""
    from stage_edges import parts_of

    from qie.adapters.lora import add_lora, save_lora
    from qie.config import typed

    model = typed(small_config("eval").model)
    transformer = parts_of(model, ["transformer"], {"transformer": "cpu"}).transformer
    add_lora(transformer, 4, 4, ["to_q", "to_k", "to_v", "to_out.0"])
    generator = torch.Generator().manual_seed(0)
    for name, p in transformer.named_parameters():  # both factors seeded: the same LoRA in every process
        if "lora_A" in name or "lora_B" in name:
            p.data = torch.randn(p.shape, generator=generator) * (2.0 if "lora_B" in name else 0.5)
    return save_lora(transformer, tmp_path_factory.mktemp("lora") / "random_lora")


def _eval(tmp: Path, *overrides: str) -> dict:
    return evaluation.run(small_config("eval", *FAST, *overrides), tmp)


def _edit(picture: Path, row: int, column: int, tile: int = 64) -> Image.Image:
    """One tile of eval.png: row `row`'s image in column `column` (control, target, then each run)."""
    top = grid.TITLE_HEIGHT + row * (tile + grid.CAPTION_HEIGHT)
    return Image.open(picture).convert("RGB").crop((column * tile, top, (column + 1) * tile, top + tile))


def test_eval_writes_runs_side_by_side_with_every_metric(tmp_path: Path, rows: Path, lora: Path) -> None:
    report = _eval(tmp_path, f"data.path={rows}", f"eval.loras=[none,{lora}]", *COLOUR)
    on_disk = json.loads((tmp_path / "eval.json").read_text())
    assert list(on_disk["runs"]) == ["base", "random_lora"]
    assert on_disk["runs"]["random_lora"]["lora"] == str(lora)
    assert on_disk["directions"] == {
        **{n: "higher" for n in BUILT_IN + ["colour"]},
        "pixel_error": "lower",
        "outside_change": "lower",
    }
    for run in on_disk["runs"].values():
        assert list(run["metrics"]) == BUILT_IN + ["colour"]  # the reward from outside qie among them
        assert all(isinstance(v, float) for v in run["metrics"].values())
        assert 0 < run["metrics"]["pixel_error"] < 1
        assert list(run["categories"]) == ["colour"] and run["categories"]["colour"]["rows"] == 2
        ids = [f"training_images/0000{i}" for i in range(3)]  # a manifest row's id: its target's path
        assert list(run["samples"]) == ids
        first = run["samples"][ids[0]]
        assert first["category"] == "colour" and first["seeds"]["0"] == first["metrics"]
        # A category's mean is the mean of its rows'.
        mean = sum(run["samples"][i]["metrics"]["pixel_error"] for i in ids[:2]) / 2
        assert run["categories"]["colour"]["metrics"]["pixel_error"] == pytest.approx(mean, abs=1e-12)
    base, tuned = (on_disk["runs"][r]["metrics"] for r in on_disk["runs"])
    assert base["pixel_error"] != tuned["pixel_error"]  # the LoRA's edits were scored, not the base model's again
    assert on_disk["rewards"]["colour"] == {
        "target": "plugins.colour.Colour",
        "higher_is_better": True,
        "needs": [],
        "rgb": [0, 0, 255],
    }
    judge = on_disk["rewards"]["judge_instruction"]
    assert "{instruction}" in judge["prompt"] and "Answer yes or no" in judge["prompt"]
    assert len(judge["fingerprint"]) == 64 and judge["text_encoder"].endswith("text_encoder")
    assert on_disk == json.loads(json.dumps(report))
    table = (tmp_path / "eval.md").read_text()
    assert "| metric | better | base | random_lora |" in table and "## colour (2 row(s))" in table
    assert f"| pixel_error | lower | {base['pixel_error']:.4f} | {tuned['pixel_error']:.4f} |" in table
    assert Image.open(tmp_path / "eval.png").size == grid.grid_size(3, 4, 64)


def test_a_lora_closer_to_the_targets_scores_a_lower_pixel_error(tmp_path: Path, rows: Path, lora: Path) -> None:
    # The LoRA's own edits made the targets: eval must score the LoRA's edits (at the same seeds) as exact.
    _eval(tmp_path / "first", f"data.path={rows}", f"eval.loras=[{lora}]", *NO_JUDGE)
    root = rows.parent
    for i in range(3):
        _edit(tmp_path / "first" / "eval.png", i, 2).save(root / "training_images" / f"lora_{i:05d}.png")
    manifest = root / "lora_targets.jsonl"
    lines = [json.loads(line) for line in rows.read_text().splitlines()]
    manifest.write_text(
        "".join(json.dumps({**r, "target": f"training_images/lora_{i:05d}.png"}) + "\n" for i, r in enumerate(lines))
    )
    report = _eval(tmp_path / "second", f"data.path={manifest}", f"eval.loras=[none,{lora}]", *NO_JUDGE)
    assert report["runs"]["random_lora"]["metrics"]["pixel_error"] == 0.0
    assert report["runs"]["base"]["metrics"]["pixel_error"] > 0.02


def test_rows_without_targets_are_refused_only_for_metrics_that_need_one(tmp_path: Path, rows: Path) -> None:
    untargeted = _manifest(rows.parent, [None, None], targets=False)
    with pytest.raises(ConfigError) as e:
        _eval(tmp_path, f"data.path={untargeted}")
    assert str(e.value) == (
        f"2 row(s) of {untargeted} have no target (first: 'control_images/00000'), which eval.rewards.pixel_error "
        "compares with: give them targets, or drop those metrics (~eval.rewards.pixel_error ~eval.rewards.edit_psnr "
        "~eval.rewards.edit_ssim)"
    )
    assert not (tmp_path / "eval.json").exists()
    judged_only = [
        "~eval.rewards.pixel_error",
        "~eval.rewards.edit_psnr",
        "~eval.rewards.edit_ssim",
        "~eval.rewards.outside_change",
    ]
    report = _eval(tmp_path, f"data.path={untargeted}", *judged_only)
    assert list(report["runs"]["base"]["metrics"]) == ["judge_instruction", "judge_preservation"]
    assert all(0 < v < 1 for v in report["runs"]["base"]["metrics"].values())


def test_the_judge_is_deterministic_and_records_what_it_asked(tiny_path: Path) -> None:
    from qie.config import typed
    from qie.evaluation.judge import QUESTIONS, VlmJudge

    model = typed(small_config("eval").model)
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    controls = [[torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(i))] for i in (1, 2)]
    prompts = ["make the circle red", "make the square blue"]
    judge = VlmJudge(model, "preservation")
    first = judge(images, controls, prompts)
    again = VlmJudge(model, "preservation")(images, controls, prompts)
    assert first.shape == (2,) and torch.equal(first, again) and bool(((first > 0) & (first < 1)).all())
    assert not torch.equal(first, VlmJudge(model, "instruction")(images, controls, prompts))  # another question
    described = judge.describe()
    assert set(described) == {"question", "prompt", "score", "text_encoder", "fingerprint"}
    assert QUESTIONS["preservation"].split("{inputs}")[0] == "" and "Apart from what" in described["prompt"]
    # Without a control image there is nothing to preserve: nan, left out of the means.
    assert torch.isnan(judge(images[:1], [[]], prompts[:1])).all()
    with pytest.raises(ConfigError, match="question='taste': choose one of instruction, preservation"):
        VlmJudge(model, "taste")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["+eval.rewards.pixel_error.scale=2"],
            "unknown key eval.rewards.pixel_error.scale: qie.evaluation.metrics.PixelError's parameters are none",
        ),
        (
            ["+eval.rewards.judge_instruction.model=x"],
            "unknown key eval.rewards.judge_instruction.model: qie.evaluation.judge.VlmJudge's parameters are device, "
            "question, text_encoder_path",
        ),
        (
            ["+eval.rewards.x._target_=qie.nothing.Here"],
            "eval.rewards.x._target_='qie.nothing.Here' cannot be imported",
        ),
        (["+eval.rewards.x.rgb=1"], "eval.rewards.x has no _target_"),
    ],
)
def test_reward_keys_are_checked_against_the_constructor_when_composed(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        small_config("eval", *overrides)
    assert str(e.value).startswith(message)


def test_a_reward_without_a_constructor_of_its_own_takes_no_keys_before_its_first_instance() -> None:
    """typing gives a Protocol's subclass a `(*args, **kwargs)` placeholder until it is first instantiated: the key
    check must not take that for a constructor that accepts anything."""
    from qie.evaluation.build import constructor_parameters
    from qie.extend import Reward

    class Plain(Reward):
        def __call__(self, images, controls, prompts, **needed):
            return images.flatten(1).mean(dim=1)

    assert constructor_parameters(Plain) == []
    Plain()
    assert constructor_parameters(Plain) == []


def test_a_class_that_is_no_reward_is_refused_in_one_line(tmp_path: Path, rows: Path) -> None:
    with pytest.raises(ConfigError) as e:
        _eval(tmp_path, f"data.path={rows}", "+eval.rewards.odd._target_=pathlib.PurePath")
    assert str(e.value).startswith("eval.rewards.odd: pathlib.PurePath is not a qie.extend.Reward: subclass it")


@pytest.mark.subprocess
def test_the_cli_names_a_missing_lora_in_one_line(tmp_path: Path, rows: Path) -> None:
    missing = tmp_path / "missing.safetensors"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "qie.eval",
            "model=tiny",
            f"data.path={rows}",
            f"eval.loras=[none,{missing}]",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("qie: error: ") and str(missing) in line


def test_the_demo_preset_composes_for_eval() -> None:
    """The guide's `python -m qie.eval experiment=demo ...`: the demo's model and sampling settings."""
    from qie.checks import compose

    cfg = compose("eval", ["experiment=demo"])
    assert (cfg.model.name, cfg.predict.num_inference_steps, cfg.predict.true_cfg_scale) == ("tiny_demo", 20, 1.0)
    assert cfg.cache.mode == "lazy" and list(cfg.eval.loras) == ["none"]
