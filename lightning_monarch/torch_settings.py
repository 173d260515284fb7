"""torch's process-wide settings that a user's script makes, carried to the workers.

Both sides. Under ``ddp`` every rank runs the user's script, so ``torch.set_default_dtype(...)``,
``torch.set_float32_matmul_precision(...)`` or ``torch.backends.cudnn.benchmark = True`` hold on
every rank. The workers never run the script: the controller reads each setting of
:data:`SETTINGS` as a stage starts (:func:`changed`, ``controller.launch.stage_inputs``), and each
worker makes the ones the script changed before any of the stage's objects is unpickled
(:func:`apply`, ``worker.stage_settings``), which puts them back when the stage ends.

"Changed" is against a fresh worker process on the controller's host, where this file runs as
``__main__`` (``controller.launch.fresh_settings``, once per controller process): a worker keeps the
values its own host chose where the script left them alone (a ROCm host's BLAS library, a CPU's
quantized engine), as a ddp rank there would.

:data:`SETTINGS` is the one list: ``tests/test_torch_settings.py`` changes each of them on the
controller and reads it back on the workers, and fails on a flag of ``torch.backends`` that is not
in it. Left out on purpose: thread counts (a rank's are its launcher's, ``worker.process``), print
options (display only), and per-device state (the cuFFT plan cache, memory fractions).

This module imports only torch and the standard library, so that it can run alone as a script.
"""

from __future__ import annotations

import functools
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: A stage's settings: each carried setting's name and the controller's value.
Values = dict[str, Any]


@dataclass(frozen=True)
class Setting:
    """One process-wide setting: its name as a user reads it, how to read and how to make it."""

    name: str
    get: Callable[[], Any]
    set: Callable[[Any], Any]
    #: A thread's, not the process's (a new thread takes its creator's): made on the thread that
    #: runs the stage (:func:`split`).
    per_thread: bool = False


def _attribute(path: str) -> Setting:
    """A setting that is an attribute, ``torch.backends.cudnn.benchmark`` say."""
    holder, _, name = path.rpartition(".")

    def owner() -> Any:
        return functools.reduce(getattr, holder.split(".")[1:], torch)

    return Setting(path, lambda: getattr(owner(), name), lambda value: setattr(owner(), name, value))


def _function(module: str, getter: str, setter: str) -> Setting:
    """A setting read by a function and made by another, ``torch.get_default_dtype`` say."""
    owner = functools.reduce(getattr, module.split(".")[1:], torch)
    return Setting(f"{module}.{getter}()", getattr(owner, getter), getattr(owner, setter))


def _pair(path: str) -> Setting:
    """A cuBLAS reduction setting read as two attributes (``..._split_k``) and made as one pair."""
    plain = _attribute(path)
    split_k = _attribute(f"{path}_split_k")
    return Setting(path, lambda: (plain.get(), split_k.get()), plain.set)


def _library(name: str) -> Setting:
    """One of ``torch.backends.cuda``'s preferred libraries, by the name its function takes."""
    choose = getattr(torch.backends.cuda, name)
    return Setting(f"torch.backends.cuda.{name}()", lambda: choose().name.lower(), choose)


def _flushes_denormals() -> bool:
    """Whether ``torch.set_flush_denormal(True)`` is in force (torch has no getter): a denormal
    double is then read as zero."""
    return bool(torch.tensor([1e-323], dtype=torch.float64, device="cpu")[0] == 0)


