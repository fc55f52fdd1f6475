"""What a new user met: torchrun's elastic restarts without `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` named at start in
one line; the model card's `base_model` of a local model (a Hugging Face cache snapshot, or `export.base_model`), its
instructions of the built-in data set, and its `qie.infer` line with `predict.image` for an edit model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from qie.checks import compose
from qie.errors import ConfigError


def test_elastic_restarts_without_the_rendezvous_setting_are_refused_at_start(
    tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qie.stages import train
    from qie.stages.processes import elastic_problem

    assert elastic_problem({"TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert elastic_problem({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) is None
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    cfg = compose("train", [f"model.pretrained_model_name_or_path={tiny_path}", "data.path=/nowhere/needed"])
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        train.run(cfg, run)
    assert str(info.value).startswith(
        "torchrun --max-restarts=3 needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment: without it a "
        "restarted process may wait for a peer of the attempt before until the timeout (pytorch#135712)"
    )
    assert not run.exists()


def recorded_run(tmp_path: Path, source: str, data: Path) -> Path:
    """A run folder with a LoRA, Hydra's record (the model read from `source`, no data.path: the built-in data set)
    and the run's own record (its data path, as the train stage writes it)."""
    run = tmp_path / "run"
    (run / "lora").mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    key = "transformer.transformer_blocks.0.attn.to_q.lora_{}.weight"
    state = {key.format(ab): torch.randn(4, 8, generator=gen) for ab in "AB"}
    save_file(state, str(run / "lora" / "pytorch_lora_weights.safetensors"))
    config = OmegaConf.to_container(compose("train", ["model=tiny"]), resolve=False)
    config["model"]["pretrained_model_name_or_path"] = source
    config["data"]["path"] = None
    (run / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create(config), run / ".hydra" / "config.yaml")
    recorded = {"command": "python -m qie.train", "config": {"data": {"path": str(data)}}}
    (run / "run_info.json").write_text(json.dumps(recorded))
    return run


@pytest.fixture(scope="module")
def builtin_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qie.demo.synthetic import make_dataset

    return make_dataset(tmp_path_factory.mktemp("builtin"), train=3, heldout=0, size=32) / "train"


def test_the_card_reads_a_hub_cache_snapshot_the_builtin_data_and_says_predict_image(
    tmp_path: Path, builtin_like: Path
) -> None:
    from huggingface_hub import ModelCard

    from qie.stages import export

    snapshot = tmp_path / "hub" / "models--Qwen--Qwen-Image-Edit-2509" / "snapshots" / "0123abcd"
    run = recorded_run(tmp_path, str(snapshot), builtin_like)
    export.run(compose("export", [f"export.run_dir={run}", f"export.out={tmp_path / 'out'}"]))
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert card.data.to_dict()["base_model"] == "Qwen/Qwen-Image-Edit-2509"
    assert "was not readable" not in card.text and "The data set's most common instructions" in card.text
    assert "python -m qie.infer model=tiny predict.image=in.png predict.lora=pytorch_lora_weights.safetensors" in (
        card.text
    )


def test_export_base_model_names_the_hub_repo_of_a_local_folder(tmp_path: Path, builtin_like: Path) -> None:
    from huggingface_hub import ModelCard

    from qie.stages import export

    run = recorded_run(tmp_path, str(tmp_path / "my-local-copy"), builtin_like)
    out = tmp_path / "out"
    export.run(compose("export", [f"export.run_dir={run}", f"export.out={out}"]))
    assert "base_model" not in ModelCard.load(out / "README.md").data.to_dict()
    args = [f"export.run_dir={run}", f"export.out={out}", "export.overwrite=true", "export.base_model=Qwen/Qwen-Image"]
    export.run(compose("export", args))
    assert ModelCard.load(out / "README.md").data.to_dict()["base_model"] == "Qwen/Qwen-Image"
