"""`train.adapter=loha|lokr` and `train.lora.use_dora` through the CLI: each trains, resumes exactly, and the
file it writes loads (as qie.infer loads it) into the model as it was trained."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from diffusers import AutoModel
from helpers import CachedData, small_config
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file

from qie.adapters.lora import add_lora, load_lora, load_lora_state
from qie.errors import ConfigError
from qie.stages import train as train_stage

KINDS = {
    "loha": (["train.adapter=loha"], {"adapter": "loha"}, "hada_w1_a"),
    "lokr": (["train.adapter=lokr"], {"adapter": "lokr"}, "lokr_w1"),
    "dora": (["train.lora.use_dora=true"], {"use_dora": True}, "lora_magnitude_vector"),
}
RUN = ["train.max_steps=2", "train.checkpoint_every=2", "train.learning_rate=1e-2", "train.lora.rank=4",
       "train.lora.alpha=8", "data.batch_size=2"]  # fmt: skip


def merged_weights(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in transformer.named_modules():
        if isinstance(m, BaseTunerLayer):
            merged = copy.deepcopy(m)
            merged.merge()
            out[name] = merged.get_base_layer().weight.detach().float()
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_cli_trains_and_the_file_reproduces_the_model(
    kind: str, cached_data: CachedData, tiny_path: Path, tmp_path: Path
) -> None:
    overrides, options, marker = KINDS[kind]
    cfg = small_config("train", *cached_data.overrides, *RUN, *overrides)
    result = train_stage.run(cfg, tmp_path / "run")
    state = load_file(tmp_path / "run" / "checkpoints" / "step-000002" / "state" / "model.safetensors")
    assert any(k.endswith(marker) for k in state)

    # The model as trained: the adapter of this kind with the checkpoint's raw (unfolded) weights.
    trained = AutoModel.from_pretrained(str(tiny_path), subfolder="transformer")
    add_lora(trained, 4, 8, list(cfg.train.lora.target_modules), **options)
    load_lora_state(trained, state)
    loaded = AutoModel.from_pretrained(str(tiny_path), subfolder="transformer")
    load_lora(loaded, result["lora"])
    expected, got = merged_weights(trained), merged_weights(loaded)
    assert sorted(got) == sorted(expected)
    base = dict(AutoModel.from_pretrained(str(tiny_path), subfolder="transformer").named_modules())
    assert any(not torch.equal(w, base[n].weight) for n, w in expected.items())  # training changed the weights
    for name, weight in expected.items():
        torch.testing.assert_close(got[name], weight, rtol=1e-5, atol=1e-6, msg=name)


def test_loha_resumes_exactly(cached_data: CachedData, tmp_path: Path) -> None:
    run = [*cached_data.overrides, *RUN, "train.adapter=loha", "train.max_steps=4"]
    train_stage.run(small_config("train", *run), tmp_path / "whole")
    step2 = tmp_path / "whole" / "checkpoints" / "step-000002"
    train_stage.run(small_config("train", *run, f"train.resume={step2}"), tmp_path / "resumed")
    a = load_file(tmp_path / "whole" / "lora" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "resumed" / "lora" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and any("hada_" in k for k in a)
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-7) for k in a)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["train.adapter=loha", "train.lora.use_dora=true"], "use_dora=true is for train.adapter=lora"),
        (["train.adapter=lokr", "train.lora.dropout=0.1"], "dropout is for train.adapter=lora"),
        (["train.adapter=loha", "train.lora.init=pissa"], "takes true or false"),
    ],
)
def test_options_an_adapter_lacks_are_refused_before_a_model_is_built(
    cached_data: CachedData, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str], match: str
) -> None:
    monkeypatch.setattr(train_stage, "build_train_state", lambda *a: pytest.fail("a model was built"))
    with pytest.raises(ConfigError, match=match):
        train_stage.run(small_config("train", *cached_data.overrides, *overrides), tmp_path)
