"""Structured-config schemas for ``conf/``, generated from the public constructors the configs instantiate.

Read in this order: :data:`SCHEMAS` (every schema: its name in Hydra's ConfigStore and the constructor
its ``_target_`` names), :func:`schema_of` (how a constructor's signature becomes a dataclass),
:func:`register_schemas` (what is stored, and where), :class:`TrainConfig` (the top of a composed config).

A schema is a dataclass with a ``_target_`` field and one field per constructor argument, of the same
name, type (as far as OmegaConf can check it: numbers, strings, booleans, optionals and unions of those;
anything else is ``Any`` and left to the constructor's own checks) and default. Generated, not written, so
a schema cannot drift from the constructor. Each ``conf/`` option starts from its schema (``defaults:
- /schema/<name>@<where>``), so a misspelt key or a value of the wrong type fails while Hydra composes,
with a message naming the full key (``model.config.num_layer``), before any process starts.

Arguments that cannot come from YAML (callables, objects, a live clock) are left out of the schema and
keep the constructor's default; each is listed with the reason in ``exclude``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pathlib
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union, get_args, get_origin

from hydra.core.config_store import ConfigStore

__all__ = ["SCHEMAS", "SchemaSpec", "TrainConfig", "register_schemas", "schema_of", "schemas"]

_PRIMITIVES: tuple[type, ...] = (bool, int, float, str)


@dataclass(frozen=True)
class SchemaSpec:
    """One schema: which constructor, and how its arguments map to config fields.

    Attributes:
        name: The ConfigStore name (``/schema/<name>`` in a defaults list).
        target: Dotted path of the constructor (class or function), the node's ``_target_``.
        exclude: Arguments that are not configurable from YAML (callables, live objects), each kept at the
            constructor's default.
        nested: Argument -> the schema name of a nested node (typed), or ``"any"`` for a node whose schema
            the option that fills it brings (e.g. ``model.config``, set by a ``dynamism`` option).
        kwargs_from: For a function taking ``**kwargs`` that it passes on (a preset passing options to a
            dataclass), the dotted paths of those dataclasses: their fields become fields too, in this
            order (a name already taken is skipped).
        kwargs_exclude: Fields of ``kwargs_from`` that are not accepted through ``**kwargs``.
    """

    name: str
    target: str
    exclude: tuple[str, ...] = ()
    nested: Mapping[str, str] = field(default_factory=dict)
    kwargs_from: tuple[str, ...] = ()
    kwargs_exclude: tuple[str, ...] = ()


_TRAINER_SET = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")


def _controller_callback(case: str, class_name: str) -> SchemaSpec:
    """The schema of a dynamism callback: its ``<case>_config`` nested, its event bus set in code."""
    return SchemaSpec(
        f"{case}_callback",
        f"lightning_dynmo.dynamism_callbacks.{class_name}",
        exclude=("event_bus",),
        nested={"config": f"{case}_config"},
    )


_GPT_CONFIG = "lightning_dynmo.models.GPTConfig"


def _preset(name: str, target: str, options: str | None = None) -> SchemaSpec:
    """The schema of a dynamic-model preset (a function that returns a ``GPTConfig``).

    Its fields: the preset's own arguments, the fields of its block ``options`` dataclass (when it takes
    them as keywords), then every other GPTConfig field but ``blocks`` (the preset sets the blocks).
    """
    kwargs_from = (_GPT_CONFIG,) if options is None else (options, _GPT_CONFIG)
    return SchemaSpec(name, target, kwargs_from=kwargs_from, kwargs_exclude=("blocks",))


#: Every schema ``conf/`` uses. Dynamic-model presets are added with their cases.
SCHEMAS: tuple[SchemaSpec, ...] = (
    SchemaSpec("gpt", "lightning_dynmo.models.GPT", nested={"config": "any", "optimizer": "optimizer"}),
    SchemaSpec("gpt_config", "lightning_dynmo.models.GPTConfig"),
    SchemaSpec("optimizer", "lightning_dynmo.models.OptimizerConfig"),
    _preset(
        "moe_gpt_config",
        "lightning_dynmo.dynamism.moe.moe_gpt_config",
        "lightning_dynmo.dynamism.moe.MoEOptions",
    ),
    _preset("early_exit_gpt_config", "lightning_dynmo.dynamism.early_exit.early_exit_config"),
    _preset("mod_gpt_config", "lightning_dynmo.dynamism.mod.mod_config"),
    _preset(
        "sparse_attention_gpt_config",
        "lightning_dynmo.dynamism.sparse_attention.sparse_attention_gpt_config",
        "lightning_dynmo.dynamism.sparse_attention.SparseAttentionOptions",
    ),
    _preset("pruning_gpt_config", "lightning_dynmo.dynamism.pruning.pruning_gpt_config"),
    _controller_callback("pruning", "PruningCallback"),
    SchemaSpec(
        "pruning_config",
        "lightning_dynmo.dynamism.pruning.PruningConfig",
        nested={"schedule": "pruning_schedule"},
    ),
    SchemaSpec("pruning_schedule", "lightning_dynmo.dynamism.pruning_schedule.PruningSchedule"),
    _controller_callback("freezing", "FreezingCallback"),
    SchemaSpec("freezing_config", "lightning_dynmo.dynamism.freezing.FreezingConfig"),
    SchemaSpec("text_datamodule", "lightning_dynmo.data.TextDataModule", nested={"corpus": "any"}),
    SchemaSpec("stdlib_corpus", "lightning_dynmo.data.StdlibCorpus"),
    SchemaSpec("text_file_corpus", "lightning_dynmo.data.TextFileCorpus"),
    SchemaSpec(
        "dynmo_strategy",
        "lightning_dynmo.strategy.DynMoStrategy",
        # set by the Trainer; a callable; a timedelta (set it in code).
        exclude=(*_TRAINER_SET, "on_release", "timeout", "control_timeout"),
    ),
    SchemaSpec(
        "dynmo_callback",
        "lightning_dynmo.callback.DynMoCallback",
        exclude=("event_bus", "clock"),
        nested={"profiling": "profiling_config"},
    ),
    # A callable probe cannot come from YAML. ``auto`` and ``repack`` take ``true`` or a node with
    # ``_target_: lightning_dynmo.callback.AutoConfig`` / ``RepackConfig`` (untyped: the config checks it).
    SchemaSpec("profiling_config", "lightning_dynmo.callback.ProfilingConfig", exclude=("speed_probe",)),
    SchemaSpec(
        "model_checkpoint",
        "lightning.pytorch.callbacks.ModelCheckpoint",
        exclude=("train_time_interval",),  # a timedelta: use every_n_train_steps from YAML
    ),
    SchemaSpec("run_report", "lightning_dynmo.app.report.RunReport"),
    SchemaSpec("tqdm_progress_bar", "lightning.pytorch.callbacks.TQDMProgressBar"),
    SchemaSpec("csv_logger", "lightning.pytorch.loggers.CSVLogger"),
    SchemaSpec("tensorboard_logger", "lightning.pytorch.loggers.TensorBoardLogger"),
    SchemaSpec(
        "trainer",
        "lightning.pytorch.Trainer",
        # the application builds these from the strategy, callbacks and logger groups.
        exclude=("strategy", "callbacks", "logger", "plugins"),
    ),
)


@dataclass
class TrainConfig:
    """The top of a composed ``conf/train.yaml``: each group's node (typed by its option's schema).

    Attributes:
        seed: Seed of ``lightning.seed_everything`` (the weights have their own ``model.config.seed``).
        run_dir: Where the run writes (logs, checkpoints, ``summary.json``): Hydra's output directory.
        model: ``lightning_dynmo.models.GPT`` (``model/`` sets the shape, ``dynamism/`` the blocks).
        data: The LightningDataModule (``data/``).
        strategy: ``lightning_dynmo.DynMoStrategy`` (``strategy/``, ``balancer/`` sets the initial split).
        callbacks: Named callbacks (``callbacks/``; ``balancer/`` and ``dynamism/`` set DynMo's knobs).
        logger: Named loggers (``logger/``).
        trainer: ``lightning.pytorch.Trainer``'s other arguments (``trainer/``).
        ckpt_path: Resume from this checkpoint (``Trainer.fit(ckpt_path=...)``: a file, a sharded
            checkpoint directory, or ``"last"``); ``None`` starts afresh.
        run_test: After fitting, run ``Trainer.test`` on the datamodule's test split.
    """

    seed: int = 0
    run_dir: str = "${hydra:runtime.output_dir}"
    ckpt_path: str | None = None
    run_test: bool = False
    model: Any = None
    data: Any = None
    strategy: Any = None
    callbacks: Any = None
    logger: Any = None
    trainer: Any = None


def schemas() -> dict[str, type]:
    """Every schema of :data:`SCHEMAS`, by name (nested schemas resolved)."""
    built: dict[str, type] = {}
    specs = {s.name: s for s in SCHEMAS}

    def build(name: str) -> type:
        if name not in built:
            spec = specs[name]
            nested = {arg: None if ref == "any" else build(ref) for arg, ref in spec.nested.items()}
            built[name] = schema_of(spec, nested)
        return built[name]

    for name in specs:
        build(name)
    return built


def register_schemas() -> None:
    """Store every schema as ``schema/<name>`` and :class:`TrainConfig` as ``train_schema``."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for name, node in schemas().items():
        store.store(group="schema", name=name, node=node)


def schema_of(spec: SchemaSpec, nested: Mapping[str, type | None] | None = None) -> type:
    """The dataclass schema of ``spec.target``'s arguments (see the module docstring).

    Args:
        spec: The constructor and its mapping.
        nested: Argument -> the schema of its node, or ``None`` for an untyped node (``Any``).

    Raises:
        TypeError: an argument whose default cannot be written in YAML is not in ``spec.exclude``.
    """
    target = _resolve(spec.target)
    nested = nested or {}
    fields: list[tuple[str, Any, Any]] = [("_target_", str, field(default=spec.target))]
    for name, param in _arguments(target, spec):
        if name in nested:
            schema = nested[name]
            if schema is None:
                fields.append((name, Any, field(default=None)))
            else:
                fields.append((name, schema, field(default_factory=schema)))
            continue
        annotation = _annotation(target, param)
        fields.append((name, *_typed_default(spec, name, annotation, param.default)))
    cls_name = "".join(part.title() for part in spec.name.split("_")) + "Schema"
    return dataclasses.make_dataclass(cls_name, fields)


# -- signature -> fields ------------------------------------------------------------------------------


def _arguments(target: Any, spec: SchemaSpec) -> list[tuple[str, inspect.Parameter]]:
    params = list(inspect.signature(target).parameters.values())
    out = []
    for p in params:
        if p.name in spec.exclude or p.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            taken = {q.name for q in params} | set(spec.kwargs_exclude) | set(spec.exclude)
            for source in spec.kwargs_from:
                extra = [
                    q for q in inspect.signature(_resolve(source)).parameters.values() if q.name not in taken
                ]
                out += [(q.name, q) for q in extra]
                taken |= {q.name for q in extra}
            continue
        out.append((p.name, p))
    return out


def _annotation(target: Any, param: inspect.Parameter) -> Any:
    """The parameter's annotation, evaluated where it was written (``Any`` if it cannot be)."""
    annotation = param.annotation
    if annotation is inspect.Parameter.empty:
        return Any
    if not isinstance(annotation, str):
        return annotation
    owners = [target, getattr(target, "__init__", None)]
    namespace: dict[str, Any] = {}
    for owner in owners:
        module = sys.modules.get(getattr(owner, "__module__", "") or "")
        if module is not None:
            namespace.update(vars(module))
    try:
        return eval(annotation, namespace)  # annotations are code the package wrote
    except Exception:
        return Any  # a TYPE_CHECKING-only name: the constructor checks the value itself


def _typed_default(spec: SchemaSpec, name: str, annotation: Any, default: Any) -> tuple[Any, Any]:
    kind = _config_type(annotation)
    if default is inspect.Parameter.empty:
        return kind, field(default="???")  # OmegaConf's MISSING: the config must set it
    if isinstance(default, pathlib.PurePath):
        default = str(default)
    if isinstance(default, (tuple, list)) and all(isinstance(v, _PRIMITIVES) for v in default):
        values = list(default)
        return Any, field(default_factory=lambda: list(values))
    if default is not None and not isinstance(default, _PRIMITIVES):
        raise TypeError(
            f"schema {spec.name!r}: {spec.target}({name}=...) defaults to {default!r}, which YAML cannot "
            "express; add it to the SchemaSpec's exclude (it then keeps that default)."
        )
    if default is None and kind is not Any and type(None) not in _union_members(kind):
        kind = Optional[kind]  # noqa: UP045  # OmegaConf reads typing's Optional
    if isinstance(default, bool) and kind in (int, float):
        kind = Any
    return kind, field(default=default)


def _config_type(annotation: Any) -> Any:
    """What OmegaConf can check of an annotation: primitives and optionals/unions of them, else ``Any``."""
    if annotation in (pathlib.Path, pathlib.PurePath):
        return str
    if annotation in _PRIMITIVES:
        return annotation
    members = _union_members(annotation)
    if not members:
        return Any
    optional = type(None) in members
    core: list[Any] = []
    for member in members:
        if member is type(None):
            continue
        member = str if member in (pathlib.Path, pathlib.PurePath) else member
        if member not in _PRIMITIVES:
            return Any
        if member not in core:
            core.append(member)
    kind: Any = core[0] if len(core) == 1 else Union[tuple(core)]  # noqa: UP007
    return Optional[kind] if optional else kind  # noqa: UP045


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) in (Union, types.UnionType):
        return get_args(annotation)
    return ()


def _resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
