"""Every option of every ``conf/`` group composes and instantiates; bad keys and values fail by name.

In the style of lightning-hydra-template's ``tests/test_configs.py``: compose with Hydra's API, then
instantiate every node exactly as ``lightning_dynmo.train.fit`` does (without fitting).
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from hydra.errors import ConfigCompositionException, InstantiationException, MissingConfigException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_dynmo.app.report import RunReport
from lightning_dynmo.app.schema import SCHEMAS, SchemaSpec, _resolve, schema_of, schemas
from lightning_dynmo.callback import DynMoCallback
from lightning_dynmo.dynamism_callbacks import FreezingCallback, PruningCallback
from lightning_dynmo.models import GPT
from lightning_dynmo.strategy import DynMoStrategy
from lightning_dynmo.train import CONF_DIR
from tests.configs.conftest import Compose, group_options

GROUPS = ("model", "dynamism", "balancer", "strategy", "callbacks", "trainer", "data", "logger", "experiment")
#: Trainer options for machines this test may not have: instantiated with the CPU accelerator here.
_DEVICE_TRAINERS = {"gpu", "multinode"}


def instantiate_all(cfg: DictConfig) -> dict[str, Any]:
    """Every node of a composed config, instantiated as ``lightning_dynmo.train.fit`` does."""
    import lightning_dynmo.dynamism  # noqa: F401

    strategy = instantiate(cfg.strategy, _convert_="all")
    callbacks = [instantiate(n, _convert_="all") for n in (cfg.callbacks or {}).values() if n is not None]
    loggers = [instantiate(n, _convert_="all") for n in (cfg.logger or {}).values() if n is not None]
    return {
        "model": instantiate(cfg.model, _convert_="all"),
        "data": instantiate(cfg.data, _convert_="all"),
        "strategy": strategy,
        "callbacks": callbacks,
        "loggers": loggers,
        "trainer": instantiate(
            cfg.trainer, strategy=strategy, callbacks=callbacks, logger=loggers or False, _convert_="all"
        ),
    }


def _overrides(group: str, option: str, tmp_path: Path) -> list[str]:
    out = [f"{group}={option}"]
    if (group, option) == ("data", "text_files"):
        (tmp_path / "a.txt").write_text("hello world\n" * 100)
        out.append(f"data.corpus.paths={tmp_path}")
    if group == "trainer" and option in _DEVICE_TRAINERS:
        out += ["trainer.accelerator=cpu", "trainer.devices=2"]  # "all GPUs" means nothing on CPU
    return out


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in group_options(g)])
def test_every_option_composes_and_instantiates(
    compose_train: Compose, group: str, option: str, tmp_path: Path
) -> None:
    cfg = compose_train(_overrides(group, option, tmp_path))
    built = instantiate_all(cfg)
    assert isinstance(built["model"], GPT)
    assert isinstance(built["strategy"], DynMoStrategy)
    assert isinstance(built["trainer"], pl.Trainer)
    assert any(isinstance(c, DynMoCallback) for c in built["callbacks"])
    assert any(isinstance(c, RunReport) for c in built["callbacks"])
    assert built["model"].config.num_layers == cfg.model.config.num_layers


def test_the_groups_in_the_brief_exist() -> None:
    assert set(group_options("balancer")) == {
        "static_uniform",
        "static_params",
        "partition_time",
        "partition_params",
        "diffusion_time",
        "diffusion_params",
    }
    assert {"cpu", "gpu", "multinode"} <= set(group_options("trainer"))
    assert {"none", "moe"} <= set(group_options("dynamism"))


@pytest.mark.parametrize("option", group_options("balancer"))
def test_a_balancer_option_sets_the_callback_and_the_initial_split(
    compose_train: Compose, option: str
) -> None:
    built = instantiate_all(compose_train([f"balancer={option}"]))
    callback = next(c for c in built["callbacks"] if isinstance(c, DynMoCallback))
    kind, _, cost = option.partition("_")
    if kind == "static":
        assert callback.balance.balancer == "static"
        assert built["strategy"]._placement_arg == {"uniform": "uniform", "params": "parameters"}[cost]
    else:
        assert (callback.balance.balancer, callback.balance.cost) == (kind, cost)
        assert built["strategy"]._placement_arg == "uniform"


@pytest.mark.parametrize("option", group_options("dynamism"))
def test_a_dynamism_option_builds_its_blocks(compose_train: Compose, option: str) -> None:
    built = instantiate_all(compose_train([f"dynamism={option}", "model=gpt_tiny"]))
    kinds = {kind.name for kind, _ in built["model"].config.resolved_blocks()}
    # pruning and freezing keep dense blocks and change them from a callback
    expected = {"none": {"dense"}, "pruning": {"dense"}, "freezing": {"dense"}}.get(option, {option})
    assert expected <= kinds, kinds
    freezers = [c for c in built["callbacks"] if isinstance(c, FreezingCallback)]
    assert len(freezers) == (option == "freezing")
    if freezers:
        assert freezers[0].freezer.config.check_every == 10
    pruners = [c for c in built["callbacks"] if isinstance(c, PruningCallback)]
    assert len(pruners) == (option == "pruning")
    if pruners:
        assert pruners[0].pruner.config.schedule.start_step == 10


def test_a_misspelt_key_fails_naming_it(compose_train: Compose) -> None:
    with pytest.raises(ConfigCompositionException, match=r"Could not override 'model\.config\.num_layer'"):
        compose_train(["model.config.num_layer=3"])
    with pytest.raises(ConfigCompositionException, match=r"'callbacks\.dynmo\.every_n_step'"):
        compose_train(["callbacks.dynmo.every_n_step=10"])


def test_a_value_of_the_wrong_type_fails_naming_the_key(compose_train: Compose) -> None:
    with pytest.raises(ConfigCompositionException, match=r"trainer\.max_steps=many") as info:
        compose_train(["trainer.max_steps=many"])
    assert "could not be converted to Integer" in str(info.value.__cause__)
    assert "full_key: trainer.max_steps" in str(info.value.__cause__)


def test_a_misspelt_key_in_a_config_file_fails_naming_it(compose_train: Compose, tmp_path: Path) -> None:
    extra = tmp_path / "extra" / "experiment"
    extra.mkdir(parents=True)
    (extra / "typo.yaml").write_text("# @package _global_\ntrainer:\n  max_step: 3\n")
    with pytest.raises(ConfigCompositionException) as info:
        compose_train([f"hydra.searchpath=[file://{tmp_path / 'extra'}]", "experiment=typo"])
    cause = str(info.value.__cause__ or info.value)
    assert "Key 'max_step' not in 'TrainerSchema'" in cause
    assert "full_key: trainer.max_step" in cause


def test_an_unknown_option_lists_the_available_ones(compose_train: Compose) -> None:
    with pytest.raises(MissingConfigException, match=r"Could not find 'dynamism/early_exits'"):
        compose_train(["dynamism=early_exits"])


def test_a_bad_value_fails_at_instantiation_naming_the_node(compose_train: Compose) -> None:
    cfg = compose_train(["callbacks.dynmo.balancer=best"])
    with pytest.raises(InstantiationException, match=r"(?s)balancer.*best.*full_key: callbacks\.dynmo"):
        instantiate(cfg.callbacks.dynmo)


def test_the_text_files_corpus_needs_its_paths(compose_train: Compose) -> None:
    cfg = compose_train(["data=text_files"])
    with pytest.raises(Exception, match=r"Missing mandatory value: data\.corpus\.paths"):
        instantiate(cfg.data)


# -- the schemas mirror the constructors ------------------------------------------------------------


def _constructor_defaults(spec: SchemaSpec) -> dict[str, Any]:
    params = dict(inspect.signature(_resolve(spec.target)).parameters)
    out = {}
    for name, p in params.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            skip = set(params) | set(spec.kwargs_exclude)
            for source in spec.kwargs_from:
                extra = inspect.signature(_resolve(source)).parameters
                out.update({n: q.default for n, q in extra.items() if n not in skip and n not in out})
            continue
        if name not in spec.exclude and p.kind is not inspect.Parameter.VAR_POSITIONAL:
            out[name] = p.default
    return out


@pytest.mark.parametrize("spec", SCHEMAS, ids=lambda s: s.name)
def test_a_schema_has_every_argument_with_the_constructor_default(spec: SchemaSpec) -> None:
    schema = schemas()[spec.name]
    fields = {f.name: f for f in dataclasses.fields(schema)}
    assert fields.pop("_target_").default == spec.target
    expected = _constructor_defaults(spec)
    assert set(fields) == set(expected)
    node = OmegaConf.structured(schema)
    for name, default in expected.items():
        if name in spec.nested:
            continue
        if default is inspect.Parameter.empty:
            assert OmegaConf.is_missing(node, name)
            continue
        value = OmegaConf.to_container(node[name]) if OmegaConf.is_config(node[name]) else node[name]
        assert value == (list(default) if isinstance(default, tuple) else default), name


def test_a_default_yaml_cannot_express_must_be_excluded() -> None:
    # Negative control: DynMoCallback's clock (a function) without its exclusion.
    spec = SchemaSpec("clocked", "lightning_dynmo.callback.DynMoCallback", exclude=("event_bus", "profiling"))
    with pytest.raises(
        TypeError, match=r"DynMoCallback\(clock=\.\.\.\) defaults to .*add it to the SchemaSpec"
    ):
        schema_of(spec)


def test_every_schema_is_used_by_some_option() -> None:
    text = "\n".join(p.read_text() for p in CONF_DIR.rglob("*.yaml"))
    nested = {ref for s in SCHEMAS for ref in s.nested.values()}
    unused = [s.name for s in SCHEMAS if f"/schema/{s.name}@" not in text and s.name not in nested]
    assert not unused, f"schemas no conf/ option uses: {unused}"


@pytest.mark.parametrize("experiment", group_options("experiment"))
@pytest.mark.parametrize("data", group_options("data"))
def test_every_experiment_composes_with_every_data_option(
    compose_train: Compose, experiment: str, data: str, tmp_path: Path
) -> None:
    # an experiment that set a key of one corpus only (stdlib's max_bytes) would break the other
    compose_train([f"experiment={experiment}", *_overrides("data", data, tmp_path)])


def test_the_readme_override_example_builds(compose_train: Compose) -> None:
    cfg = compose_train(["dynamism=pruning", "balancer=diffusion_time", "trainer.max_steps=200"])
    built = instantiate_all(cfg)
    assert built["trainer"].max_steps == 200
    callback = next(c for c in built["callbacks"] if isinstance(c, DynMoCallback))
    assert (callback.balance.balancer, callback.balance.cost) == ("diffusion", "time")
    assert any(isinstance(c, PruningCallback) for c in built["callbacks"])


def test_a_freezing_schedule_from_the_command_line(compose_train: Compose) -> None:
    cfg = compose_train(
        [
            "dynamism=freezing",
            "callbacks.freezing.config.criterion=schedule",
            "callbacks.freezing.config.schedule=[[20,2],[40,4]]",
        ]
    )
    freezer = next(c for c in instantiate_all(cfg)["callbacks"] if isinstance(c, FreezingCallback)).freezer
    assert freezer.config.schedule == ((20, 2), (40, 4))


def test_the_callbacks_grouped_knobs_from_the_command_line(compose_train: Compose) -> None:
    cfg = compose_train(
        [
            "callbacks.dynmo.profiling.steps=2",
            "callbacks.dynmo.profiling.measure_comm=false",
            "callbacks.dynmo.repack={_target_:lightning_dynmo.callback.RepackConfig,max_slowdown:0.5}",
        ]
    )
    callback = next(c for c in instantiate_all(cfg)["callbacks"] if isinstance(c, DynMoCallback))
    assert (callback.profiling.steps, callback.profiling.measure_comm) == (2, False)
    assert callback.balance.repack and callback.balance.max_slowdown == 0.5
    with pytest.raises(Exception, match=r"callbacks\.dynmo\.profiling\.stpes"):
        compose_train(["callbacks.dynmo.profiling.stpes=2"])
