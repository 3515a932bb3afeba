"""The model contract: what a LightningModule exposes so DynMo can cut it into pipeline stages.

A pipelined model is a chain ``first parts -> layers "0" .. "n-1" -> last parts -> loss``. The plain
contract (every member below without a "stage interface" mark) is all most models need; the stage
interface members let blocks see masks and position ids, carry per-token state across stages and add
auxiliary losses.

``layers: nn.ModuleDict``
    The blocks, keyed by their global index as a string (``"0"`` .. ``"n-1"``). A block maps the
    hidden state to the new hidden state. Keys are stable: ``layers.7`` keeps its name whichever rank
    owns it, so checkpoints and optimizer state are placement independent.
``pipeline_first_parts: tuple[str, ...]`` (optional, default ``()``)
    Names of the submodule attributes only the first stage uses (e.g. ``("tok_emb", "pos_emb")``).
``pipeline_last_parts: tuple[str, ...]`` (optional, default ``()``)
    Names of the submodule attributes only the last stage uses (e.g. ``("ln_f", "head")``).
``pipeline_batch(batch) -> (inputs, target)`` or ``(inputs, target, side_inputs)``
    Splits a dataloader batch into the first stage's input tensor, the loss's target tensor and
    (stage interface) a dict of side inputs; all are cut into micro-batches along dim 0.
``pipeline_first(inputs, **first_inputs) -> hidden`` (required when there are first parts or side state)
    Runs the first parts on the inputs. With side state it returns a dict ``{"hidden": h, name: t, ...}``
    holding every side-state entry.
``pipeline_last(hidden, **last_inputs) -> output`` (required when there are last parts)
    Runs the last parts on the last block's output.
``pipeline_loss(output, target) -> loss``
    A mean-reduced scalar loss of one micro-batch (the schedule averages over micro-batches).
``on_pipeline_step_end(loss, batch, batch_idx) -> None`` (optional hook)
    Called on every rank after each pipelined training step, with the step's true loss (the mean
    over all micro-batches and data-parallel replicas, detached, the same on every rank), the
    dataloader batch and its index. It runs where ``training_step`` would, so ``self.log(...)``
    works exactly as there (e.g. ``self.log("train_ppl", loss.exp())``). Per-layer state is only on
    the rank that owns the layer: log it with ``sync_dist=True`` or from that rank's values only.

The stage interface (all optional):

``pipeline_side_inputs: tuple[str, ...]``
    Per-micro-batch tensors taken from the batch (attention or padding mask, position ids, labels for
    per-layer exit losses, ...): the third element of ``pipeline_batch``'s result, a dict with exactly
    these keys, each with the batch on dim 0. Every rank reads them from its own copy of the batch,
    so they reach blocks on every stage without travelling between ranks.
``pipeline_side_state: tuple[str, ...]``
    Per-token tensors that travel with the hidden state from block to block and across stage
    boundaries (an exit mask, routing state). Their shapes and dtypes must stay the same from step to
    step (torch's pipeline stages allocate their receive buffers once). ``pipeline_first`` creates
    them.
``pipeline_aux_losses: tuple[str, ...]``
    Names of the auxiliary losses blocks or parts add with
    :func:`lightning_dynmo.pipeline.add_aux_loss`; each is logged as ``train_aux/<name>``.
``pipeline_first_inputs``, ``pipeline_last_inputs: tuple[str, ...]``
    Side inputs (and, for the last parts, side-state entries) passed by keyword to ``pipeline_first`` /
    ``pipeline_last``.
A block's ``pipeline_inputs: tuple[str, ...]`` (class or instance attribute)
    Side inputs and side-state entries the block reads, passed by keyword:
    ``block(hidden, attention_mask=..., exit_mask=...)``. A block returns the new hidden tensor, or
    ``(hidden, updates)`` with ``updates`` a dict replacing side-state entries (same shape and dtype).

Every parameter and persistent buffer of the model must belong to exactly one unit (a block or a part):
the strategy keeps only the units a rank owns, so anything else would stay on every rank, outside the
pipeline's gradients and checkpoints (:func:`check_model_contract` names such attributes). Blocks must
not share parameters with other units when the pipeline has more than one stage (they migrate one by
one); a ``TypeError`` says how to untie them. A first-stage part and a last-stage part may share one (a
GPT whose output head reuses the token embedding's weight): the strategy keeps the two copies equal
across ranks (:func:`find_tied_parameters`).

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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

REQUIRED_METHODS = ("pipeline_batch", "pipeline_loss")
#: The optional hook called after every pipelined training step (see the module docstring).
STEP_END_HOOK = "on_pipeline_step_end"
#: The key of the hidden state in the dict ``pipeline_first`` returns when the model has side state.
HIDDEN = "hidden"
#: The attribute a block declares the side inputs and side-state entries it reads with.
BLOCK_INPUTS = "pipeline_inputs"


@dataclass(frozen=True)
class ModelSpec:
    """What the strategy needs to know about a contract-abiding model.

    Attributes:
        num_layers: Number of blocks in ``layers``.
        first_parts: First-stage part attribute names.
        last_parts: Last-stage part attribute names.
        side_inputs: Names of the per-micro-batch side inputs ``pipeline_batch`` provides.
        side_state: Names of the per-token tensors that travel with the hidden state, in transport order.
        aux_losses: Names of the auxiliary losses blocks and parts may add.
        first_inputs: Side inputs passed to ``pipeline_first``.
        last_inputs: Side inputs and side-state entries passed to ``pipeline_last``.
    """

    num_layers: int
    first_parts: tuple[str, ...]
    last_parts: tuple[str, ...]
    side_inputs: tuple[str, ...] = ()
    side_state: tuple[str, ...] = ()
    aux_losses: tuple[str, ...] = ()
    first_inputs: tuple[str, ...] = ()
    last_inputs: tuple[str, ...] = ()

    @property
    def runs_first(self) -> bool:
        """Whether stage 0 calls ``pipeline_first`` (it has first parts, or creates side state)."""
        return bool(self.first_parts) or bool(self.side_state)

    @property
    def runs_last(self) -> bool:
        """Whether the last stage calls ``pipeline_last``."""
        return bool(self.last_parts)


def check_model_contract(model: nn.Module) -> ModelSpec:
    """Validate ``model`` against the contract (see the module docstring) and describe it.

    Checks the members, the stage-interface declarations (every name a block or part asks for is
    declared) and that every parameter and persistent buffer belongs to exactly one unit.

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
    side_inputs = _names(model, "pipeline_side_inputs")
    side_state = _names(model, "pipeline_side_state")
    _check_interface_names(model, side_inputs, side_state)
    spec = ModelSpec(
        num_layers=len(keys),
        first_parts=first,
        last_parts=last,
        side_inputs=side_inputs,
        side_state=side_state,
        aux_losses=_names(model, "pipeline_aux_losses"),
        first_inputs=_names(model, "pipeline_first_inputs"),
        last_inputs=_names(model, "pipeline_last_inputs"),
    )
    needed = list(REQUIRED_METHODS)
    needed += ["pipeline_first"] if spec.runs_first else []
    needed += ["pipeline_last"] if spec.runs_last else []
    missing = [m for m in needed if not callable(getattr(model, m, None))]
    if missing:
        raise TypeError(
            f"{name} is missing {missing}: DynMoStrategy needs `pipeline_batch(batch) -> (inputs, target)`, "
            "`pipeline_loss(output, target) -> scalar`, and `pipeline_first(inputs)` / "
            "`pipeline_last(hidden)` when it declares first/last parts (`pipeline_first` also creates "
            "the side state, when it declares some). See lightning_dynmo.pipeline.model.contract."
        )
    hook = getattr(model, STEP_END_HOOK, None)
    if hook is not None and not callable(hook):
        raise TypeError(
            f"{name}.{STEP_END_HOOK} is {hook!r}, not a method; define it as "
            f"`def {STEP_END_HOOK}(self, loss, batch, batch_idx) -> None` or remove the attribute."
        )
    _check_requested_inputs(model, spec)
    check_unit_ownership(model, spec)
    return spec


