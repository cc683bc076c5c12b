"""The settings every rank must share, agreed when jaxddp's world starts.

``JAXDDP_CHECK``, ``JAXDDP_NATIVE_ALLREDUCE``, ``JAXDDP_SHARED_ALLREDUCE`` and
``JAXDDP_COLLECTIVES``
(:data:`jaxddp._base.settings.AGREED`) change what a collective sends or checks: a rank
that checks signatures while another does not, or reduces in shared memory while another
goes through MPI, waits for a message that never comes, with nothing in the stall report
about why. So before any collective, every rank gathers every rank's raw values and, where
they differ (or one rank's cannot be read), every rank raises the same
:class:`~jaxddp._base.settings.SettingError`, naming the setting and each rank's value.
"""

from __future__ import annotations

from typing import Any

from .._base import settings as _settings

__all__ = ["agree_settings"]

_UNKNOWN = "not a value jaxddp understands"


def _meaning(setting: _settings.Setting, value: str) -> str:
    try:
        meaning = _settings.read_agreed(setting, value)
    except _settings.SettingError:
        return _UNKNOWN
    return meaning if isinstance(meaning, str) else "on" if meaning else "off"


def agree_settings(comm: Any) -> None:
    """Collective over ``comm`` (every rank of the world): raises SettingError on every
    rank where the ranks' values of a setting of :data:`~jaxddp._base.settings.AGREED`
    differ in meaning, or where some rank's value is not one jaxddp understands."""
    mine = [_settings.raw_value(s) for s in _settings.AGREED]
    everyone = comm.allgather(mine)
    for i, setting in enumerate(_settings.AGREED):
        values = [row[i] for row in everyone]
        meanings = [_meaning(setting, v) for v in values]
        if len(set(meanings)) == 1 and meanings[0] != _UNKNOWN:
            continue
        per_rank = ", ".join(
            f"rank {r} has {f'{v!r}' if v else 'it unset'} ({m})"
            for r, (v, m) in enumerate(zip(values, meanings, strict=True))
        )
        msg = (
            f"{setting.name} differs across the ranks: {per_rank}. It changes what every "
            "collective sends or checks, so ranks that differ would wait for each other "
            "forever; set it to the same value on every rank (`mpiexec -genv "
            f"{setting.name} <value>` with MPICH, `-x {setting.name}=<value>` with Open MPI), "
            f"or on none. Accepted: {setting.accepts}."
        )
        raise _settings.SettingError(msg)
