"""Sample fields: an extra input of a sample declared once (`SampleField`) and handled generically by every layer.

A field of kind "image" is one more image per sample, encoded by the VAE exactly as the target is (the same
area, resize mode and rounding; it must have the target's size once resized). Everything about it follows from
its name:

- a manifest row's key `<name>` (a path relative to the manifest);
- in the folder layout, a file `training_images/<stem>_<name>.<ext>` beside the target `<stem>.<ext>`; the
  built-in `REJECTED` field also reads its own folder, `rejected_images/<stem>.<ext>`, as data sets always had it
  (`folder`);
- a Hugging Face data set's column `<name>` (for `REJECTED`, `data.columns.rejected` names it instead);
- the cache entry type `<name>_latent`, keyed by the image's bytes and how the target is encoded
  (`qie.data.keys`); `rejected_latent` keeps the key it always had;
- `SampleEmbeddings.fields[name]` and `Batch.fields[name]`, a (B, C, F, h, w) tensor like `Batch.latents`.

Which fields a data set is read with is an explicit argument (`DataSource.fields`, the scanners' `fields`): a run
reads the fields its objective requires (`run_fields`) beside the built-in ones (`DEFAULT_FIELDS`), and a sample
without a required field is left out, naming the field (`missing_problem`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from qie.types import CACHE_TYPES, FIELD_TYPES, register_field_type

KINDS = ("image",)
# What an objective may require that is no field of a sample (every sample has it).
NOT_FIELDS = ("target", "empty_prompt")
# What a manifest row, a folder data set or a Hugging Face data set already means by these names: a field named so
# would read the target, the controls, the prompt, ... as its image.
BUILT_IN_KEYS = ("target", "controls", "control", "prompt", "mask", "layers", "image", "id", "empty_prompt")
_DECLARED: dict[str, SampleField] = {}


@dataclass(frozen=True)
class SampleField:
    """An extra input of a sample, named `name` (letters, digits and `_`); see the module's docstring."""

    name: str
    kind: str = "image"
    # A folder of its own in the folder layout (`<folder>/<stem>.<ext>`), besides the suffix rule.
    folder: str | None = None
    # What one of its images is called in messages (default: "<name> image"), and where a sample gets one (default:
    # `where`).
    noun: str | None = None
    hint: str | None = None
    # Its image is another result of the edit, as the target is: it must not be the target's bytes (a preference
    # pair of equal results trains nothing), and an edit-region mask covers where it differs from the control too.
    result: bool = False
    # What marks its image in a remembered sample's signature (`qie.data.key_memo`; default "f<name>:").
    mark: str | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not self.name.islower() or self.name.startswith("_"):
            raise ValueError(f"a sample field's name is lower-case letters, digits and '_', got {self.name!r}")
        if self.name in BUILT_IN_KEYS or (self.entry_type in CACHE_TYPES and self.entry_type not in FIELD_TYPES):
            built_in = f"its cache type {self.entry_type} is built in"
            what = "a built-in manifest key" if self.name in BUILT_IN_KEYS else built_in
            raise ValueError(
                f"a sample field cannot be named {self.name!r} ({what}, read as what qie means by it): name it after "
                f"what its image is, e.g. {self.name}_map"
            )
        if self.kind not in KINDS:
            raise ValueError(f"sample field {self.name!r}: unknown kind {self.kind!r} (known: {', '.join(KINDS)})")
        known = _DECLARED.setdefault(self.name, self)
        if known != self:
            raise ValueError(f"sample field {self.name!r} is declared already, as {known!r}")
        register_field_type(self.entry_type)

    @property
    def entry_type(self) -> str:
        """The cache entry type of its encoded image."""
        return f"{self.name}_latent"

    @property
    def suffix(self) -> str:
        """The end of a folder layout's file stem that names this field's image of the sample `<stem>`."""
        return f"_{self.name}"

    @property
    def where(self) -> str:
        """Where a data set gives this field, for messages."""
        return (
            self.hint or f"manifest key `{self.name}`, folder file `<stem>{self.suffix}.png`, HF column `{self.name}`"
        )

    @property
    def called(self) -> str:
        """What one of its images is called in messages."""
        return self.noun or f"{self.name} image"

    @property
    def signature_mark(self) -> str:
        """What marks its image in a remembered sample's signature."""
        return self.mark or f"f{self.name}:"


# A preference pair's rejected result (`train/objective=dpo`): the same edit done worse than the target. Data sets
# always had its folder, and remembered signatures its mark.
REJECTED = SampleField(
    "rejected",
    folder="rejected_images",
    noun="rejected result",
    hint="a manifest row's 'rejected', rejected_images/<stem>.png, data.columns.rejected",
    result=True,
    mark="r",
)
# The fields a data set is read with when none are named: the built-in ones.
DEFAULT_FIELDS: tuple[SampleField, ...] = (REJECTED,)
# The folders of their own the built-in fields have in the folder layout.
FIELD_FOLDERS: tuple[str, ...] = tuple(f.folder for f in DEFAULT_FIELDS if f.folder)


def field_named(name: str) -> SampleField:
    """The declared field named `name`.

    Raises:
        ValueError: no field of that name was declared.
    """
    if name not in _DECLARED:
        raise ValueError(f"no sample field {name!r} is declared (known: {', '.join(sorted(_DECLARED))})")
    return _DECLARED[name]


def run_fields(requires: Iterable[str | SampleField]) -> tuple[SampleField, ...]:
    """The fields a run reads for an objective's `requires`: names of declared fields ("rejected" -> `REJECTED`)
    and `SampleField`s, in order, once each; what every sample has (`NOT_FIELDS`) is no field."""
    out: dict[str, SampleField] = {}
    for r in requires:
        if isinstance(r, str) and r in NOT_FIELDS:
            continue
        f = r if isinstance(r, SampleField) else field_named(r)
        out.setdefault(f.name, f)
    return tuple(out.values())


def with_defaults(fields: Iterable[SampleField]) -> tuple[SampleField, ...]:
    """`DEFAULT_FIELDS`, then `fields` not among them: what a run's data set is read with."""
    return run_fields((*DEFAULT_FIELDS, *fields))


def entry_types(fields: Iterable[SampleField]) -> tuple[str, ...]:
    """The cache entry types of `fields`."""
    return tuple(f.entry_type for f in fields)


def missing_problem(f: SampleField, why: str = "which the objective trains on") -> str:
    """Why a sample without the field `f`'s image cannot train."""
    return f"it has no {f.called}, {why}: give one ({f.where})"
