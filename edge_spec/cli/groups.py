"""Option groups: a frozen dataclass whose fields are typer options, taken by a command as one parameter.

``@takes_groups`` shows typer the group's options in the parameter's place and, when the command runs,
hands the command one instance of the group, so options several commands share are declared once.  A
command writes such a parameter as ``engine: EngineFlags = ...`` (typer never sees its default).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any

from typer.models import OptionInfo

_OPTION = "typer_option"


def option(info: OptionInfo) -> Any:
    """A group field given on the command line as ``info`` (a ``typer.Option``)."""
    return dataclasses.field(metadata={_OPTION: info})


def takes_groups(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command`` with every parameter annotated with an option group replaced, for typer, by the
    group's options; called with those options, it gets them packed into the group."""
    signature = inspect.signature(command, eval_str=True)
    parameters: list[inspect.Parameter] = []
    groups: dict[str, tuple[type, list[str]]] = {}
    for parameter in signature.parameters.values():
        group = parameter.annotation
        if not (isinstance(group, type) and dataclasses.is_dataclass(group)):
            parameters.append(parameter)
            continue
        hints = typing.get_type_hints(group)
        names = [field.name for field in dataclasses.fields(group)]
        parameters += [
            inspect.Parameter(field.name, parameter.kind, default=field.metadata[_OPTION], annotation=hints[field.name])
            for field in dataclasses.fields(group)
        ]
        groups[parameter.name] = (group, names)
    seen = [parameter.name for parameter in parameters]
    if len(set(seen)) < len(seen):
        raise TypeError(f"{command.__name__}: an option group repeats a parameter name")

    @functools.wraps(command)
    def run(**values: Any) -> Any:
        for name, (group, names) in groups.items():
            values[name] = group(**{field: values.pop(field) for field in names})
        return command(**values)

    run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    run.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
    return run
