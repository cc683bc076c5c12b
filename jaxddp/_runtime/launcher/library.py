"""The MPI library mpi4py loaded, from the text of ``MPI_Get_library_version`` alone."""

from __future__ import annotations

import dataclasses
import enum
import re

__all__ = ["PMI12", "PMIX", "Family", "Library", "parse_library"]

PMI12 = "PMI-1/2"
PMIX = "PMIx"


class Family(enum.Enum):
    """Which process-management interface a library's lineage speaks."""

    MPICH = "mpich"  # MPICH and its derivatives (Intel MPI, MVAPICH, Cray MPICH): PMI-1/2
    OPENMPI = "openmpi"  # Open MPI and its derivatives: PMIx only
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class Library:
    """An MPI library: its vendor, family, version and whether it speaks PMIx."""

    vendor: str
    family: Family
    version: str
    pmix: bool  # speaks PMIx (Open MPI always; an MPICH only when built with it)
    head: str = ""  # the first line of the version string

    @property
    def major(self) -> int | None:
        match = re.match(r"(\d+)", self.version)
        return int(match.group(1)) if match else None

    @property
    def speaks(self) -> str:
        """The interface it speaks, as reports print it."""
        if self.family is Family.OPENMPI:
            return PMIX
        if self.family is Family.MPICH:
            return f"{PMI12} and {PMIX}" if self.pmix else PMI12
        return "unknown"

    @property
    def name(self) -> str:
        """Vendor and version, e.g. ``"MPICH 5.0.2"``."""
        return f"{self.vendor} {self.version}".strip()


UNKNOWN_LIBRARY = Library("unknown", Family.UNKNOWN, "", False)

# (pattern whose group 1 is the version, vendor, family), most specific first.
_PATTERNS = (
    (r"CRAY MPICH version (\S+)", "Cray MPICH", Family.MPICH),
    (r"MVAPICH2? Version\s*:\s*(\S+)", "MVAPICH", Family.MPICH),
    (r"MPICH Version\s*:\s*(\S+)", "MPICH", Family.MPICH),
    (r"Intel\(R\) MPI Library (\S+)", "Intel MPI", Family.MPICH),
    (r"Spectrum MPI\D*(\d\S*)", "IBM Spectrum MPI", Family.OPENMPI),
    (r"Open MPI v(\d[^,\s]*)", "Open MPI", Family.OPENMPI),
)


def parse_library(text: str) -> Library:
    """Vendor, family, version and PMIx support, from ``MPI_Get_library_version``'s text.

    Example:
      >>> parse_library("MPICH Version:      5.0.2\\nMPICH Device: ch4:ofi\\n").name
      'MPICH 5.0.2'
    """
    text = text.replace("\x00", "").strip()
    first = text.splitlines()[0] if text else ""
    pmix = "pmix" in text.lower()
    for pattern, vendor, family in _PATTERNS:
        match = re.search(pattern, text, re.IGNORECASE)
        if match:
            version = match.group(1).rstrip(",")
            return Library(vendor, family, version, pmix or family is Family.OPENMPI, first)
    return Library("unknown", Family.UNKNOWN, "", pmix, first[:80])
