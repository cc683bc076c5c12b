"""Every ``JAXDDP_*`` environment variable, read with one rule and one error for a bad value.

A leaf package: it imports nothing else of jaxddp. Each setting is one :class:`Setting` record
in :data:`SETTINGS` (:mod:`.table`: its name, its kind, its default, what it does), read when it is needed, so
that a test or a program may change the environment between two uses. Booleans accept
``1``/``true``/``yes``/``on`` and ``0``/``false``/``no``/``off`` in any case; an empty
variable counts as unset. A value outside these raises :class:`SettingError`, which names the
variable, the value and what is accepted. ``docs/settings.md`` lists the same table.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from . import table
from .table import (
    ABORT_ON_ERROR,
    CHECK,
    CHECK_TIMEOUT,
    COLLECTIVES,
    CUDA_AWARE_MPI,
    GPUS,
    NATIVE_ALLREDUCE,
    SHARED_ALLREDUCE,
    SKIP_LAUNCHER_CHECK,
    STALL_ABORT,
    STALL_WARN,
    STARTUP_TIMEOUT,
    Setting,
    SkipLevel,
)
from .table import (
    SETTINGS as SETTINGS,
)

__all__ = [
    "AGREED",
    "SettingError",
    "abort_on_error",
    "check_timeout",
    "check_trees",
    "collectives",
    "cuda_aware_mpi",
    "gpus",
    "native_allreduce",
    "raw_value",
    "read_agreed",
    "shared_allreduce",
    "skip_launcher_check",
    "stall_abort",
    "stall_warn",
    "startup_timeout",
]
__all__ += table.__all__  # the records, re-exported

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingError(ValueError):
    """A ``JAXDDP_*`` environment variable holds a value jaxddp does not accept, or one that
    every rank must share (``JAXDDP_CHECK``, ``JAXDDP_NATIVE_ALLREDUCE``,
    ``JAXDDP_SHARED_ALLREDUCE``, ``JAXDDP_COLLECTIVES``) differs between the ranks. A
    ``ValueError``."""


def _raw(setting: Setting, env: Mapping[str, str] | None) -> str:
    """The variable's value, stripped; ``""`` when unset or empty."""
    return (os.environ if env is None else env).get(setting.name, "").strip()


def raw_value(setting: Setting, env: Mapping[str, str] | None = None) -> str:
    """The variable's value as set, stripped; ``""`` when unset or empty."""
    return _raw(setting, env)


def _bad(setting: Setting, value: str) -> SettingError:
    """The one error for a bad value: the variable, the value, what is accepted."""
    spelled = ""
    if "boolean" in setting.accepts:
        spelled = f"{'/'.join(_TRUE)} for on, {'/'.join(_FALSE)} for off, any case; "
    return SettingError(
        f"{setting.name}={value!r} is not a value jaxddp understands: expected "
        f"{setting.accepts} ({spelled}unset or empty for the default, {setting.default})."
    )


def _boolean(setting: Setting, value: str, default: bool) -> bool:
    lowered = value.lower()
    if lowered == "":
        return default
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise _bad(setting, value)


def skip_launcher_check(env: Mapping[str, str] | None = None) -> SkipLevel:
    """``JAXDDP_SKIP_LAUNCHER_CHECK``: a boolean (on skips the check before ``MPI_Init``),
    or ``all`` (skips the silent-singleton check too).

    Example:
      >>> skip_launcher_check({"JAXDDP_SKIP_LAUNCHER_CHECK": "Yes"})
      <SkipLevel.INIT: 'init'>
      >>> skip_launcher_check({"JAXDDP_SKIP_LAUNCHER_CHECK": "all"})
      <SkipLevel.ALL: 'all'>
      >>> skip_launcher_check({})
      <SkipLevel.NONE: 'check'>
    """
    value = _raw(SKIP_LAUNCHER_CHECK, env)
    if value.lower() == "all":
        return SkipLevel.ALL
    skip = _boolean(SKIP_LAUNCHER_CHECK, value, default=False)
    return SkipLevel.INIT if skip else SkipLevel.NONE


def check_trees(env: Mapping[str, str] | None = None) -> bool:
    """``JAXDDP_CHECK``: whether collectives check their signatures (and
    ``allreduce_gradients`` its trees) by default."""
    return _boolean(CHECK, _raw(CHECK, env), default=True)


def native_allreduce(env: Mapping[str, str] | None = None) -> bool:
    """``JAXDDP_NATIVE_ALLREDUCE``: whether jitted allreduces may use jaxddp's own handler."""
    return _boolean(NATIVE_ALLREDUCE, _raw(NATIVE_ALLREDUCE, env), default=True)


def shared_allreduce(env: Mapping[str, str] | None = None) -> bool:
    """``JAXDDP_SHARED_ALLREDUCE``: whether ranks on one node may reduce in shared memory."""
    return _boolean(SHARED_ALLREDUCE, _raw(SHARED_ALLREDUCE, env), default=True)


def cuda_aware_mpi(env: Mapping[str, str] | None = None) -> bool:
    """``JAXDDP_CUDA_AWARE_MPI``: whether GPU buffers may go to a CUDA-aware MPI directly."""
    return _boolean(CUDA_AWARE_MPI, _raw(CUDA_AWARE_MPI, env), default=True)