def block_inputs(block: nn.Module) -> tuple[str, ...]:
    """The side inputs and side-state entries ``block`` reads (its ``pipeline_inputs``, default none)."""
    names: Any = getattr(block, BLOCK_INPUTS, ())
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"{type(block).__name__}.{BLOCK_INPUTS} is {names!r}; it must be a tuple of the side-input and "
            f"side-state names the block reads, e.g. {BLOCK_INPUTS} = ('attention_mask',)."
        )
    return tuple(names)


def unit_modules(model: nn.Module, spec: ModelSpec) -> dict[str, nn.Module]:
    """The model's units by name (``layers.<i>`` and the parts), for the units present on this rank."""
    layers = model.get_submodule("layers")
    units = {f"layers.{k}": m for k, m in layers.named_children()}
    for part in (*spec.first_parts, *spec.last_parts):
        module = getattr(model, part, None)
        if isinstance(module, nn.Module):
            units[part] = module
    return units


def check_unit_ownership(model: nn.Module, spec: ModelSpec) -> None:
    """Every parameter and persistent buffer of ``model`` must belong to exactly one unit.

    A tensor held outside the units (a bare ``nn.Parameter`` on the model, a submodule used by
    ``pipeline_first`` but not listed in ``pipeline_first_parts``, or the original container of the
    blocks still registered, as a Hugging Face wrapper would keep it) would stay on every rank, outside
    the pipeline's gradient averaging and its checkpoints.

    Raises:
        TypeError: naming the first such attribute and how to fix it.
    """
    units = unit_modules(model, spec)
    in_units: dict[int, str] = {}
    for unit, module in units.items():
        for pname, param in module.named_parameters(remove_duplicate=False):
            in_units.setdefault(id(param), f"{unit}.{pname}")
        for bname, buf in module.named_buffers(remove_duplicate=False):
            in_units.setdefault(id(buf), f"{unit}.{bname}")
    name = type(model).__name__
    for pname, param in model.named_parameters(remove_duplicate=False):
        if _outside_units(pname, units):
            _raise_outside(name, pname, "parameter", in_units.get(id(param)))
    for bname, buf in _persistent_buffers(model):
        if _outside_units(bname, units):
            _raise_outside(name, bname, "persistent buffer", in_units.get(id(buf)))


