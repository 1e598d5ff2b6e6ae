"""What the gallery's queries return."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Enrollment:
    """An enrollment that committed: ``added`` templates, ``templates`` in all for ``identity``."""

    identity: str
    added: int
    templates: int


@dataclass(frozen=True)
class Verification:
    """``score``: the largest cosine between the probe and the identity's templates;
    ``match``: ``score > threshold``."""

    identity: str
    score: float
    match: bool
    threshold: float


@dataclass(frozen=True)
class Candidate:
    """One ranked identity of an identification, with its score (largest template cosine)."""

    identity: str
    score: float


@dataclass(frozen=True)
class Identification:
    """Ranked ``candidates`` (best first); ``identity`` is the best one if its score exceeds
    ``threshold``, else ``None`` (open-set rejection: the probe is *unknown*)."""

    identity: str | None
    score: float | None
    candidates: tuple[Candidate, ...]
    threshold: float

    @property
    def unknown(self) -> bool:
        return self.identity is None


@dataclass(frozen=True)
class Classification:
    """The K-NN vote over the gallery's templates: the winning ``identity`` and its vote ``share``."""

    identity: str
    share: float
