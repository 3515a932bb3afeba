"""Logging for the application: DynMo's lines at INFO on rank 0, and only warnings a user can act on.

Read :func:`configure`; :data:`KNOWN_HARMLESS` lists, with the reason for each, the only warnings of
other libraries it silences (matched by message and category, never a whole library or category), and
:data:`LIGHTNING_CHATTER` the informational lines of Lightning it drops (by message prefix).

Hydra configures the handlers (``conf/hydra/job_logging/dynmo.yaml``: the console shows the message
only, ``train.log`` in the run directory has times and logger names). This module sets the levels that
depend on the rank, which the YAML cannot know.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["KNOWN_HARMLESS", "configure"]

#: (message regex, category, why it is harmless and cannot be acted on by the user).
KNOWN_HARMLESS: tuple[tuple[str, type[Warning], str], ...] = (
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        FutureWarning,
        "Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates (pyproject's pytest filter too)",
    ),
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        DeprecationWarning,
        "the same call, as torch words it on some paths",
    ),
)

#: Prefixes of Lightning's INFO lines the application drops, each with the reason.
LIGHTNING_CHATTER: tuple[tuple[str, str], ...] = (
    ("💡 Tip:", "advertises optional cloud services; nothing to act on"),
    ("GPU available:", "the trainer config names the accelerator; the summary says where the run went"),
    ("TPU available:", "likewise"),
    ("HPU available:", "likewise"),
    (
        "-" * 100 + "\ndistributed_backend=",
        "the process-group banner; the strategy's own line names the layout",
    ),
)


class _DropChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(prefix) for prefix, _ in LIGHTNING_CHATTER)


def configure(rank: int) -> None:
    """Set the levels for this rank and silence :data:`KNOWN_HARMLESS` (call once per process).

    Rank 0 shows ``lightning_dynmo``'s INFO lines (placements, rebalances, measured gains); other ranks
    only its warnings, so each line is printed once.
    """
    logging.getLogger("lightning_dynmo").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # "Initializing distributed: GLOBAL_RANK ..." and the backend banner, once per rank: the summary and
    # the strategy's own line ("rank 0: placement ...") say what the job is.
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropChatter) for f in rank_zero.filters):
        rank_zero.addFilter(_DropChatter())
    for message, category, _ in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category)
