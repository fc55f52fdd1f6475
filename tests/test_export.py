"""The export (`python -m qie.export RUN_DIR OUT`): a Hub-ready folder whose model card huggingface_hub's
`ModelCard` reads, LoRA files every tool applies alike, sample edits with their prompts; and the upload, which
offline stops in one line and keeps the folder."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from qie.checks import compose
from qie.cli import keyed_positionals
from qie.errors import ConfigError


@pytest.fixture(scope="module")
def trained_run(small_cfg, cached_data, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-step LoRA run with validation images and a held-out loss, with the config Hydra would have recorded
    (the base named as its hub id, which the export reads but never loads)."""
    from qie.stages import train

    run = tmp_path_factory.mktemp("run") / "my-edits"
    cfg = small_cfg(
        "train",
        *cached_data.overrides,
        "validation.every=2",
        "validation.heldout_samples=2",
        "logging.log_images_count=2",
    )
    train.run(cfg, run)
    recorded = OmegaConf.to_container(cfg, resolve=True)
    recorded["model"]["pretrained_model_name_or_path"] = "Qwen/Qwen-Image-Edit"
    (run / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create(recorded), run / ".hydra" / "config.yaml")
    return run


def test_export_writes_a_card_the_hub_reads_and_every_lora_file(trained_run: Path, tmp_path: Path) -> None:
    from huggingface_hub import ModelCard

    from qie.adapters.lora import read_lora
    from qie.models import families
    from qie.stages import export

    out = tmp_path / "export"
    result = export.run(compose("export", [f"export.run_dir={trained_run}", f"export.out={out}"]))
    assert result["missing"] == {} and result["url"] is None
    card = ModelCard.load(out / "README.md")
    meta = card.data.to_dict()
    assert meta["base_model"] == "Qwen/Qwen-Image-Edit"
    assert (meta["library_name"], meta["license"], meta["pipeline_tag"]) == (
        "diffusers",
        "apache-2.0",
        "image-to-image",
    )
    assert {"lora", "qwen-image"} <= set(meta["tags"])
    # The sample edits: the last validation step's images, with the prompts and inputs they were sampled from.
    inputs = {
        i["prompt"] for i in OmegaConf.to_container(OmegaConf.load(trained_run / "validation" / "inputs.json")).values()
    }
    assert len(meta["widget"]) == 2 and {w["text"] for w in meta["widget"]} == inputs
    assert sorted(p.name for p in (out / "samples").iterdir()) == [
        "00000.png",
        "00000_input.png",
        "00001.png",
        "00001_input.png",
    ]
    heldout = OmegaConf.load(trained_run / "train_result.json")["heldout_loss"]
    assert f"| heldout_loss | {heldout:.4g} |" in card.text
    assert "load_lora_weights" in card.text and "LoraLoaderModelOnly" in card.text
    # The ComfyUI and kohya files made from the diffusers one read back as the same weights.
    loader = families()["qwen_image"].lora_loader_class()
    expected, _, _ = read_lora(out / "pytorch_lora_weights.safetensors", loader)
    for name in ("comfyui_lora.safetensors", "kohya_lora.safetensors"):
        state, _, _ = read_lora(out / name, loader)
        assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected), name


def test_export_names_what_cannot_be_exported(trained_run: Path, tmp_path: Path) -> None:
    from qie.stages import export

    with pytest.raises(ConfigError, match="export.out is not set"):
        export.run(compose("export", [f"export.run_dir={trained_run}"]))
    with pytest.raises(ConfigError, match="export.samples=-1 is out of range"):
        export.run(compose("export", [f"export.run_dir={trained_run}", f"export.out={tmp_path}", "export.samples=-1"]))
    with pytest.raises(ConfigError, match="holds no trained LoRA"):
        export.run(compose("export", [f"export.run_dir={tmp_path}", f"export.out={tmp_path / 'x'}"]))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "train_result.json").write_text('{"transformer": "x"}')
    with pytest.raises(ConfigError, match="is a full fine-tune.*qie.extract_lora"):
        export.run(compose("export", [f"export.run_dir={tmp_path / 'full'}", f"export.out={tmp_path / 'x'}"]))


