"""A rank that catches the SystemExit of a failed ``sys.exit`` (argparse's ``parser.error``)
and goes on: the job must end normally, not be aborted at exit."""

import argparse

import jax.numpy as jnp

import jaxddp

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
try:
    parser.parse_args([])  # no --steps: argparse calls sys.exit(2)
except SystemExit as e:
    print(f"caught SystemExit({e.code})", flush=True)
total = jaxddp.allreduce({"one": jnp.float32(1.0)}, op="sum")["one"]
print(f"went on: {float(total)}", flush=True)
