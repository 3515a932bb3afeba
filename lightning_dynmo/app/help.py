"""The config groups ``--help`` lists: the user's groups, without Hydra's own and the internal schemas.

Hydra's default help lists every config group but ``hydra/``, including the ``schema`` group that
:func:`~lightning_dynmo.app.schema.register_schemas` fills with one entry per constructor (24 of them, never
chosen on the command line). ``conf/hydra/help/dynmo.yaml`` uses Hydra's template with
``${dynmo_config_groups:}`` (:func:`user_config_groups`) where the default has ``$APP_CONFIG_GROUPS``.
"""

from __future__ import annotations

from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType

__all__ = ["HIDDEN_GROUPS", "user_config_groups"]

#: Top-level groups ``--help`` leaves out: Hydra's own (``--hydra-help`` lists them) and the schemas.
HIDDEN_GROUPS = frozenset({"hydra", "schema"})


def user_config_groups() -> str:
    """One ``group: option, option`` line per user-facing config group, as Hydra's help writes them.

    Read from Hydra's config loader, so groups a user adds (``--config-dir``, ``hydra.searchpath``) show
    too. Empty when Hydra is not initialised (the template is only resolved inside a Hydra app).
    """
    if not GlobalHydra.instance().is_initialized():
        return ""
    loader = GlobalHydra.instance().config_loader()

    def groups(parent: str) -> list[str]:
        found: list[str] = []
        for name in loader.list_groups(parent):
            group = f"{parent}/{name}" if parent else name
            if not parent and name in HIDDEN_GROUPS:
                continue
            if loader.get_group_options(group, ObjectType.CONFIG):
                found.append(group)
            if loader.get_group_options(group, ObjectType.GROUP):
                found.extend(groups(group))
        return found

    return "\n".join(
        f"{group}: {', '.join(sorted(loader.get_group_options(group)))}" for group in sorted(groups(""))
    )
