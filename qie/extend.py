"""The public surface for plug-ins: what a module outside qie imports to add a kind of thing that configuration
alone then wires in (`_target_`). docs/extending.md walks through each.

- an objective: subclass `FlowMatching` (or write a class with the `Objective` protocol's methods), chosen by
  `train.objective._target_=pkg.Cls`; its constructor takes `ObjectiveInputs` and its own keyword settings, and
  `use_problem(ObjectiveUse)` may refuse a run in one line;
- a cache backend: subclass `CacheBackend`, chosen by `cache.backend._target_=pkg.Cls`; its `shared` documents
  (the precompute failure list) are `FolderDocuments` on its folder, or any `Documents`;
- a reward (for `qie.eval`, validation and the sweep objective): subclass `Reward`;
- an extra image per sample: a `SampleField`, named in an objective's `requires`;
- what an objective receives: a `Batch` (a field's latents in `batch.fields[name]`).
"""

from qie.cache.base import CacheBackend, Documents
from qie.cache.documents import FolderDocuments
from qie.data.fields import SampleField
from qie.evaluation.reward import Reward
from qie.training.objectives import Objective, ObjectiveInputs, ObjectiveUse, PrecomputesTargets, ScoresOwnResults
from qie.training.objectives.flow_matching import FlowMatching
from qie.types import Batch

__all__ = [
    "Batch",
    "CacheBackend",
    "Documents",
    "FolderDocuments",
    "FlowMatching",
    "Objective",
    "ObjectiveInputs",
    "ObjectiveUse",
    "PrecomputesTargets",
    "Reward",
    "SampleField",
    "ScoresOwnResults",
]
