"""Flow parameters: one per ``RunConfig`` field, generated from it.

Prefect merges a run's parameters with its deployment's *per top-level parameter*: with one nested
``config`` parameter, a custom run, an API call or an event that set one field replaced the whole
config (the deployment's dataset, model and output were lost). With one parameter per field, a run that
sets ``max_tokens`` keeps every other deployment default. ``RunConfig`` stays the one typed source: the
flow's signature, the UI form (title, description, type, default of each field, in RunConfig's order), the
CLI options and the YAML keys all come from it, grouped by ``config.GROUPS``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import Field
from pydantic.fields import FieldInfo

from captionflow.config import RunConfig, grouped_fields


def config_parameters() -> list[inspect.Parameter]:
    """A keyword parameter per RunConfig field, with its type, default, title and description, group by group
    (``config.GROUPS``: the form lists Data, Model, Generation, ... each description led by its group)."""
    params = []
    for group, name, field in grouped_fields():
        title = field.title or name.replace("_", " ").capitalize()
        # Prefect takes a parameter's description from a pydantic Field default (and titles it by its name)
        default = Field(
            default=field.get_default(call_default_factory=True),
            description=f"{group} · {title}: {field.description}" if field.description else f"{group} · {title}",
        )
        # the field's constraints (ge, le, gt, ...) ride on the annotation: the schema Prefect builds from the
        # signature - the UI form, the API's parameter validation - keeps every bound RunConfig has
        annotation = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    return params


def with_config_parameters(*extra: inspect.Parameter) -> Callable:
    """Decorate ``fn(config: RunConfig, **extra)`` into ``fn(*, <every RunConfig field>, *extra)``: the function
    Prefect sees takes the fields and builds the RunConfig (validated, as everywhere else) for ``fn``."""

    def decorate(fn: Callable) -> Callable:
        names = set(RunConfig.model_fields)

        @functools.wraps(fn)
        def wrapper(**params: Any):
            params = {k: v for k, v in params.items() if not isinstance(v, FieldInfo)}  # unset: RunConfig's default
            config = RunConfig(**{k: v for k, v in params.items() if k in names})
            return fn(config, **{k: v for k, v in params.items() if k not in names})

        del wrapper.__wrapped__  # Prefect must see the signature below, not fn's
        wrapper.__signature__ = inspect.Signature(
            [*config_parameters(), *extra], return_annotation=inspect.signature(fn).return_annotation
        )
        return wrapper

    return decorate
