"""The plan stage: which memory levers let LoRA training fit a GPU of `gpu_memory_gb`, and what each part needs.

    python -m qie.plan model=NAME data.target_pixels=1048576 gpu_memory_gb=24

Weights are counted from the model's transformer config (its folder or hub config; the family's published
sizes when neither can be read), the step's memory is simulated on fake tensors (`qie.stages.memory_plan`), with the
family's own loss, transformer and text encoder.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from qie.checks import Checked, check
from qie.components import resolve_dtype
from qie.config.data import DataConfig
from qie.config.model import ModelConfig
from qie.config.roots import PlanRoot
from qie.models import ModelSpec, model_spec
from qie.stages.memory_plan import (
    GIB,
    OPTIMIZER_STATE_BYTES,
    Estimate,
    Workload,
    plan,
    step_memory,
    text_encoder_bytes,
    weight_bytes,
)
from qie.stages.recipe import Recipe

# The transformer's weight quantizations the planner tries, most precise first (the recommendation's tie-break).
QUANTIZE = ("none", "fp8", "int4", "nf4")


def run(cfg: DictConfig, run_dir: Path | None = None) -> list[Estimate]:
    """Print the plan (the stage from code: `cfg` checked once, `qie.checks.check`, then `start`); returns one Estimate
    per combination of levers tried."""
    return start(check(cfg), run_dir)


def start(checked: Checked, run_dir: Path | None = None) -> list[Estimate]:
    """The stage's edge: a checked config's typed root (`PlanRoot`) handed to the `PlanRecipe`. See `run`."""
    return PlanRecipe(checked.root).execute()


class PlanRecipe(Recipe):
    """The plan stage: `setup()` reads the transformer's sizes and the step's token counts, `run()` tries the levers
    and prints the table.

    Args:
        root: the plan config (`PlanRoot`): the model, data and train groups and the GPU's memory.
    """

    def __init__(self, root: PlanRoot) -> None:
        self.root = root

    def setup(self) -> None:
        model = self.root.model
        self.spec = model_spec(model)
        self.config, self.where = transformer_config(model, self.spec)
        self.work = workload(model, self.root.data, self.spec)

    def run(self) -> list[Estimate]:
        root, family, config, work = self.root, self.spec.family, self.config, self.work
        train = root.train
        rank, targets = int(train.lora.rank), list(train.lora.target_modules)
        state = OPTIMIZER_STATE_BYTES.get(str(train.optimizer.get("_target_")), 8)
        weights = {q: weight_bytes(family, config, work.dtype, q, rank, targets) for q in QUANTIZE}
        step = {
            (gc, off): step_memory(family, config, work=work, rank=rank, targets=targets, checkpointing=gc, offload=off)
            for gc, off in ((False, False), (True, False), (True, True))
        }
        budget, reserve = int(float(root.gpu_memory_gb) * GIB), int(float(root.reserve_gb) * GIB)
        rows = plan(weights, step, budget, state, reserve)
        print(
            f"qie plan: LoRA training of {self.where}, {config['num_layers']} blocks, batch {work.batch}: "
            f"{work.target_tokens} target + {sum(work.control_tokens)} control + {work.prompt_tokens} prompt "
            f"tokens; GPU {root.gpu_memory_gb} GiB"
        )
        print(report(rows, budget))
        text_config = family.published.text_encoder
        te = {q: text_encoder_bytes(family, text_config, q) / GIB for q in ("none", "fp8")}
        print(
            f"precompute / caption / lazy / live also hold {family.planner.text_encoder_label}: {te['none']:.1f} GiB "
            f"in bf16, {te['fp8']:.1f} GiB with model.text_encoder_quantize=fp8 or int8 (caption: plus its key/value "
            "cache, see the guide)"
        )
        return rows


def transformer_config(model: ModelConfig, spec: ModelSpec) -> tuple[dict, str]:
    """The transformer's config (sizes only) and where it was read: the checkpoint's, else the family's
    published sizes (offline, or no such repository)."""
    from qie.components.fingerprint import part_folder

    try:
        folder = part_folder(model.pretrained_model_name_or_path, "transformer", model.revision)
        raw = json.loads((folder / "config.json").read_text())
    except Exception:  # offline, no such repository, no tiny model built yet: the published sizes
        return dict(spec.family.published.transformer), f"{model.name} (published {spec.family.name} sizes)"
    keys = spec.family.part_class("transformer").extract_init_dict(raw)[0]
    return dict(keys), model.name


def workload(m: ModelConfig, d: DataConfig, spec: ModelSpec) -> Workload:
    """The step's token counts: the target and each control image in the family's latent tokens, the prompt in
    the text encoder's vision tokens of each control image plus the template."""
    facts = spec.family.planner
    controls = int(m.max_control_images)
    return Workload(
        batch=int(d.batch_size),
        target_tokens=int(d.target_pixels) // facts.latent_pixels**2,
        control_tokens=(int(m.vae_image_pixels) // facts.latent_pixels**2,) * controls,
        prompt_tokens=controls * int(m.vl_image_pixels) // facts.vl_pixels_per_token + facts.template_tokens,
        dtype=resolve_dtype(str(m.dtype)),
    )


def report(rows: list[Estimate], budget: int) -> str:
    """The table, the parts of the recommended row, and its overrides."""
    lines = ["quantize  checkpointing  offload  blocks_to_swap  GiB      fits"]
    for r in rows:
        lv = r.levers
        fits = "yes" if r.total <= budget else "no"
        lines.append(
            f"{lv.quantize:<8}  {str(lv.gradient_checkpointing):<13}  {str(lv.activation_offload):<7}  "
            f"{lv.blocks_to_swap:>14}  {r.total / GIB:>6.1f}   {fits}"
        )
    fitting = [r for r in rows if r.total <= budget]
    if not fitting:
        return "\n".join([*lines, "nothing fits: use a larger GPU, or shard over several (train.fsdp=true)"])
    best = min(fitting, key=lambda r: r.levers.blocks_to_swap)  # the first tried among the least swapped
    lines.append("recommended: " + " ".join(overrides(best)))
    lines += [f"  {name:<44} {size / GIB:6.2f} GiB" for name, size in best.parts.items()]
    lines.append(f"  {'pinned CPU memory (swapped blocks, offload)':<44} {best.host / GIB:6.2f} GiB")
    return "\n".join(lines)


def overrides(estimate: Estimate) -> list[str]:
    lv = estimate.levers
    out = [f"model.quantize={lv.quantize}"]
    out += ["train.gradient_checkpointing=true"] if lv.gradient_checkpointing else []
    out += ["train.activation_offload=true"] if lv.activation_offload else []
    out += [f"train.blocks_to_swap={lv.blocks_to_swap}"] if lv.blocks_to_swap else []
    return out
