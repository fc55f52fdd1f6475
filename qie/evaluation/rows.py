"""A sample as the row its edits are scored against (`qie.evaluation.scoring.Row`): what the eval stage, the
validation rewards and online RL (`train/objective=grpo`) hand a reward besides the edits."""

from __future__ import annotations

from collections.abc import Collection

from qie.data.images import open_image
from qie.data.samples import Sample
from qie.evaluation.image_metrics import edit_region, to_tensor
from qie.evaluation.scoring import Row
from qie.models import ModelSpec


def reference_row(
    sample: Sample,
    size: tuple[int, int] | None,
    spec: ModelSpec,
    category: str | None = None,
    needs: Collection[str] = ("target", "mask"),
) -> Row:
    """What a row's edits (of `size`, width x height; None where `needs` names nothing) are scored against: its
    controls, its target at that size and its edit region (the row's mask, else where target and the control the
    output follows differ). `needs` (a reward's): "target" and "mask" read what they name; without them the row has
    neither, and no image but the controls is read."""
    controls = [to_tensor(open_image(c)).float() for c in sample.controls]
    with_target = "target" in needs or ("mask" in needs and sample.mask is None)
    target = to_tensor(open_image(sample.target), size).float() if with_target and sample.target else None
    if "mask" not in needs:
        region = None
    elif sample.mask is not None:
        region = to_tensor(open_image(sample.mask), size)[0] > 0.5
    elif target is not None and sample.controls:
        region = edit_region(target.double(), to_tensor(open_image(sample.controls[spec.output_image or 0]), size))
    else:
        region = None
    return Row(sample.id, sample.prompt, category, controls, target if "target" in needs else None, region)


__all__ = ["reference_row"]
