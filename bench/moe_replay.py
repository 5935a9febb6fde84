"""Rollout routing replay on the tiny mixture-of-experts recipe: the same seed trained twice, with
`algorithm.routing_replay: rollout` and `off`, one after the other on one engine (nothing else runs).

Per way, over the run's steps: the engine-vs-trainer logprob gap of the sampled tokens
(`train/logprob_abs_diff`: with replay, what the trainer trains on; `train/logprob_abs_diff_own_routing`:
what its own router would have given, measured on a quarter of each step's first micro-batch), the router's
agreement with the engine before replay (`train/router_agreement`), the experts' load, held-out
accuracy before and after, and the median step time.

Writes bench/results/moe_replay.json.

    python bench/moe_replay.py [--steps 30]
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

KEYS = ("train/logprob_abs_diff", "train/logprob_abs_diff_own_routing", "train/router_agreement",
        "train/expert_load", "train/expert_load_max")


def one_way(replay: str, steps: int, engine, out: Path) -> dict:
    from factory.recipe import load_recipe
    from factory.run import run

    recipe = load_recipe(REPO / "recipes" / "moe_tiny.yaml", [f"algorithm.routing_replay={replay}",
                                                               f"train.steps={steps}"])
    results = run(recipe, out, engines=[engine])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    means = {k: statistics.fmean(r[k] for r in rows if k in r) for k in KEYS if any(k in r for r in rows)}
    return {
        "replay": replay, "steps": steps, **{f"mean {k}": v for k, v in means.items()},
        "step_s_median": statistics.median(r["perf/trainer_step_s"] for r in rows),
        "heldout_before": results["before"]["mean"], "heldout_after": results["after"]["mean"],
        "heldout_delta": results["delta"], "heldout_delta_stderr": results["delta_stderr"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import ray

    from factory.recipe import load_recipe
    from factory.runtime.actors import EngineActor
    from factory.runtime.cluster import local_ray
    from factory.runtime.transfer import DirBundle
    from factory.training.base_policy import ensure_base_policy

    recipe = load_recipe(REPO / "recipes" / "moe_tiny.yaml")
    policy = ensure_base_policy(recipe)
    rows: list[dict] = []
    with local_ray(), tempfile.TemporaryDirectory() as tmp:
        engine = EngineActor.remote(recipe.rollout.engine, ray.put(DirBundle.of(policy, "policy")), recipe.rollout,
                                    str(Path(tmp) / "engine.log"))
        ray.get(engine.start.remote())
        try:
            for replay in ("rollout", "off"):
                rows.append(one_way(replay, args.steps, engine, Path(tmp) / replay))
                print(json.dumps(rows[-1], indent=1), flush=True)
                write_results(REPO / "bench" / "results" / "moe_replay.json",
                              {"recipe": "recipes/moe_tiny.yaml", "runs": rows})
        finally:
            ray.get(engine.stop.remote())
    return 0


if __name__ == "__main__":
    sys.exit(main())
