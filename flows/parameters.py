"""Flow parameters: one per ``config.GROUPS`` group (data, model, generation, ...), each an object of that
group's ``RunConfig`` fields, generated from it.

The UI's Custom run form draws an object parameter as a titled box of its fields, so the form reads as the
groups (one flat parameter per field was a list of 56 "(Optional)" fields with no headers). Prefect merges a
run's parameters with its deployment's *per top-level parameter*: a run (an API call, an event, ``--param``)
that gives ``generation: {max_tokens: 8}`` replaces the deployment's whole ``generation`` object. So a field
that a run's group leaves out takes its deployment's value, read from the deployment when the run starts
(``deployment_values``), else RunConfig's default: a run that sets ``max_tokens`` keeps every other deployment
value, its prompt too. ``RunConfig`` stays the one typed source: the flow's signature, the form (title,
description, type, bounds, default of each field, in RunConfig's groups), the CLI options and the YAML keys
all come from it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo

from captionflow.config import GROUPS, RunConfig

# what each group's box in the form says under its name
GROUP_DESCRIPTIONS = {
    "Data": "Where the images (and reference captions) come from, how they are read and sharded, and the output.",
    "Model": "The checkpoint to caption with, and the image size it sees.",
    "Generation": "The prompts and sampling of each caption.",
    "Evaluation": "Scores beside the reference metrics (judge, pairwise, CLIPScore), the verdict, the "
    "comparison's bootstrap, the report's images and the regression alert.",
    "Engine": "How the vLLM engines are sized and placed (unset: the device preset's).",
    "Cluster": "The Ray cluster the run joins or starts.",
    "Reliability": "Retries, commits, leases, stalls and the run's deadline.",
}


def parameter_name(group: str) -> str:
    return group.lower()


def _group_model(group: str, names: tuple[str, ...]) -> type[BaseModel]:
    fields: dict[str, Any] = {n: (RunConfig.model_fields[n].annotation, RunConfig.model_fields[n]) for n in names}
    return create_model(
        group,
        __config__=ConfigDict(extra="forbid", protected_namespaces=()),
        __doc__=GROUP_DESCRIPTIONS[group],
        **fields,
    )


# parameter name -> the group's model (its fields: RunConfig's, with their titles, descriptions and bounds)
GROUP_MODELS: dict[str, type[BaseModel]] = {parameter_name(g): _group_model(g, names) for g, names in GROUPS.items()}


def flow_parameters(config: RunConfig) -> dict[str, dict[str, Any]]:
    """``config`` as the flows' parameters (JSON values): {group: {field: value}}, every field given."""
    values = config.model_dump(mode="json")
    return {parameter_name(g): {n: values[n] for n in names} for g, names in GROUPS.items()}


def config_parameters() -> list[inspect.Parameter]:
    """A keyword parameter per group, its type the group's model and its default RunConfig's defaults."""
    return [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            # Prefect takes a parameter's description from a pydantic Field default (and titles it by its name)
            default=Field(default=model(), description=model.__doc__),
            annotation=model,
        )
        for name, model in GROUP_MODELS.items()
    ]


def _given(value: Any) -> dict[str, Any]:
    """The fields a run gave in one group's value (a validated model: the fields set; a dict: its keys)."""
    if isinstance(value, BaseModel):
        return {k: getattr(value, k) for k in value.model_fields_set}
    if isinstance(value, dict):
        return dict(value)
    return {}  # unset (Prefect hands on the Field default): RunConfig's defaults


def deployment_values(missing: set[str]) -> dict[str, Any]:
    """The ``missing`` fields' values in the parameters of the deployment this flow run belongs to (a field its
    groups give), {} outside a deployment's run."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    run = FlowRunContext.get()
    deployment_id = run.flow_run.deployment_id if run is not None and run.flow_run is not None else None
    if deployment_id is None:
        return {}
    with get_client(sync_client=True) as client:
        stored = client.read_deployment(deployment_id).parameters or {}
    values: dict[str, Any] = {}
    for name in GROUP_MODELS:
        group = stored.get(name)
        if isinstance(group, dict):
            values.update({k: v for k, v in group.items() if k in missing})
    return values


def with_config_parameters(*extra: inspect.Parameter) -> Callable:
    """Decorate ``fn(config: RunConfig, **extra)`` into ``fn(*, <a parameter per group>, *extra)``: the function
    Prefect sees takes the groups and builds the RunConfig (validated, as everywhere else) for ``fn``: each field
    from the run's group, else its deployment's value, else RunConfig's default."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(**params: Any):
            given: dict[str, Any] = {}
            for name in GROUP_MODELS:
                given.update(_given(params.pop(name, None)))
            missing = set(RunConfig.model_fields) - set(given)
            config = RunConfig(**{**(deployment_values(missing) if missing else {}), **given})
            rest = {k: v for k, v in params.items() if not isinstance(v, FieldInfo)}  # unset: fn's default
            return fn(config, **rest)

        del wrapper.__wrapped__  # Prefect must see the signature below, not fn's
        wrapper.__signature__ = inspect.Signature(
            [*config_parameters(), *extra], return_annotation=inspect.signature(fn).return_annotation
        )
        return wrapper

    return decorate