def gpus(env: Mapping[str, str] | None = None) -> bool:
    """``JAXDDP_GPUS``: whether jaxddp gives each rank its GPU (``auto``) or not (``off``).

    Example:
      >>> gpus({}), gpus({"JAXDDP_GPUS": "off"})
      (True, False)
    """
    value = _raw(GPUS, env).lower()
    if value in ("", "auto"):
        return True
    if value == "off":
        return False
    raise _bad(GPUS, value)


def collectives(env: Mapping[str, str] | None = None) -> str:
    """``JAXDDP_COLLECTIVES``: ``"mpi"`` or ``"xla"``.

    Example:
      >>> collectives({}), collectives({"JAXDDP_COLLECTIVES": "XLA"})
      ('mpi', 'xla')
    """
    value = _raw(COLLECTIVES, env).lower()
    if value in ("", "mpi", "xla"):
        return value or "mpi"
    raise _bad(COLLECTIVES, value)


def abort_on_error(env: Mapping[str, str] | None = None) -> bool:
    """``JAXDDP_ABORT_ON_ERROR``: whether an uncaught exception aborts every rank."""
    return _boolean(ABORT_ON_ERROR, _raw(ABORT_ON_ERROR, env), default=True)


def check_timeout(env: Mapping[str, str] | None = None) -> float:
    """``JAXDDP_CHECK_TIMEOUT``: seconds a consistency check waits for every rank.

    Example:
      >>> check_timeout({"JAXDDP_CHECK_TIMEOUT": "2.5"}), check_timeout({})
      (2.5, 60.0)
      >>> try:
      ...     check_timeout({"JAXDDP_CHECK_TIMEOUT": "soon"})
      ... except SettingError as e:
      ...     print(e)
      JAXDDP_CHECK_TIMEOUT='soon' is not a value jaxddp understands: expected a positive number of seconds (`inf` waits forever) (unset or empty for the default, 60).
    """
    value = _raw(CHECK_TIMEOUT, env)
    if value == "":
        return float(CHECK_TIMEOUT.default)
    try:
        seconds = float(value)
    except ValueError:
        raise _bad(CHECK_TIMEOUT, value) from None
    if math.isnan(seconds) or seconds <= 0:
        raise _bad(CHECK_TIMEOUT, value)
    return seconds


def _seconds(setting: Setting, value: str, *, zero: bool) -> float:
    """A number of seconds: positive (or also ``0`` when ``zero``), ``inf`` allowed."""
    try:
        seconds = float(value)
    except ValueError:
        raise _bad(setting, value) from None
    if math.isnan(seconds) or seconds < 0 or (seconds == 0 and not zero):
        raise _bad(setting, value)
    return seconds


def stall_warn(env: Mapping[str, str] | None = None) -> float:
    """``JAXDDP_STALL_WARN``: seconds without progress before a stall report; 0 is off.

    Example:
      >>> stall_warn({"JAXDDP_STALL_WARN": "5"}), stall_warn({}), stall_warn({"JAXDDP_STALL_WARN": "0"})
      (5.0, 60.0, 0.0)
    """
    value = _raw(STALL_WARN, env)
    return float(STALL_WARN.default) if value == "" else _seconds(STALL_WARN, value, zero=True)


def stall_abort(env: Mapping[str, str] | None = None) -> float | None:
    """``JAXDDP_STALL_ABORT``: seconds without progress before the job is aborted, or None.

    Example:
      >>> stall_abort({"JAXDDP_STALL_ABORT": "20"}), stall_abort({}), stall_abort({"JAXDDP_STALL_ABORT": "off"})
      (20.0, None, None)
    """
    value = _raw(STALL_ABORT, env)
    if value.lower() in ("", "off"):
        return None
    seconds = _seconds(STALL_ABORT, value, zero=True)
    return None if seconds == 0 or math.isinf(seconds) else seconds


def startup_timeout(env: Mapping[str, str] | None = None) -> float:
    """Seconds a rank waits in ``MPI_Init``: ``JAXDDP_STALL_ABORT`` when set, else
    ``JAXDDP_STARTUP_TIMEOUT``.

    Example:
      >>> startup_timeout({}), startup_timeout({"JAXDDP_STALL_ABORT": "20"})
      (300.0, 20.0)
    """
    abort = stall_abort(env)
    if abort is not None:
        return abort
    value = _raw(STARTUP_TIMEOUT, env)
    if value == "":
        return float(STARTUP_TIMEOUT.default)
    return _seconds(STARTUP_TIMEOUT, value, zero=False)


# The settings that change what a collective sends or checks: where two ranks differ, their
# collectives differ (a signature check on one rank only, a nonblocking allreduce against a
# blocking one, shared memory against MPI) and the job hangs or reduces garbage. jaxddp's
# world makes every rank agree on them when it starts (jaxddp._runtime.agreement).
AGREED = (CHECK, NATIVE_ALLREDUCE, SHARED_ALLREDUCE, COLLECTIVES)
_READERS = {
    CHECK.name: check_trees,
    NATIVE_ALLREDUCE.name: native_allreduce,
    SHARED_ALLREDUCE.name: shared_allreduce,
    COLLECTIVES.name: collectives,
}


def read_agreed(setting: Setting, value: str) -> bool | str:
    """What the raw ``value`` of one of :data:`AGREED` means (SettingError when nothing).

    Example:
      >>> read_agreed(CHECK, "off"), read_agreed(CHECK, "")
      (False, True)
    """
    return _READERS[setting.name]({setting.name: value})
