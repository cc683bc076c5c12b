"""A directory made unwritable for a test on real ranks, and writable again."""

import os
import subprocess
import tempfile

from mpi4py import MPI


def make_unwritable(path, unwritable, comm=MPI.COMM_WORLD):
    """On rank 0: makes ``path`` unwritable (``chattr +i``: root ignores permissions) or
    writable again; returns, on every rank, whether a folder can be made there."""
    writable = None
    if comm.Get_rank() == 0:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "+i" if unwritable else "-i", path], check=False)
        try:
            os.chmod(path, 0o555 if unwritable else 0o755)
            os.rmdir(tempfile.mkdtemp(dir=path))
            writable = True
        except OSError:
            writable = False
    return comm.bcast(writable)
