"""What the command line answers before anything is built, in qie's one style: one `qie: error:` line and exit 2 for
an old spelling of a renamed key, and for Hydra's own composition errors (an unknown key, a preset that does not
exist, a value of the wrong type or outside an enum, an override the grammar cannot read)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hydra.errors import HydraException

from qie.checks import compose
from qie.errors import ConfigError


@pytest.fixture(autouse=True)
def _wait_policy_kept(monkeypatch) -> None:
    """`main_of` sets OMP_WAIT_POLICY for the stage's process: given back after each test (monkeypatch's undo)."""
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))


CASES = [
    # old spellings of the last releases, each answered with the new one
    (
        ["train.objective=dpo"],
        "train.objective=dpo is an old spelling: the preset is chosen as train/objective=dpo "
        "(its settings are train.objective.KEY)",
    ),
    (["train.dpo.beta=500"], "train.dpo.beta is an old spelling: write train/objective=dpo train.objective.beta=500"),
    (
        ["train.distill.student_steps=2"],
        "train.distill.student_steps is an old spelling: write train/objective=distill train.objective.student_steps=2",
    ),
    (
        ["cache.url=s3://bucket/cache"],
        "cache.url is an old spelling: write cache=remote cache.backend.url=s3://bucket/cache",
    ),
    (
        ["+cache.local_dir=/node/cache"],
        "cache.local_dir is an old spelling: write cache=remote cache.backend.local_dir=/node/cache",
    ),
    (["cache.startup_check=files"], "cache.startup_check is an old spelling: write +cache.backend.startup_check=files"),
    (
        ["train.optimizer=adafactor"],
        "train.optimizer=adafactor is an old spelling: the preset is chosen as "
        "train/optimizer=adafactor (its settings are train.optimizer.KEY)",
    ),
    # Hydra's composition errors
    (["train.max_step=5"], "unknown key train.max_step: did you mean train.max_steps?"),
    (["cache=nvme"], "cache=nvme is not a preset of cache: choose one of memory, none, remote, ssd"),
    (
        ["train/objective=dop"],
        "train/objective=dop is not a preset of train/objective: choose one of awm, distill, dpo, "
        "flow_matching, grpo, nft (did you mean train/objective=dpo?)",
    ),
    (["train.learning_rate=abc"], "train.learning_rate: Value 'abc' of type 'str' could not be converted to Float"),
    (["model.quantize=fp7"], "model.quantize: Invalid value 'fp7', expected one of [none, fp8, int8, int4, nf4]"),
    (
        ["train.lora.rank=[1"],
        "the override 'train.lora.rank=[1' cannot be read: no viable alternative at input "
        "'[1' (Hydra's override grammar)",
    ),
]


@pytest.mark.parametrize("args,line", CASES, ids=[c[0][0] for c in CASES])
def test_the_command_line_answers_in_one_line(args: list[str], line: str, monkeypatch, capsys) -> None:
    from qie import train as cli

    monkeypatch.setattr(sys, "argv", ["qie.train", *args])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as end:
        cli.main_of(cli.main, "train")
    assert end.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"qie: error: {line}"]
    assert "HYDRA_FULL_ERROR" not in os.environ  # given back: a stage's own processes see the user's environment


def test_compose_answers_old_spellings_and_hydras_errors_alike(tmp_path: Path) -> None:
    """`compose()` (code and notebooks) raises the same one line; an old key in a config file of one's own is named
    with its file."""
    with pytest.raises(ConfigError, match=r"^train\.dpo\.beta is an old spelling: write train/objective=dpo"):
        compose("train", ["train.dpo.beta=500"])
    with pytest.raises(ConfigError, match=r"^unknown key train\.max_step: did you mean train\.max_steps\?$"):
        compose("train", ["train.max_step=5"])
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\ntrain:\n  dpo:\n    beta: 3\n")
    with pytest.raises(ConfigError) as err:
        compose("train", [f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine"])
    assert str(err.value) == (
        "experiment/mine.yaml: train.dpo is an old spelling: it is train.objective now (with train/objective=dpo)"
    )


def test_hydra_full_error_set_by_the_user_keeps_hydras_report(monkeypatch) -> None:
    from qie import train as cli

    monkeypatch.setattr(sys, "argv", ["qie.train", "train.max_step=5"])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(HydraException, match="Could not override 'train.max_step'"):
        cli.main_of(cli.main, "train")
    assert os.environ["HYDRA_FULL_ERROR"] == "1"


def test_a_stage_run_from_the_command_line_leaves_its_objects_to_the_exit(monkeypatch, tmp_path: Path) -> None:
    """Once a stage returns, its process ends: the objects it made are frozen out of the collector, so the
    interpreter's last collection does not walk them all (seconds after a training's last step)."""
    import gc

    from qie import cli

    monkeypatch.setattr(cli, "run_dir", lambda: tmp_path)  # outside Hydra's CLI: no job folder to ask it for
    before = gc.get_freeze_count()
    try:
        assert cli.run_stage("plan", lambda: lambda checked, run_dir: run_dir, compose("plan", [])) == tmp_path
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


def test_the_entry_points_have_torchs_threads_wait_passively_unless_told(monkeypatch) -> None:
    from qie import cli

    seen = []
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cli.main_of(lambda: seen.append(os.environ.get("OMP_WAIT_POLICY")), "train", argv=[])
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cli.main_of(lambda: seen.append(os.environ.get("OMP_WAIT_POLICY")), "train", argv=[])
    assert seen == ["PASSIVE", "ACTIVE"]


@pytest.mark.parametrize(
    "stage,args,line",
    [
        ("train", ["train.lora.rnk=3"], "unknown key train.lora.rnk: did you mean train.lora.rank?"),
        ("train", ["trian.max_steps=3"], "unknown key trian: did you mean train?"),
        ("eval", ["eval.tiles=3"], "unknown key eval.tiles: did you mean eval.tile?"),
        ("plan", ["gpu_memory=24"], "unknown key gpu_memory: did you mean gpu_memory_gb?"),
        ("train", ["model=tiny_t2", "train.max_steps=3"], "model=tiny_t2 is not a preset of model: choose one of"),
        ("train", ["train/optimizer=adam"], "train/optimizer=adam is not a preset of train/optimizer: choose one of"),
        # left to Hydra or to the component's class: any key under a node that takes any, +/~/++, sweeps, own trees
        ("train", ["train.optimizer.betas=[0.9,0.99]", "cache.backend.url=s3://b"], None),
        ("eval", ["eval.rewards.mine._target_=pkg.Cls"], None),
        ("train", ["+train.extra=1", "~validation.prompts", "++train.max_steps=2", "model=tiny,tiny_t2i"], None),
        ("train", ["hydra.searchpath=[file:///x]", "model=mine"], None),
        ("train", ["--cfg", "job", "model=tiny"], None),
    ],
)
def test_overrides_are_read_against_the_schema_and_the_tree_before_hydra_composes(stage, args, line) -> None:
    """The answers are Hydra's (as `compose` raises them): only sooner."""
    from qie.checks.overrides import override_problem

    found = override_problem(stage, args)
    assert found == line if line is None or line.endswith("?") else found.startswith(line)
    if line is not None:
        with pytest.raises(ConfigError) as hydras:  # the same words when Hydra finds it
            compose(stage, ["hydra.searchpath=[]", *args])
        assert str(hydras.value) == found


def test_every_key_of_every_stages_composed_config_reads_well_before_hydra_composes() -> None:
    """The early reading refuses no key Hydra takes: each leaf of each stage's composed defaults passes it."""
    from omegaconf import OmegaConf

    from qie.checks.overrides import override_problem
    from qie.config import STAGES

    def leaves(node, prefix: str = "") -> list[str]:
        if not isinstance(node, dict) or not node:
            return [prefix]
        return [k for key, value in node.items() for k in leaves(value, f"{prefix}.{key}" if prefix else key)]

    for stage in STAGES:
        keys = leaves(OmegaConf.to_container(compose(stage, checked=False), resolve=False))
        assert len(keys) > 3, stage
        assert [(k, p) for k in keys if (p := override_problem(stage, [f"{k}=1"]))] == [], stage
