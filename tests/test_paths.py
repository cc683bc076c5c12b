"""Which package a source file belongs to goes by where the package is, not by folder names:
a user's project (or a clone of this repository) in a folder called ``jaxddp`` or ``jax`` is
the user's code in stall reports and in the sharded optimizer's refusals."""

import jax
import optax

import jaxddp
from jaxddp._base.paths import package_of
from jaxddp._runtime.watchdog import stacks

NAMES = ("jax", "jaxlib", "jaxddp")


def test_files_of_the_packages_belong_to_them():
    assert package_of(jaxddp.__file__, NAMES) == "jaxddp"
    assert package_of(jax.numpy.__file__, NAMES) == "jax"
    assert package_of(optax.__file__, NAMES) is None


def test_a_users_folder_named_like_a_package_is_the_users(tmp_path):
    for folder in ("jaxddp", "jax"):
        script = tmp_path / folder / "tests" / "train.py"
        script.parent.mkdir(parents=True)
        script.write_text("print('hi')\n")
        assert package_of(str(script), NAMES) is None
        assert stacks._library(str(script)) is None  # shown, not folded
