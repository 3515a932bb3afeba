"""The model contract: what a LightningModule exposes so DynMo can cut it into pipeline stages.

A pipelined model is a chain ``first parts -> layers "0" .. "n-1" -> last parts -> loss``:

``layers: nn.ModuleDict``
    The blocks, keyed by their global index as a string (``"0"`` .. ``"n-1"``). Each block maps one
    activation tensor to one activation tensor of the same kind (that tensor is what crosses a stage
    boundary). Keys are stable: ``layers.7`` keeps its name whichever rank owns it, so checkpoints
    and optimizer state are placement independent.
``pipeline_first_parts: tuple[str, ...]`` (optional, default ``()``)
    Names of the submodule attributes only the first stage uses (e.g. ``("tok_emb", "pos_emb")``).
``pipeline_last_parts: tuple[str, ...]`` (optional, default ``()``)
    Names of the submodule attributes only the last stage uses (e.g. ``("ln_f", "head")``).
``pipeline_batch(batch) -> (inputs, target)``
    Splits a dataloader batch into the first stage's input tensor and the last stage's target
    tensor; both are cut into micro-batches along dim 0.
``pipeline_first(inputs) -> hidden`` (required when there are first parts)
    Runs the first parts on the inputs.
``pipeline_last(hidden) -> output`` (required when there are last parts)
    Runs the last parts on the last block's output.
``pipeline_loss(output, target) -> loss``
    A mean-reduced scalar loss of one micro-batch (the schedule averages over micro-batches).
``on_pipeline_step_end(loss, batch, batch_idx) -> None`` (optional hook)
    Called on every rank after each pipelined training step, with the step's true loss (the mean
    over all micro-batches and data-parallel replicas, detached, the same on every rank), the
    dataloader batch and its index. It runs where ``training_step`` would, so ``self.log(...)``
    works exactly as there (e.g. ``self.log("train_ppl", loss.exp())``). Per-layer state is only on
    the rank that owns the layer: log it with ``sync_dist=True`` or from that rank's values only.

Blocks must not share parameters with other units when the pipeline has more than one stage (they
migrate one by one); a ``TypeError`` says how to untie them. A first-stage part and a last-stage part
may share one (a GPT whose output head reuses the token embedding's weight): the strategy keeps the two
copies equal across ranks (:func:`find_tied_parameters`).

The strategy deletes what a rank does not own (blocks from ``layers``, parts set to ``None``) before
``configure_optimizers`` runs, so optimizers see local parameters only; ``training_step``,
``validation_step`` and ``test_step`` are not called under :class:`~lightning_dynmo.DynMoStrategy`
(one schedule step replaces each of them), which lets the same module train and validate
single-process with its own steps as the reference. The strategy logs the losses itself (names set by
its ``*_log_name`` arguments); for anything else log in ``on_pipeline_step_end`` (training) or in
Lightning's ``on_validation_batch_end`` / ``on_test_batch_end`` hooks, whose ``outputs`` is the
batch's mean loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

REQUIRED_METHODS = ("pipeline_batch", "pipeline_loss")
#: The optional hook called after every pipelined training step (see the module docstring).
STEP_END_HOOK = "on_pipeline_step_end"


@dataclass(frozen=True)
class ModelSpec:
    """What the strategy needs to know about a contract-abiding model.

    Attributes:
        num_layers: Number of blocks in ``layers``.
        first_parts: First-stage part attribute names.
        last_parts: Last-stage part attribute names.
    """

    num_layers: int
    first_parts: tuple[str, ...]
    last_parts: tuple[str, ...]


def check_model_contract(model: nn.Module) -> ModelSpec:
    """Validate ``model`` against the contract (see the module docstring) and describe it.

    Raises:
        TypeError: naming the missing or malformed piece and what to add.
    """
    name = type(model).__name__
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError(
            f"{name} has no `layers: nn.ModuleDict` (found {type(layers).__name__}). DynMoStrategy needs the "
            "pipelined blocks as `self.layers = nn.ModuleDict({str(i): block_i for i in range(n)})`, keyed "
            "by global index."
        )
    keys = list(layers.keys())
    if keys != [str(i) for i in range(len(keys))] or not keys:
        raise TypeError(
            f"{name}.layers has keys {keys[:8]!r}; they must be '0', '1', ..., 'n-1' in order (at least one "
            "block). Build it as nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})."
        )
    first = _parts(model, "pipeline_first_parts")
    last = _parts(model, "pipeline_last_parts")
    needed = list(REQUIRED_METHODS)
    needed += ["pipeline_first"] if first else []
    needed += ["pipeline_last"] if last else []
    missing = [m for m in needed if not callable(getattr(model, m, None))]
    if missing:
        raise TypeError(
            f"{name} is missing {missing}: DynMoStrategy needs `pipeline_batch(batch) -> (inputs, target)`, "
            "`pipeline_loss(output, target) -> scalar`, and `pipeline_first(inputs)` / "
            "`pipeline_last(hidden)` "
            "when it declares first/last parts. See lightning_dynmo.pipeline.contract."
        )
    hook = getattr(model, STEP_END_HOOK, None)
    if hook is not None and not callable(hook):
        raise TypeError(
            f"{name}.{STEP_END_HOOK} is {hook!r}, not a method; define it as "
            f"`def {STEP_END_HOOK}(self, loss, batch, batch_idx) -> None` or remove the attribute."
        )
    return ModelSpec(num_layers=len(keys), first_parts=first, last_parts=last)


@dataclass(frozen=True)
class TiedParameter:
    """One parameter shared by a first-stage part and a last-stage part (e.g. embedding and head).

    Attributes:
        first_name: Its global name in the first-stage part (e.g. ``"tok_emb.weight"``), the name a
            single-process ``named_parameters`` gives it.
        last_name: Its global name in the last-stage part (e.g. ``"head.weight"``).
    """

    first_name: str
    last_name: str


def find_tied_parameters(model: nn.Module, spec: ModelSpec) -> tuple[TiedParameter, ...]:
    """Parameters shared between pipeline units: first/last-part ties are returned, others refused.

    A first-stage part and a last-stage part may share a parameter (a GPT's output head reusing the
    token embedding): the strategy keeps the two copies equal when the first and last stage run on
    different ranks (it sums their gradients). Blocks in ``layers`` must not share parameters with
    anything: they migrate one by one, which would split the tie.

    Raises:
        TypeError: naming the shared parameter, the units that hold it, and how to untie it.
    """
    layers = model.get_submodule("layers")
    units = {f"layers.{i}": layers.get_submodule(str(i)) for i in range(spec.num_layers)}
    units.update({name: model.get_submodule(name) for name in (*spec.first_parts, *spec.last_parts)})
    holders: dict[int, list[tuple[str, str]]] = {}
    for unit, module in units.items():
        for pname, param in module.named_parameters(remove_duplicate=True):
            holders.setdefault(id(param), []).append((unit, pname))
    shared = [places for places in holders.values() if len({unit for unit, _ in places}) > 1]
    with_blocks = [places for places in shared if any(unit.startswith("layers.") for unit, _ in places)]
    if with_blocks:
        names = [f"{unit}.{pname}" for unit, pname in with_blocks[0]]
        more = len(with_blocks) - 1
        tie = " is ".join(names) + (f" (and {more} more shared)" if more else "")
        raise TypeError(
            f"{type(model).__name__} shares one parameter between pipeline units: {tie}. Blocks in "
            "`layers` migrate between ranks one by one, so the tie would become separate copies trained "
            "apart. Untie it before fitting (e.g. `block.lin.weight = nn.Parameter(other.lin.weight"
            ".detach().clone())`), or train with a one-stage pipeline. (Only the first-stage and "
            "last-stage parts may share parameters, like a token embedding and an output head.)"
        )
    ties = []
    for places in shared:
        firsts = [f"{u}.{n}" for u, n in places if u in spec.first_parts]
        lasts = [f"{u}.{n}" for u, n in places if u in spec.last_parts]
        if firsts and lasts:
            ties.append(TiedParameter(first_name=firsts[0], last_name=lasts[0]))
    return tuple(ties)


def call_step_end_hook(model: nn.Module, loss: Tensor, batch: Any, batch_idx: int) -> None:
    """Call the model's ``on_pipeline_step_end(loss, batch, batch_idx)`` if it defines one."""
    hook = getattr(model, STEP_END_HOOK, None)
    if hook is not None:
        hook(loss, batch, batch_idx)


def _parts(model: nn.Module, attr: str) -> tuple[str, ...]:
    names: Any = getattr(model, attr, ())
    ok = isinstance(names, (tuple, list)) and all(isinstance(n, str) for n in names)
    if not ok:
        raise TypeError(
            f"{type(model).__name__}.{attr} is {names!r}; it must be a tuple of submodule attribute names, "
            f"e.g. {attr} = ('tok_emb', 'pos_emb')."
        )
    for part in names:
        if part == "layers" or not isinstance(getattr(model, part, None), nn.Module):
            raise TypeError(
                f"{type(model).__name__}.{attr} names {part!r}, which is not a submodule of the model "
                f"(found {type(getattr(model, part, None)).__name__}). List only nn.Module attributes other "
                "than `layers`."
            )
    return tuple(names)
