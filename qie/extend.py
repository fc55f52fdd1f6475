"""The public surface for plug-ins: what a module outside qie imports to add a kind of thing that configuration
alone then wires in (`_target_`). docs/extending.md walks through each.

- an objective: subclass `FlowMatching` (or write a class with the `Objective` protocol's methods), chosen by
  `train.objective._target_=pkg.Cls`; its constructor takes the run's `ObjectiveContext` and its own keyword
  settings, asks the context for what it uses (noise and sigmas, the flow loss and `FlowPrediction`, the sampler,
  the decoder, rows, rewards, the reference model, an `ObjectiveStore` of its own entry type), and
  `use_problem(ObjectiveUse)` may refuse a run in one line; one that fills a store ahead of training implements
  `PrecomputesTargets`;
- a cache backend: subclass `CacheBackend`, chosen by `cache.backend._target_=pkg.Cls`; its `shared` documents
  (the precompute failure list) are `FolderDocuments` on its folder, or any `Documents`;
- a reward (for `qie.eval`, validation, the sweep objective and online RL): subclass `Reward`;
- an extra image per sample: a `SampleField`, named in an objective's `requires`;
- what an objective receives: a `Batch` (a field's latents in `batch.fields[name]`); what it measures each step:
  `StepMeans`.
"""

from qie.cache.base import CacheBackend, Documents
from qie.cache.documents import FolderDocuments
from qie.data.fields import SampleField
from qie.evaluation.reward import Reward
from qie.models.flow import FlowPrediction
from qie.training.objectives import Objective, ObjectiveUse, PrecomputesTargets, StepMeans
from qie.training.objectives.context import ObjectiveContext, ObjectiveStore
from qie.training.objectives.flow_matching import FlowMatching
from qie.types import Batch


def __getattr__(name: str) -> object:
    from qie.training.objectives.renamed import renamed_error

    raise renamed_error(__name__, name)


__all__ = [
    "Batch",
    "CacheBackend",
    "Documents",
    "FlowMatching",
    "FlowPrediction",
    "FolderDocuments",
    "Objective",
    "ObjectiveContext",
    "ObjectiveStore",
    "ObjectiveUse",
    "PrecomputesTargets",
    "Reward",
    "SampleField",
    "StepMeans",
]
