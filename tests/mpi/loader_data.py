"""The data of tests/mpi/test_loaders.py, in a module that data-loading workers can import.

grain's and PyTorch's spawned workers import the module of whatever they unpickle (a data
set, a map function). A test module calls collectives at its top (``jaxddp.rank()``, a
communicator split), which a worker cannot: so what the workers need lives here.
"""

import numpy as np

N, FEATURES = 203, 5
_data = np.random.default_rng(5)
X = _data.normal(size=(N, FEATURES)).astype(np.float32)
Y = ((X[:, 0] > 0).astype(np.int32) + (X[:, 1] > 0.5)).astype(np.int32)


def record(i):
    """One sample as a grain pipeline maps it from its index."""
    return {"x": X[i], "y": Y[i]}


class TorchSamples:
    """A map-style data set as a torch user writes it: one sample per index. (Not a
    subclass of torch's Dataset, which needs nothing of it: so that grain's workers, which
    import this module, do not import torch, seconds of CPU each.)"""

    def __len__(self):
        return N

    def __getitem__(self, i):
        import torch

        return torch.from_numpy(X[i]), int(Y[i])


def worker_view():
    """What a spawned worker sees of jaxddp: whether it knows it is one, and the error
    that jaxddp.rank() raises there."""
    import jaxddp

    try:
        jaxddp.rank()
    except RuntimeError as error:
        return jaxddp._runtime.world.in_loader_worker(), str(error)
    return jaxddp._runtime.world.in_loader_worker(), ""
