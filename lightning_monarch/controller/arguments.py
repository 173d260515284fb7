"""Checks of the arguments users give ``MonarchStrategy``, ``MonarchFSDPStrategy`` and
``MeshStatsMonitor``, at construction, before any worker starts.

Runs on the controller. Each check returns the value it accepted and raises with the argument as
the user wrote it, what it must be and, where one fits, an example.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

#: The kinds of parameter a caller names.
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def whole_number(
    owner: str, name: str, value: Any, minimum: int, *, of: str = "", meaning: str = "", none: Optional[str] = None
) -> Any:
    """``value`` if it is an ``int`` (not a ``bool``) of at least ``minimum``; ``None`` too when
    ``none`` says what it means. Otherwise ``ValueError``."""
    if value is None and none is not None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return value
    counted = f" of {of}" if of else ""
    alternative = f", or None {none}" if none is not None else ""
    raise ValueError(f"`{owner}({name}={value!r})`: give a whole number{counted} >= {minimum}{meaning}{alternative}.")


def number(
    owner: str,
    name: str,
    value: Any,
    *,
    above: float,
    at_most: Optional[float] = None,
    of: str = "",
    meaning: str = "",
    none: Optional[str] = None,
) -> Any:
    """``value`` if it is a real number (not a ``bool``) above ``above`` and at most ``at_most``;
    ``None`` too when ``none`` says what it means. Otherwise ``ValueError``."""
    if value is None and none is not None:
        return None
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and value > above
        and (at_most is None or value <= at_most)
    ):
        return value
    counted = f" of {of}" if of else ""
    bounds = f"in ({above:g}, {at_most:g}]" if at_most is not None else f"> {above:g}"
    alternative = f", or None {none}" if none is not None else ""
    raise ValueError(f"`{owner}({name}={value!r})`: give a number{counted} {bounds}{meaning}{alternative}.")


def validation(owner: str, mode: Any, devices: Any, hosts: Any) -> tuple[str, Optional[int], Any]:
    """``validation``, ``validation_devices`` and ``validation_hosts`` if valid: ``"sync"`` or
    ``"async"``, a whole number or ``None``, and hosts only with ``"async"``. Otherwise ``ValueError``."""
    if mode not in ("sync", "async"):
        raise ValueError(f"`{owner}(validation={mode!r})`: give one of 'sync', 'async'.")
    if hosts is not None and mode != "async":
        raise ValueError(
            f"`{owner}(validation_hosts=...)` places the workers of asynchronous validation, but"
            f" `validation={mode!r}` validates on the training workers. Pass `validation='async'`, or drop"
            " `validation_hosts`."
        )
    return mode, whole_number(owner, "validation_devices", devices, 1, none="for as many as train"), hosts


def duration(owner: str, name: str, value: Any) -> Optional[timedelta]:
    """``value`` if it is a ``timedelta`` or ``None``; otherwise ``TypeError``."""
    if value is not None and not isinstance(value, timedelta):
        raise TypeError(
            f"`{owner}({name}={value!r})`: give a `datetime.timedelta`, e.g. `timedelta(minutes=30)`, or None."
        )
    return value


def flag(owner: str, name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False``; otherwise ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"`{owner}({name}={value!r})`: give True or False.")
    return value


def module_classes(owner: str, name: str, classes: Optional[Iterable[Any]]) -> tuple[type[nn.Module], ...]:
    """The ``nn.Module`` classes of an argument that names them (``fsdp_policy``,
    ``activation_checkpointing_policy``), in a fixed order; anything else is a ``TypeError``."""
    found = tuple(sorted(set(classes or ()), key=repr))
    bad = [cls for cls in found if not (isinstance(cls, type) and issubclass(cls, nn.Module))]
    if bad:
        raise TypeError(
            f"`{owner}({name}={set(found)!r})`: {bad} are not `nn.Module` classes. Give module classes, e.g."
            f" `{name}={{nn.TransformerEncoderLayer}}`."
        )
    return found


def mixed_precision_policy(owner: str, value: Any) -> Optional[MixedPrecisionPolicy]:
    """FSDP2's ``MixedPrecisionPolicy`` with floating-point dtypes, or ``None``."""
    example = "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
    if value is None:
        return None
    if not isinstance(value, MixedPrecisionPolicy):
        raise TypeError(
            f"`{owner}(mixed_precision={value!r})`: give FSDP2's `MixedPrecisionPolicy` (from"
            f" `torch.distributed.fsdp`), e.g. `mixed_precision={example}`."
        )
    dtypes = {name: getattr(value, name) for name in ("param_dtype", "reduce_dtype", "output_dtype")}
    bad = {
        name: dtype
        for name, dtype in dtypes.items()
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point)
    }
    if bad:
        raise TypeError(
            f"`{owner}(mixed_precision={value!r})`: {bad} are not floating-point torch dtypes. Give e.g."
            f" `mixed_precision={example}`."
        )
    return value


def ddp_kwargs(kwargs: dict[str, Any], accepted: frozenset[str], sharded_options: Iterable[str]) -> dict[str, Any]:
    """``MonarchStrategy``'s extra keyword arguments, which go to ``DistributedDataParallel`` on
    the workers: a sharding option among them names ``MonarchFSDPStrategy``; anything else that
    ``DistributedDataParallel`` does not take is a ``TypeError``."""
    sharding = sorted(set(kwargs) & set(sharded_options))
    if sharding == ["parallelism"] and kwargs["parallelism"] == "ddp":
        raise TypeError(
            "`MonarchStrategy(parallelism='ddp')`: `MonarchStrategy` always gives every worker a replica of the"
            " module. Remove `parallelism`; `MonarchFSDPStrategy` shards the module instead."
        )
    if sharding:
        given = ", ".join(f"{name}={kwargs[name]!r}" for name in sharding)
        options = ", ".join(f"{name}=..." for name in sharding if name != "parallelism")
        raise TypeError(
            f"`MonarchStrategy({given})`: sharding the module across the workers is `MonarchFSDPStrategy`'s job."
            f" Pass `lightning_monarch.MonarchFSDPStrategy({options})`, or `strategy='monarch_fsdp'`."
        )
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise TypeError(
            f"MonarchStrategy got {unknown}, which are not keyword arguments of `DistributedDataParallel`."
            f" Accepted: {sorted(accepted)}."
        )
    return kwargs


def constructor_arguments(obj: Any, top: type, bottom: type, left_out: frozenset[str]) -> dict[str, Any]:
    """The arguments ``obj`` was made with, read from its attributes of the same names: the named
    parameters of ``top``'s constructor, and of each base's constructor that the one above passes
    ``**kwargs`` on to, down to ``bottom``'s; less ``left_out``. ``AttributeError`` names the
    parameters that ``obj`` keeps no attribute of."""
    names: list[str] = []
    for base in top.__mro__:
        if "__init__" not in vars(base):
            continue
        parameters = list(inspect.signature(vars(base)["__init__"]).parameters.values())[1:]  # not ``self``
        names += [
            parameter.name for parameter in parameters if parameter.kind in _NAMED and parameter.name not in left_out
        ]
        if base is bottom or all(parameter.kind is not parameter.VAR_KEYWORD for parameter in parameters):
            break
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        raise AttributeError(
            f"`{type(obj).__name__}({', '.join(f'{name}=...' for name in missing)})`: a rehearsal makes a copy of"
            " the strategy from its constructor's arguments, read from the attributes of the same names. Keep each"
            f" argument as one (`self.{missing[0]} = {missing[0]}`)."
        )
    return {name: getattr(obj, name) for name in names}