#: Every carried setting, in the order a worker makes them: the general before the particular, as
#: a general one also sets the particular (``set_float32_matmul_precision`` sets each backend's
#: ``fp32_precision`` of matmul; ``torch.backends.fp32_precision`` each backend's). torch's legacy
#: TF32 flags (``allow_tf32``) are views of the ``fp32_precision`` settings, which are carried.
SETTINGS: tuple[Setting, ...] = (
    _function("torch", "get_default_dtype", "set_default_dtype"),
    _function("torch", "get_default_device", "set_default_device"),
    Setting(
        "torch.are_deterministic_algorithms_enabled()",
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1]),
    ),
    _attribute("torch.utils.deterministic.fill_uninitialized_memory"),
    Setting(
        "torch.is_anomaly_enabled()",
        lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        lambda value: torch.set_anomaly_enabled(*value),
    ),
    # the CPU's floating-point mode register: each thread has its own
    Setting("torch.set_flush_denormal()", _flushes_denormals, torch.set_flush_denormal, per_thread=True),
    _function("torch", "is_warn_always_enabled", "set_warn_always"),
    _function("torch", "get_float32_matmul_precision", "set_float32_matmul_precision"),
    _attribute("torch.backends.fp32_precision"),
    _attribute("torch.backends.cudnn.fp32_precision"),
    _attribute("torch.backends.cudnn.conv.fp32_precision"),
    _attribute("torch.backends.cudnn.rnn.fp32_precision"),
    _attribute("torch.backends.cuda.matmul.fp32_precision"),
    _attribute("torch.backends.mkldnn.fp32_precision"),
    _attribute("torch.backends.mkldnn.matmul.fp32_precision"),
    _attribute("torch.backends.mkldnn.conv.fp32_precision"),
    _attribute("torch.backends.mkldnn.rnn.fp32_precision"),
    _attribute("torch.backends.cudnn.enabled"),
    _attribute("torch.backends.cudnn.deterministic"),
    _attribute("torch.backends.cudnn.benchmark"),
    _attribute("torch.backends.cudnn.benchmark_limit"),
    _attribute("torch.backends.cudnn.depthwise_kernel"),
    _pair("torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction"),
    _pair("torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"),
    _attribute("torch.backends.cuda.matmul.allow_fp16_accumulation"),
    _function("torch.backends.cuda", "flash_sdp_enabled", "enable_flash_sdp"),
    _function("torch.backends.cuda", "mem_efficient_sdp_enabled", "enable_mem_efficient_sdp"),
    _function("torch.backends.cuda", "math_sdp_enabled", "enable_math_sdp"),
    _function("torch.backends.cuda", "cudnn_sdp_enabled", "enable_cudnn_sdp"),
    _function("torch.backends.cuda", "fp16_bf16_reduction_math_sdp_allowed", "allow_fp16_bf16_reduction_math_sdp"),
    _library("preferred_linalg_library"),
    _library("preferred_blas_library"),
    _library("preferred_rocm_fa_library"),
    _attribute("torch.backends.mkldnn.enabled"),
    _attribute("torch.backends.mkldnn.deterministic"),
    _attribute("torch.backends.miopen.immediate"),
    _attribute("torch.backends.opt_einsum.enabled"),
    _attribute("torch.backends.opt_einsum.strategy"),
    _attribute("torch.backends.quantized.engine"),
    _function("torch.backends.mha", "get_fastpath_enabled", "set_fastpath_enabled"),
)


#: What :func:`_value` gives for a setting torch refuses to read.
_UNREADABLE = object()


def _value(setting: Setting) -> Any:
    """``setting``'s value here, or :data:`_UNREADABLE`: torch refuses to read its legacy views
    (``get_float32_matmul_precision``) once a script mixed them with the ``fp32_precision``
    settings, which are then carried and say the same."""
    try:
        return setting.get()
    except RuntimeError:
        return _UNREADABLE


def read() -> Values:
    """Each readable setting's value in this process, by name."""
    values = {setting.name: _value(setting) for setting in SETTINGS}
    return {name: value for name, value in values.items() if value is not _UNREADABLE}


def changed(fresh: Values) -> Values:
    """Runs on the controller: the settings the script changed (those that differ from ``fresh``, a
    fresh worker process's), with this process's values."""
    return {name: value for name, value in read().items() if fresh.get(name) != value}


def split(values: Values) -> tuple[Values, Values]:
    """``values`` as the process's settings and the thread's (:attr:`Setting.per_thread`)."""
    per_thread = {setting.name for setting in SETTINGS if setting.per_thread}
    return (
        {name: value for name, value in values.items() if name not in per_thread},
        {name: value for name, value in values.items() if name in per_thread},
    )


def apply(values: Values) -> Values:
    """Runs in each worker before a stage's objects are unpickled: make ``values`` in the order of
    :data:`SETTINGS`, each where this process's differs. Returns every setting's value from before
    (empty where none differed), which ``apply`` puts back when the stage ends
    (``worker.stage_settings``). Raises ``RuntimeError`` naming a setting that did not take the
    controller's value (torch refused it here, or a later setting undid it), with the process as
    it was."""
    before = read()
    if all(before[name] == value for name, value in values.items()):
        return {}
    refused = _make(values)
    now = read()
    wrong = [name for name, value in values.items() if now.get(name, _UNREADABLE) != value]
    if wrong:
        _make(before)
        reasons = "; ".join(
            f"{name} = {values[name]!r}: {refused.get(name, 'a later setting changed it')}" for name in wrong
        )
        raise RuntimeError(
            f"The script changed torch's settings on the controller, and a worker cannot make the same ({reasons})."
            " Under ddp every rank would have them. Make the setting in the module's `setup` hook instead, where"
            " each worker makes it for itself, or leave it out where the workers' torch refuses it."
        )
    return before


def _make(values: Values) -> dict[str, str]:
    """Set each of ``values`` where this process's differs, in the order of :data:`SETTINGS`.
    Returns torch's refusals, by setting."""
    refused = {}
    for setting in SETTINGS:
        if setting.name in values and _value(setting) != values[setting.name]:
            try:
                setting.set(values[setting.name])
            except (RuntimeError, ValueError, TypeError) as error:
                refused[setting.name] = str(error)
    return refused


if __name__ == "__main__":
    sys.stdout.buffer.write(pickle.dumps(read()))