@pytest.mark.subprocess
def test_offline_push_stops_in_one_line_and_keeps_the_folder(trained_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "to push"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "qie.export", str(trained_run), str(out), "export.push_to_hub=someone/edits"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"qie: error: export.push_to_hub=someone/edits: HF_HUB_OFFLINE is set, nothing was sent; the folder {out} is "
        f"written; upload it later with: hf upload someone/edits {out}"
    ]
    assert {p.name for p in out.iterdir()} >= {"README.md", "pytorch_lora_weights.safetensors", "samples"}


def test_push_to_a_closed_port_is_one_error_and_the_upload_uses_the_hub_api(tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub
    from huggingface_hub import constants

    from qie.publish.hub import HubError, push_folder

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_token")
    (tmp_path / "README.md").write_text("card")
    with pytest.raises(HubError, match=f"the Hub at http://127.0.0.1:{port} cannot be reached") as e:
        push_folder(tmp_path, "someone/edits")
    assert len(str(e.value).splitlines()) == 1 and (tmp_path / "README.md").is_file()

    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, *a, **k: calls.append(("create", a, k)))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **k: calls.append(("upload", k)) or "url")
    assert push_folder(tmp_path, "someone/edits", private=True) == "url"
    assert calls[0] == ("create", ("someone/edits",), {"repo_type": "model", "private": True, "exist_ok": True})
    assert calls[1][1]["folder_path"] == str(tmp_path) and calls[1][1]["repo_id"] == "someone/edits"


def test_positional_run_and_out_become_overrides() -> None:
    keys = ("export.run_dir", "export.out")
    assert keyed_positionals(["runs/a", "my out", "export.push_to_hub=u/n"], keys) == [
        "export.run_dir='runs/a'",
        "export.out='my out'",
        "export.push_to_hub=u/n",
    ]
    assert keyed_positionals(["--cfg", "job", "r", "o'x"], keys) == [
        "--cfg",
        "job",
        "export.run_dir='r'",
        "export.out='o\\'x'",
    ]


def test_the_demo_ends_with_its_export_folder(tmp_path: Path) -> None:
    from huggingface_hub import ModelCard

    from qie.demo.run import run

    cfg = compose(
        "demo",
        [
            "demo.train_samples=4",
            "demo.heldout_samples=2",
            "train.max_steps=2",
            "train.checkpoint_every=0",
            "predict.num_inference_steps=2",
            "data.num_workers=0",
            "logging.report_to=none",
        ],
    )
    report = run(cfg, tmp_path)
    card = ModelCard.load(tmp_path / "export" / "README.md")
    assert card.data.pipeline_tag == "image-to-image"
    assert [w["text"] for w in card.data.widget] == [
        s.read_text().strip() for s in sorted((tmp_path / "data" / "heldout" / "training_images").glob("*.txt"))
    ]
    assert f"| heldout_loss | {report['heldout_loss_after']:.4g} |" in card.text
    assert (tmp_path / "export" / "samples" / "demo.png").is_file()
    assert (tmp_path / "export" / "kohya_lora.safetensors").is_file()


def test_a_text_to_image_run_on_a_fused_base(tmp_path: Path) -> None:
    """The card of a run of the text-to-image model on a base with a LoRA fused in: its hub id and task, and how to
    fuse the same LoRA before loading this one (read from the LoRA file's header)."""
    from huggingface_hub import ModelCard
    from safetensors.torch import save_file

    from qie.adapters.lora_files import base_header
    from qie.stages import export

    run = tmp_path / "t2i-run"
    (run / "lora").mkdir(parents=True)
    pair = {
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 8),
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(8, 2),
    }
    fused = [{"file": "lightning.safetensors", "fingerprint": "ab", "scale": 0.5}]
    save_file(pair, str(run / "lora" / "pytorch_lora_weights.safetensors"), metadata=base_header(fused))
    (run / ".hydra").mkdir()
    OmegaConf.save(compose("train", ["model=qwen_image"]), run / ".hydra" / "config.yaml")
    export.run(compose("export", [f"export.run_dir={run}", f"export.out={tmp_path / 'out'}", "export.license=mit"]))
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert (card.data.base_model, card.data.pipeline_tag, card.data.license) == (
        "Qwen/Qwen-Image",
        "text-to-image",
        "mit",
    )
    assert "from diffusers import QwenImagePipeline" in card.text
    assert 'pipe.load_lora_weights("lightning.safetensors")\npipe.fuse_lora(lora_scale=0.5)' in card.text
    assert "| `lightning.safetensors` | 0.5 |" in card.text
