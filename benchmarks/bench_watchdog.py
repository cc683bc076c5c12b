"""What the stall inspector costs a step: the digits step and the three residual MLPs' NNX step,
with the inspector on (``JAXDDP_STALL_WARN=60``, the default) and off (``0``), interleaved.

    python benchmarks/bench_watchdog.py [--np 2] [--rounds 4] [--repeats 41] [--out FILE]

The inspector is decided at ``import jaxddp``, so on and off cannot alternate inside one
process: each round launches one job with it off and one with it on (``mpiexec -n NP``, with
a timeout), in alternating order. Each job measures the median of ``--repeats`` steps of each
case; the result is, per case, the median over rounds with it off and on and their ratio.
Each step draws its batch from ``DistributedSampler.batches()``, so the progress counting is
inside what is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
MODELS = ("4 blocks, width 256", "24 blocks, width 64", "100 blocks, width 32")


def worker(repeats: int, models: list[str]) -> dict[str, float]:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxddp
    from benchmarks.bench_nnx_step import D_IN, D_OUT, MODELS, ResidualMLP
    from benchmarks.bench_nnx_step import make_step as make_nnx_step
    from benchmarks.bench_step import MLP_SIZES, make_step, mlp_loss, mlp_params

    sampler = jaxddp.DistributedSampler(1 << 20, shuffle=False)
    batches = sampler.batches(64)
    rng = np.random.default_rng(0)

    def timed(run) -> float:
        for _ in range(5):
            next(batches)
            run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            next(batches)
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    out = {}
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3))
    params = mlp_params(jax.random.PRNGKey(0), MLP_SIZES)
    state = [params, tx.init(params)]
    batch = (rng.normal(size=(64, 64)).astype(np.float32), rng.integers(0, 10, 64))
    step = jax.jit(make_step(tx, mlp_loss))

    def digits() -> None:
        state[0], state[1], loss = step(state[0], state[1], batch)
        jax.block_until_ready(loss)

    out["digits MLP"] = timed(digits)
    x = rng.normal(size=(64, D_IN)).astype(np.float32)
    y = rng.integers(0, D_OUT, 64)
    for name, (blocks, width) in MODELS.items():
        if name not in models:
            continue
        model = ResidualMLP(blocks, width, nnx.Rngs(0))
        optimizer = nnx.Optimizer(
            model, optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3)), wrt=nnx.Param
        )
        nnx_step = make_nnx_step()
        out[f"nnx {name}"] = timed(
            lambda s=nnx_step, m=model, o=optimizer: jax.block_until_ready(s(m, o, x, y))
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--models", default=";".join(MODELS), help="';'-separated names")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker(args.repeats, args.models.split(";"))
        import jaxddp

        if jaxddp.rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    samples: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
    for r in range(args.rounds):
        for setting in ("0", "60") if r % 2 == 0 else ("60", "0"):
            env = dict(os.environ, JAXDDP_STALL_WARN=setting)
            command = [mpiexec, "-n", str(args.np), sys.executable, __file__, "--worker"]
            command += ["--repeats", str(args.repeats), "--models", args.models]
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=args.timeout, check=True
            )
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
            key = "off" if setting == "0" else "on"
            for case, seconds in json.loads(line[len("RESULT ") :]).items():
                samples[key].setdefault(case, []).append(seconds)
    table = {}
    for case in samples["off"]:
        off, on = statistics.median(samples["off"][case]), statistics.median(samples["on"][case])
        table[case] = {"off_ms": off * 1e3, "on_ms": on * 1e3, "on_over_off": on / off}
        print(f"{case:28s} off {off * 1e3:8.3f} ms   on {on * 1e3:8.3f} ms   ratio {on / off:.3f}")
    if args.out:
        args.out.write_text(json.dumps({"np": args.np, "rounds": args.rounds, **table}, indent=1))


if __name__ == "__main__":
    main()