def _outside_units(qualified: str, units: Mapping[str, nn.Module]) -> bool:
    return not any(qualified.startswith(unit + ".") for unit in units)


def _persistent_buffers(model: nn.Module) -> list[tuple[str, Tensor]]:
    found = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for bname, buf in module._buffers.items():
            if buf is not None and bname not in module._non_persistent_buffers_set:
                found.append((f"{prefix}.{bname}" if prefix else bname, buf))
    return found


def _raise_outside(model_name: str, qualified: str, kind: str, also_as: str | None) -> None:
    attribute = qualified.split(".")[0]
    if also_as is not None:
        raise TypeError(
            f"{model_name} registers the {kind} `{qualified}` outside the pipeline units, and the same "
            f"tensor again as `{also_as}`: the attribute `{attribute}` still holds modules the units hold. "
            f"DynMoStrategy keeps only each rank's units, so `{attribute}` would keep every block on every "
            f"rank. Hold that container unregistered (`object.__setattr__(self, {attribute!r}, container)`) "
            "or delete the attribute after building `layers` and the parts."
        )
    raise TypeError(
        f"{model_name} has the {kind} `{qualified}` outside the pipeline units (`layers` and the parts named "
        f"in pipeline_first_parts / pipeline_last_parts). DynMoStrategy keeps only each rank's units, so "
        f"`{attribute}` would stay on every rank, outside gradient averaging and checkpoints. Move it into "
        f"a unit: list `{attribute}` in pipeline_first_parts (if pipeline_first uses it) or "
        "pipeline_last_parts (if pipeline_last uses it), or put it inside a block"
        + (", or register it with persistent=False if it is a constant." if kind != "parameter" else ".")
    )


def _check_interface_names(
    model: nn.Module, side_inputs: tuple[str, ...], side_state: tuple[str, ...]
) -> None:
    name = type(model).__name__
    clash = sorted(set(side_inputs) & set(side_state))
    if clash:
        raise TypeError(
            f"{name} declares {clash} both as pipeline_side_inputs and pipeline_side_state; a name is either "
            "read from the batch (side input) or carried from block to block (side state). Rename one."
        )
    if HIDDEN in side_inputs or HIDDEN in side_state:
        raise TypeError(
            f"{name} declares a side input or side-state entry named {HIDDEN!r}, the name of the hidden "
            "state itself; pick another name."
        )
    for attr, names in (("pipeline_side_inputs", side_inputs), ("pipeline_side_state", side_state)):
        if len(set(names)) != len(names):
            raise TypeError(f"{name}.{attr}={names!r} names an entry twice; list each name once.")


def _check_requested_inputs(model: nn.Module, spec: ModelSpec) -> None:
    name = type(model).__name__
    known = (*spec.side_inputs, *spec.side_state)
    layers = model.get_submodule("layers")
    asks = [(f"layers.{k}", block_inputs(block), known) for k, block in layers.named_children()]
    asks.append(("pipeline_first", spec.first_inputs, spec.side_inputs))
    asks.append(("pipeline_last", spec.last_inputs, known))
    for who, wanted, allowed in asks:
        unknown = [n for n in wanted if n not in allowed]
        if unknown:
            raise TypeError(
                f"{name}: {who} asks for {unknown}, which the model does not declare (pipeline_side_inputs="
                f"{spec.side_inputs!r}, pipeline_side_state={spec.side_state!r}"
                + (", and pipeline_first sees side inputs only" if who == "pipeline_first" else "")
                + "). Declare each name a block reads in the model's pipeline_side_inputs (taken from the "
                "batch) or pipeline_side_state (carried from block to block)."
            )


