"""What seeding every request (`rollout.seed`, for reproducible η = 0 runs) costs, side by side.

The default recipe for `--steps` steps (evaluation off) against one shared vLLM server, unseeded and
seeded, alternating `--repeats` times so a machine that drifts affects both alike. Reports generated
and trained samples/s of each (median over repeats) and the ratio seeded / unseeded; writes
bench/results/seeded_sampling.json.

    python bench/seeded_sampling.py [--steps 40] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results_file import write_results  # noqa: E402

VARIANTS = {"unseeded": ["rollout.seed=null"], "seeded": ["rollout.seed=0"]}  # seeded is the default


def rates(run_dir: Path) -> dict[str, float]:
    """Generated and trained samples/s over the whole run, from its metrics."""
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = steps[-1]
    return {"generated_samples_per_s": last["buffer/finished_samples"] / last["perf/elapsed_s"],
            "trained_samples_per_s": last["perf/samples_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "seeded_sampling.json"))
    args = parser.parse_args()

    import ray

    from factory.training.base_policy import ensure_base_policy
    from factory.recipe import load_recipe
    from factory.run import run
    from factory.runtime.actors import EngineActor
    from factory.runtime.cluster import local_ray

    base = ["eval.before=false", "eval.after=false", "lake.enabled=false", "tracking.enabled=false",
            f"train.steps={args.steps}", f"train.checkpoint_every={args.steps}"]
    recipe = load_recipe(REPO / "recipes" / "default.yaml", base)
    policy = ensure_base_policy(recipe)
    measured: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with local_ray(), tempfile.TemporaryDirectory(prefix="bench-seeded-") as tmp:
        engine = EngineActor.remote("vllm", str(policy), recipe.rollout, str(Path(tmp) / "engine.log"))
        ray.get(engine.start.remote())
        run(load_recipe(REPO / "recipes" / "default.yaml", [*base, "train.steps=5"]), Path(tmp) / "warm",
            engines=[engine])  # vLLM's first batches after start-up are slow: no row pays for them
        for repeat in range(args.repeats):
            for name, extra in VARIANTS.items():
                out = Path(tmp) / f"{name}-{repeat}"
                run(load_recipe(REPO / "recipes" / "default.yaml", [*base, *extra]), out, engines=[engine])
                measured[name].append(rates(out))
                print(f"{name} #{repeat}: {measured[name][-1]}")
        ray.get(engine.stop.remote())

    rows = {name: {k: statistics.median(m[k] for m in runs) for k in runs[0]} for name, runs in measured.items()}
    ratio = rows["seeded"]["generated_samples_per_s"] / rows["unseeded"]["generated_samples_per_s"]
    print(f"\n{'variant':10} {'generated/s':>12} {'trained/s':>10}")
    for name, row in rows.items():
        print(f"{name:10} {row['generated_samples_per_s']:12.1f} {row['trained_samples_per_s']:10.1f}")
    print(f"seeded / unseeded generated samples/s: {ratio:.2f}")
    write_results(args.out, {"workload": {"recipe": "recipes/default.yaml", "steps": args.steps, "repeats": args.repeats},
                             "rows": rows, "runs": measured, "seeded_over_unseeded_generated": ratio})


if __name__ == "__main__":
    main()
