"""The cache's entry type names and its schema version: a leaf module that imports nothing, so that the config
schemas (which list the types `cache.types` may name) load without torch. `qie.types` re-exports them beside the
tensor types."""

from __future__ import annotations

import re

# The public names of the entry types: stats, clear and verify take these.
CACHE_TYPES = [
    "pixel_latent",
    "control_latent",
    "prompt_embed",
    "prompt_embeds_mask",
    "empty_prompt_embed",
    "empty_prompt_embeds_mask",
    "loss_mask",  # a loss mask on a grid of 8 px cells (qie.data.masks): only with data.mask.source set
    "layer_latent",  # the target's further frames, in order (a layered model's layers): only for such samples
    "rejected_latent",  # a preference pair's rejected result, encoded as a target is: only for such samples
    "caption",  # a caption the model's own VL text encoder wrote (UTF-8 bytes, uint8): only with data.auto_caption
    # a distillation teacher's final latents for one seed (train/objective=distill): keyed by the tensors training
    # reads, not by a sample's files, so `gc` keeps them (`action=clear cache.types=[teacher_latent]` removes them)
    "teacher_latent",
]

# The entry types of sample fields (`qie.data.fields`: `<name>_latent`, an extra image encoded as the target is),
# each added to CACHE_TYPES when its field is declared; rejected_latent is the built-in one's.
FIELD_TYPES: list[str] = ["rejected_latent"]


def register_field_type(type: str) -> None:
    """Make `type` (a sample field's `<name>_latent`) a cache type."""
    if type not in CACHE_TYPES:
        CACHE_TYPES.append(type)
    if type not in FIELD_TYPES:
        FIELD_TYPES.append(type)


# The entry types of what objectives compute ahead of training (`ObjectiveContext.store`): keyed by the tensors
# training reads, not by a sample's files, so `gc` keeps them. teacher_latent is distillation's.
STORE_TYPES: list[str] = ["teacher_latent"]
_STORE_TYPE = re.compile(r"[a-z][a-z_]*")


def register_store_type(type: str) -> None:
    """Make `type` (an objective's store, `ObjectiveContext.store`) a cache type.

    Raises:
        ValueError: a name that is not lower-case letters and `_`, or the type of a sample's own entries.
    """
    if not _STORE_TYPE.fullmatch(type or ""):
        raise ValueError(f"a store's entry type is lower-case letters and '_' (e.g. my_target), got {type!r}")
    if type in CACHE_TYPES and type not in STORE_TYPES:
        raise ValueError(f"{type!r} is the type of a sample's own cache entries: name the store's type otherwise")
    if type not in CACHE_TYPES:
        CACHE_TYPES.append(type)
    if type not in STORE_TYPES:
        STORE_TYPES.append(type)


def field_of_type(type: str) -> str | None:
    """The sample field whose entries `type` holds (`"rejected"` for rejected_latent), None for other types."""
    return type.removesuffix("_latent") if type in FIELD_TYPES else None


# Bump when the meaning or layout of stored entries changes: it is part of every key and file header,
# so old entries become misses instead of being read wrongly. 2: checksums in the header, the image-token
# prefix stored once per control-image set, masks derived instead of stored.
SCHEMA_VERSION = 2

# What a training step needs of a sample (the masks are implied: embeddings are stored unpadded).
TRAINING_TYPES = (
    "pixel_latent",
    "control_latent",
    "layer_latent",
    "rejected_latent",
    "prompt_embed",
    "empty_prompt_embed",
)