def split_batch(model: nn.Module, spec: ModelSpec, batch: Any) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Call ``model.pipeline_batch(batch)`` and check its result against the contract.

    Returns:
        ``(inputs, target, side_inputs)``; ``side_inputs`` is empty for the plain contract.

    Raises:
        TypeError: if the result is not ``(inputs, target)`` or ``(inputs, target, side_inputs)`` of
            tensors, or the side inputs are not exactly the declared ones.
        ValueError: if a tensor does not have the batch on dim 0.
    """
    name = type(model).__name__
    result: Any = getattr(model, "pipeline_batch")(batch)  # noqa: B009 (nn.Module types attributes as Tensor)
    form = (
        "(inputs, target) or (inputs, target, side_inputs) with inputs and target tensors and side_inputs a "
        "dict of tensors"
    )
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise TypeError(
            f"{name}.pipeline_batch returned {_describe(result)}; it must return {form}. More input tensors "
            "go into side_inputs (declare their names in pipeline_side_inputs)."
        )
    inputs, target = result[0], result[1]
    side: Any = result[2] if len(result) == 3 else {}
    for what, value in (("inputs", inputs), ("target", target)):
        if not isinstance(value, Tensor):
            raise TypeError(
                f"{name}.pipeline_batch returned {what} = {_describe(value)}; it must return {form}. Pass "
                "further tensors as side inputs: return (inputs, target, {'attention_mask': mask, ...}) "
                "and declare pipeline_side_inputs = ('attention_mask', ...)."
            )
    if not isinstance(side, Mapping) or not all(isinstance(v, Tensor) for v in side.values()):
        raise TypeError(
            f"{name}.pipeline_batch returned side_inputs = {_describe(side)}; it must return {form}."
        )
    missing = [n for n in spec.side_inputs if n not in side]
    extra = [n for n in side if n not in spec.side_inputs]
    if missing or extra:
        raise TypeError(
            f"{name}.pipeline_batch gave side inputs {sorted(side)} but the model declares "
            f"pipeline_side_inputs={spec.side_inputs!r}"
            + (
                f"; missing {missing} (a block or part asks for them: return them from pipeline_batch)"
                if missing
                else ""
            )
            + (
                f"; not declared {extra} (add them to pipeline_side_inputs or stop returning them)"
                if extra
                else ""
            )
            + "."
        )
    batch_size = inputs.shape[0] if inputs.dim() else None
    for what, value in (("target", target), *((f"side input {k!r}", v) for k, v in side.items())):
        if batch_size is None or value.dim() == 0 or value.shape[0] != batch_size:
            raise ValueError(
                f"{name}.pipeline_batch: {what} has shape {tuple(value.shape)} but inputs have shape "
                f"{tuple(inputs.shape)}; every tensor must have the batch on dim 0 (it is cut into "
                "micro-batches along it)."
            )
    # Contiguous, because torch's stage checks an input's strides against those its first micro-batch
    # was traced with (torch 2.11 always; 2.13 under TORCH_DISTRIBUTED_DEBUG=DETAIL): ``batch[:, :-1]``
    # has the row stride of ``batch``. A copy only where a tensor is a strided view (token ids: cheap).
    return inputs.contiguous(), target.contiguous(), {k: v.contiguous() for k, v in side.items()}


def check_loss(model_name: str, loss: Any, needs_grad: bool) -> Tensor:
    """Check that ``pipeline_loss`` returned a scalar tensor (on the gradient path when training).

    Raises:
        TypeError: naming what was returned and the fix.
    """
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        shape = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else _describe(loss)
        raise TypeError(
            f"{model_name}.pipeline_loss returned {shape}; it must return the micro-batch's mean loss as a "
            "scalar (0-dim) tensor, e.g. F.cross_entropy(logits.flatten(0, 1), target.flatten()) or "
            "loss.mean()."
        )
    if needs_grad and not loss.requires_grad:
        raise TypeError(
            f"{model_name}.pipeline_loss returned a loss that does not require grad, so no gradient can "
            "reach the model: it was detached (.detach(), .item(), torch.no_grad()) or computed from the "
            "target alone. Compute it from the `output` argument with differentiable operations."
        )
    return loss


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(type(v).__name__ for v in value[:4])
        return f"a {type(value).__name__} of {len(value)} ({inner}{', ...' if len(value) > 4 else ''})"
    return f"a {type(value).__name__}"


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


def _names(model: nn.Module, attr: str) -> tuple[str, ...]:
    names: Any = getattr(model, attr, ())
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) and n for n in names):
        raise TypeError(
            f"{type(model).__name__}.{attr} is {names!r}; it must be a tuple of non-empty names, e.g. "
            f"{attr} = ('attention_mask',)."
        )
    return tuple(names)
