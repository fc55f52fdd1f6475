"""The Python API for notebooks and scripts: thin facades over the stage code the CLI runs.

    cfg = qie.compose("train", ["data.path=/data/edits", "cache.dir=/cache"])
    trainer = qie.Trainer(cfg)
    trainer.cache_embeddings(); trainer.fit()
    image = trainer.predict("in.png", "make the sky pink")

Nothing is built when a Trainer is made; each method builds what it needs, once.

Each public name here that takes a composed config (`cache_manager`, `EditDataset`, `Trainer`) is an edge, as a
stage's `run` is: it turns the config into typed settings (`qie.config.typed`, `qie.stages.settings`) and hands
those to the code below, which never sees the config.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from PIL import Image

from qie.checks import read_groups
from qie.config import for_stage, typed
from qie.embedding.manager import EmbeddingCacheManager
from qie.errors import ConfigError

# What `predict` and the encoding helpers take as an image.
ImageInput = Image.Image | np.ndarray | str | Path


def cache_manager(cfg: DictConfig) -> EmbeddingCacheManager:
    """An EmbeddingCacheManager on `cfg.cache`'s backend whose keys equal precompute's for `cfg.model`."""
    from qie.stages.edge import Edge
    from qie.stages.sources import model_key_context

    edge = Edge.of(read_groups(cfg), masks=False)
    context = model_key_context(edge.model, edge.spec, edge.source_settings().sizes)
    return EmbeddingCacheManager(edge.cache.dir, context, edge.backend())


class EditDataset:
    """The samples of `cfg.data.path`, each read through the configured EmbeddingSource.

    Indexing returns a dict of the tensors a training step needs and `cached` (True when they came
    from the cache); `get_cache_stats()` counts hits and misses so far.
    """

    def __init__(self, cfg: DictConfig) -> None:
        from qie.stages.auto_caption import auto_captions, caption_settings
        from qie.stages.datasets import read_data
        from qie.stages.edge import Edge
        from qie.stages.settings import data_source

        edge = Edge.of(read_groups(cfg))
        settings, backend, data, spec = edge.source_settings(), edge.backend(), edge.data, edge.spec
        self.source = edge.source(settings, backend)
        # data.auto_caption: samples without a caption get theirs (generated where the source may encode)
        prompts = caption_settings(data.auto_caption_prompt, spec) if data.auto_caption else None
        captions = auto_captions(prompts, settings, spec, self.source.encodes, backend)
        self.samples = read_data(data_source(data, edge.cache.state_folder()), captions=captions).samples
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        (item,) = self.source.get([self.samples[index]])
        if item.cached:
            self.hits += 1
        else:
            self.misses += 1
        return {
            "id": item.id,
            "pixel_latent": item.pixel_latent,
            "control_latents": list(item.control_latents),
            "prompt_embed": item.prompt_embed,
            "empty_prompt_embed": item.empty_prompt_embed,
            "prompt": self.samples[index].prompt,
            "cached": item.cached,
        }

    def get_cache_stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses}


class Trainer:
    """Precompute, train and predict with one config, as the CLI stages do.

    Args:
        cfg: a composed "train" config (`qie.compose("train", overrides)`): the edge, read by each method for what
            it builds.
        run_dir: where outputs go; default `outputs/api-<time>`.
    """

    def __init__(self, cfg: DictConfig, run_dir: str | Path | None = None) -> None:
        if "train" not in cfg or "predict" not in cfg:
            raise ConfigError("Trainer needs a train config: qie.compose('train', overrides)")
        self.cfg = cfg
        self.run_dir = Path(run_dir or Path("outputs") / f"api-{datetime.now():%Y-%m-%d_%H-%M-%S}")
        self.lora_path: Path | None = None
        self._predictor = None
        self._encoder = None
        self._spec = None

    @property
    def spec(self):
        """The model's description (`qie.models.ModelSpec`), its checkpoint built (tiny models) and checked once."""
        if self._spec is None:
            from qie.components import prepare_model

            self._spec = prepare_model(typed(self.cfg.model))
        return self._spec

    # Training ------------------------------------------------------------------------------------
    def cache_embeddings(self):
        """Run precompute for the config's data set into `cache.dir`; returns the summary."""
        from qie.stages import precompute

        return precompute.run(for_stage(self.cfg, "precompute"), self.run_dir / "precompute")

    def fit(self) -> dict:
        """Train as `python -m qie.train` does; returns the result (steps, losses, LoRA path)."""
        from qie.stages import train

        result = train.run(self.cfg, self.run_dir / "train")
        if result.get("lora"):
            self.lora_path = Path(result["lora"])
            if self._predictor is not None:
                self._predictor.load_lora(self.lora_path, float(self.cfg.predict.lora_scale), self._allow_other_base)
        return result

    def save_lora(self, path: str | Path) -> Path:
        """Copy the trained (or loaded) LoRA file to `path` (a file or a folder)."""
        if self.lora_path is None:
            raise ConfigError("no LoRA to save: call fit() or load_lora() first")
        path = Path(path)
        if path.suffix != ".safetensors":
            path.mkdir(parents=True, exist_ok=True)
            path = path / self.lora_path.name
        shutil.copyfile(self.lora_path, path)
        return path

    def load_lora(self, path: str | Path, scale: float | None = None) -> None:
        """Use this LoRA for prediction (loaded now if prediction is set up, else when it is)."""
        from qie.adapters.lora import lora_file

        self.lora_path = lora_file(path)
        if self._predictor is not None:
            scale = scale if scale is not None else float(self.cfg.predict.lora_scale)
            self._predictor.load_lora(self.lora_path, scale, self._allow_other_base)

    @property
    def _allow_other_base(self) -> bool:
        """`predict.allow_other_base`: use a LoRA trained on another fused base than `model.fuse_loras`."""
        return bool(self.cfg.predict.get("allow_other_base", False))

    def merge_lora(self) -> None:
        """Fuse the loaded LoRA into the transformer's weights (faster prediction, no unloading)."""
        from qie.adapters.lora import merge_lora

        merge_lora(self.setup_predict().parts.transformer)

    # Prediction ----------------------------------------------------------------------------------
    def setup_predict(self):
        """Build the prediction parts once (on predict.devices) and load the LoRA if there is one."""
        if self._predictor is None:
            from dataclasses import replace

            from qie.stages.infer import build_predictor

            predict = replace(typed(self.cfg.predict), lora=str(self.lora_path) if self.lora_path else None)
            self._predictor = build_predictor(typed(self.cfg.model), predict, self.spec)
            self._encoder = self._predictor.encoder
        return self._predictor

    def predict(
        self,
        image: ImageInput | Sequence[ImageInput] | None,
        prompt: str,
        **options: Any,
    ) -> Image.Image | list[Image.Image]:
        """Edit `image` (a list of images for Edit-Plus; None for text to image) as `python -m qie.infer` would.

        Args:
            image: a PIL image, a numpy array (H, W, 3) of uint8 or of floats in [0, 1], or a path; or a list
                of them.
            options: SamplingOptions fields (negative_prompt, true_cfg_scale, num_inference_steps, seed,
                height, width, num_images); the rest come from the config's `predict` group, so the
                defaults are those of `python -m qie.infer`.

        Returns one PIL image, or a list when several input images were given.
        """
        from qie.stages.infer import open_images
        from qie.stages.settings import sampling_options

        images = open_images(list(image) if isinstance(image, (list, tuple)) else image, self.spec.family.alpha)
        out = self.setup_predict().predict(images, prompt, sampling_options(typed(self.cfg.predict), **options))
        return out if len(images) > 1 else out[0]

    # Encoding ------------------------------------------------------------------------------------
    def _encoder_only(self):
        if self._encoder is None:
            from qie.stages.settings import encoder_devices
            from qie.stages.sources import build_encoder

            self._encoder = build_encoder(typed(self.cfg.model), self.spec, encoder_devices(typed(self.cfg.cache)))
        return self._encoder

    def encode_image(self, image: ImageInput) -> torch.Tensor:
        """Normalised VAE latent (1, C, 1, h, w) of an image at the model's condition size."""
        from qie.data.images import as_image, condition_images

        pil = as_image(image, self.spec.family.alpha)
        pixels, _ = condition_images(pil, int(self.cfg.model.vae_image_pixels), int(self.cfg.model.vl_image_pixels))
        return self._encoder_only().encode_latents([pixels])[0].unsqueeze(0)

    def encode_prompt(self, prompt: str, images: Sequence[ImageInput]) -> torch.Tensor:
        """Prompt embedding (tokens, dim) of `prompt` seen with `images`, unpadded."""
        from qie.data.images import as_image, condition_images

        pil = [as_image(im, self.spec.family.alpha) for im in images]
        m = self.cfg.model
        vl = [condition_images(im, int(m.vae_image_pixels), int(m.vl_image_pixels))[1] for im in pil]
        return self._encoder_only().encode_prompts([prompt], [vl])[0]

    def decode_latents(self, latents: torch.Tensor) -> list[Image.Image]:
        """PIL images of normalised latents (B, C, 1, h, w)."""
        parts = self._predictor.parts if self._predictor is not None else self._encoder_only().parts
        return self.spec.family.decode(parts.vae, latents)
