"""Factory against TRL's GRPOTrainer on the same CPU, task, policy and settings.

Both start from the default recipe's base policy directory (the SFT'd tiny Llama), train on the
default recipe's basic_arithmetic tasks with G = 8 completions for each of 8 prompts per step, lr
5e-5 (constant), PPO-clip ε = 0.2 / ε_high = 0.28, token-mean loss, no KL, grad clip 1.0,
temperature 1.0, and the same chat-templated prompts and reward (reasoning-gym's verifier on the
decoded completion). They differ where the systems do: Factory runs one-step off-policy (η = 1)
with its rollout engine (vLLM) and drops zero-variance groups; TRL generates with
`model.generate` in its own process, on-policy, and keeps every group.

Threads: Factory's trainer and its vLLM engine take one thread each (the default recipe; the env
worker, buffer and driver share the cores); TRL's single process takes both cores
(`torch.set_num_threads(2)`). Nothing else runs.

Both save their policy every `--eval-every` steps; after both have trained, every saved policy is
scored on one seeded held-out sample of `--heldout` tasks by the same vLLM engine and sampler
(temperature 1.0, `--samples` seeded completions per task, the same seeds for every policy: mean@k
over the tasks, its standard error over the tasks' means), so the accuracies are comparable to each
other. The
time spent saving is left out of both systems' clocks (Factory's checkpoint holds the optimizer and
sampler state and commits the lake; TRL saves the model only): the saves are the bench's, for scoring.

Reported per variant: completions generated/s, median step, held-out accuracy (± standard error)
at equal steps, and the time to reach the starting accuracy + 0.05 (first saved step that does).
Variants:
- `short`: the default (at most 8 new tokens).
- `early`: the short variant's first `--early-steps` steps, saved and scored after every step: both
  systems pass start + 0.05 within the short variant's first `--eval-every` steps, so its time to
  target only says which step came first on a coarse grid; this one resolves it to the step. It runs
  once per training seed (`--seeds`: train.seed and rollout.seed for Factory, TRL's seed), since the
  step at which one run crosses the target is one draw; the summary gives each system's mean time to
  target over the seeds and their ratio.
- `long`: generation-dominated: exactly 64 new tokens per completion (end-of-turn suppressed before
  64 in both: `min_new_tokens` / `min_new_tokens` in TRL's generation kwargs), so both do the same
  work per completion; it runs `--long-steps` steps and reports throughput (its accuracy is
  reported but means little: the answer is buried in forced tokens).

Ratios (Factory / TRL) go to bench/results/vs_trl.json, accuracy by step to a plot beside it
(vs_trl.png; `--plot-only` redraws it from the JSON). Needs the `bench` extra (`pip install
-e '.[bench]'`: trl).

    python bench/vs_trl.py [--steps 400] [--eval-every 25] [--heldout 1000] [--samples 4] [--long-steps 30]
                           [--early-steps 10] [--seeds 3] [--variants short early long] [--out FILE]
                           [--factory-override KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results_file import write_results  # noqa: E402

GOALS = {"short_completions_per_s": 1.3, "early_time_to_target": 1.5, "long_completions_per_s": 3.0}
TARGET_GAIN = 0.05


def recipe_for(steps: int, max_new_tokens: int, eval_every: int, extra: list[str] | None = None, seed: int = 0):
    """The default recipe with the bench's settings; `seed` is the training seed (the order of tasks,
    the sampler's seeds): the scoring always uses seed 0's recipe, so every policy meets the same seeds."""
    from factory.recipe import load_recipe

    overrides = [*(extra or []), f"train.seed={seed}", f"rollout.seed={seed}", f"train.steps={steps}",
                 f"train.checkpoint_every={eval_every}", "eval.before=false", "eval.after=false",
                 "name=bench-vs-trl", f"rollout.max_new_tokens={max_new_tokens}"]
    if max_new_tokens > 8:
        overrides.append(f"rollout.min_new_tokens={max_new_tokens}")
    return load_recipe(REPO / "recipes" / "default.yaml", overrides)


def train_factory(recipe, out: Path) -> dict:
    """The default recipe through Factory's own loop; returns the step times and {step: checkpoint dir}."""
    import factory.run
    from factory.run import run

    times: dict[int, float] = {}
    generated: dict[int, float] = {}
    t0 = [0.0]
    saving = [0.0]  # seconds spent saving checkpoints so far: the bench's saves, not training
    save = factory.run._checkpoint

    def timed_save(*args, **kwargs):
        t = time.perf_counter()
        try:
            return save(*args, **kwargs)
        finally:
            saving[0] += time.perf_counter() - t

    def on_step(report) -> None:
        if report.step == 1:
            t0[0] = time.perf_counter() - report.metrics["perf/elapsed_s"]
        times[report.step] = time.perf_counter() - t0[0] - saving[0]
        generated[report.step] = report.metrics["buffer/finished_samples"]

    factory.run._checkpoint = timed_save
    try:
        run(recipe, out, on_step=on_step)
    finally:
        factory.run._checkpoint = save
    checkpoints = {int(p.name.split("-")[1]): p for p in sorted((out / "checkpoints").glob("step-*"))}
    return {"elapsed": times, "generated": generated, "checkpoints": checkpoints}


def train_trl(recipe, policy: Path, out: Path, threads: int) -> dict:
    """The same settings through TRL's GRPOTrainer; returns the step times and {step: saved model dir}."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from factory.data.tasks import ReasoningGymSource
    from factory.model.tokens import render_chat
    from factory.rewards.verifiers import reasoning_gym_reward

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    tasks = ReasoningGymSource.from_recipe(recipe.data).train
    by_prompt = {}
    rows = []
    for task in tasks:
        text = render_chat(tokenizer, [{"role": "user", "content": task.question}])
        by_prompt[text] = task
        rows.append({"prompt": text})

    def reward(prompts, completions, **_):
        return [reasoning_gym_reward(c, by_prompt[p]) for p, c in zip(prompts, completions)]

    times: dict[int, float] = {}

    class Clock(TrainerCallback):
        """Step times from the start of training, less the time spent saving (on_save follows a save)."""

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()
            self.saving = 0.0

        def on_step_end(self, args, state, control, **kw):
            self.end = time.perf_counter()
            times[state.global_step] = self.end - self.t0 - self.saving

        def on_save(self, args, state, control, **kw):
            self.saving += time.perf_counter() - self.end

    r = recipe.rollout
    generation_kwargs = {"min_new_tokens": r.min_new_tokens} if r.min_new_tokens else None
    config = GRPOConfig(
        output_dir=str(out), max_steps=recipe.train.steps, per_device_train_batch_size=recipe.train.groups_per_step
        * r.group_size, num_generations=r.group_size, max_completion_length=r.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, learning_rate=recipe.train.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=recipe.train.weight_decay, adam_beta1=recipe.train.betas[0],
        adam_beta2=recipe.train.betas[1], max_grad_norm=recipe.train.grad_clip, beta=0.0,
        epsilon=recipe.algorithm.clip_low, epsilon_high=recipe.algorithm.clip_high, loss_type="dapo",
        num_iterations=1, use_cpu=True, bf16=False, report_to=[], logging_steps=50, disable_tqdm=True,
        save_strategy="steps", save_steps=recipe.train.checkpoint_every, save_only_model=True,
        seed=recipe.train.seed, generation_kwargs=generation_kwargs, log_completions=False)
    trainer = GRPOTrainer(model=str(policy), reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    checkpoints = {int(p.name.split("-")[1]): p for p in out.glob("checkpoint-*")}
    for p in checkpoints.values():  # the evaluation engine reads the tokenizer from the model dir
        tokenizer.save_pretrained(p)
    return {"elapsed": times, "checkpoints": checkpoints}


def evaluate_all(recipe, policy: Path, named: dict[str, dict[int, Path]], n: int,
                 samples: int) -> dict[str, dict[int, dict]]:
    """Held-out accuracy (mean@`samples`) of every saved policy on one seeded sample, by one shared
    vLLM engine."""
    import ray

    from factory.runtime.actors import EngineActor
    from factory.runtime.cluster import local_ray
    from factory.runtime.evaluation import evaluate_checkpoint
    from factory.runtime.transfer import DirBundle

    out: dict[str, dict[int, dict]] = {}
    with local_ray(), tempfile.TemporaryDirectory() as tmp:
        engine = EngineActor.remote(recipe.rollout.engine, ray.put(DirBundle.of(policy, "policy")), recipe.rollout,
                                    str(Path(tmp) / "engine.log"))
        ray.get(engine.start.remote())
        try:
            for name, checkpoints in named.items():
                out[name] = {}
                for step, path in sorted(checkpoints.items()):
                    r = evaluate_checkpoint(recipe, path, n=n, engines=[engine], samples=samples)
                    out[name][step] = {"mean": r["mean"], "stderr": r["stderr"]}
                    print(f"  {name} step {step}: {r['mean']:.3f} ± {r['stderr']:.3f}", flush=True)
        finally:
            ray.get(engine.stop.remote())
    return out


def summarize(name: str, trained: dict, accuracy: dict[int, dict], start: float, completions_per_step: float | None,
              generated: dict[int, float] | None) -> dict:
    elapsed = trained["elapsed"]
    steps = sorted(elapsed)
    durations = [elapsed[s] - elapsed[s - 1] for s in steps[1:] if s - 1 in elapsed]
    wall = elapsed[steps[-1]]
    made = generated[steps[-1]] if generated else completions_per_step * len(steps)
    reached = [s for s in sorted(accuracy) if accuracy[s]["mean"] >= start + TARGET_GAIN]
    return {"system": name, "steps": len(steps), "training_wall_s": wall, "median_step_s": statistics.median(durations),
            "completions_generated": made, "completions_generated_per_s": made / wall,
            "heldout": {str(s): a for s, a in sorted(accuracy.items())},
            "elapsed_s": {str(s): elapsed[s] for s in sorted(accuracy) if s in elapsed},  # training time at each save
            "target": start + TARGET_GAIN, "target_step": reached[0] if reached else None,
            "time_to_target_s": elapsed[reached[0]] if reached else None}


def variant(name: str, steps: int, max_new_tokens: int, args, policy: Path, start: dict, eval_every: int,
            seed: int = 0) -> dict:
    print(f"\n== {name}: {steps} steps, {max_new_tokens} new tokens at most, saved every {eval_every}, "
          f"training seed {seed}", flush=True)
    recipe = recipe_for(steps, max_new_tokens, eval_every, args.factory_override, seed)
    scoring = recipe_for(steps, max_new_tokens, eval_every, args.factory_override)
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as tmp:
        tmp = Path(tmp)
        print("Factory ...", flush=True)
        factory = train_factory(recipe, tmp / "factory")
        print("TRL ...", flush=True)
        trl = train_trl(recipe, policy, tmp / "trl", args.trl_threads)
        print("evaluating ...", flush=True)
        acc = evaluate_all(scoring, policy, {"factory": factory["checkpoints"], "trl": trl["checkpoints"]}, args.heldout,
                           args.samples)
    per_step = recipe.train.groups_per_step * recipe.rollout.group_size
    rows = {"factory": summarize("factory", factory, acc["factory"], start["mean"], None, factory["generated"]),
            "trl": summarize("trl", trl, acc["trl"], start["mean"], per_step, None)}
    f, t = rows["factory"], rows["trl"]
    ratios = {"completions_per_s": f["completions_generated_per_s"] / t["completions_generated_per_s"],
              "median_step_trl_over_factory": t["median_step_s"] / f["median_step_s"]}
    if f["time_to_target_s"] and t["time_to_target_s"]:
        ratios["time_to_target_trl_over_factory"] = t["time_to_target_s"] / f["time_to_target_s"]
    print(f"\n{name}: {'':8}{'compl/s':>9}{'step s':>8}{'to target s':>13}  held-out by step")
    for r in rows.values():
        acc_text = "  ".join(f"{s}:{a['mean']:.3f}±{a['stderr']:.3f}" for s, a in r["heldout"].items()
                             if steps <= 20 or int(s) % 100 == 0 or int(s) == r["steps"])
        ttt = f"{r['time_to_target_s']:.0f}" if r["time_to_target_s"] else "never"
        print(f"  {r['system']:<14}{r['completions_generated_per_s']:9.1f}{r['median_step_s']:8.3f}{ttt:>13}  {acc_text}")
    print(f"  ratios: {ratios}")
    return {"settings": {"steps": steps, "max_new_tokens": max_new_tokens, "prompts_per_step": recipe.train.groups_per_step,
                         "group_size": recipe.rollout.group_size, "lr": recipe.train.lr, "seed": seed}, "rows": rows,
            "ratios": ratios}


def over_seeds(runs: list[dict]) -> dict:
    """The early variant's runs (one per training seed) in one result: the first run's rows (for the
    plot), each seed's times to target, each system's mean time over the seeds (a seed that never
    reached the target is counted, not averaged), the ratio of the means and the mean accuracy by step."""
    by_seed = []
    for r in runs:
        f, t = r["rows"]["factory"], r["rows"]["trl"]
        by_seed.append({"seed": r["settings"]["seed"], "factory_s": f["time_to_target_s"], "trl_s": t["time_to_target_s"],
                        "factory_step": f["target_step"], "trl_step": t["target_step"],
                        "trl_over_factory": r["ratios"].get("time_to_target_trl_over_factory")})
    summary: dict = {"seeds": len(runs)}
    for system in ("factory", "trl"):
        times = [s[f"{system}_s"] for s in by_seed if s[f"{system}_s"] is not None]
        summary[system] = {"reached": len(times), "mean_time_to_target_s": statistics.fmean(times) if times else None,
                           "stderr_s": statistics.stdev(times) / len(times) ** 0.5 if len(times) > 1 else None,
                           "mean_target_step": statistics.fmean(s[f"{system}_step"] for s in by_seed
                                                                if s[f"{system}_step"] is not None) if times else None,
                           "completions_per_s": statistics.fmean(r["rows"][system]["completions_generated_per_s"]
                                                                 for r in runs),
                           "median_step_s": statistics.fmean(r["rows"][system]["median_step_s"] for r in runs)}
        steps = sorted({int(k) for r in runs for k in r["rows"][system]["heldout"]})
        summary[system]["mean_heldout_by_step"] = {
            str(k): statistics.fmean(r["rows"][system]["heldout"][str(k)]["mean"] for r in runs) for k in steps}
    f, t = summary["factory"]["mean_time_to_target_s"], summary["trl"]["mean_time_to_target_s"]
    if f and t:
        summary["time_to_target_trl_over_factory"] = t / f
    print(f"\nearly over {len(runs)} seeds: " + "; ".join(
        f"{s}: to target {summary[s]['mean_time_to_target_s'] or float('nan'):.2f} s (step "
        f"{summary[s]['mean_target_step'] or float('nan'):.1f}, {summary[s]['reached']}/{len(runs)} reached)"
        for s in ("factory", "trl")) + f"; TRL/Factory {summary.get('time_to_target_trl_over_factory', float('nan')):.2f}")
    return {**runs[0], "by_seed": by_seed, "summary": summary, "runs": runs[1:]}


def plot(results: dict, path: Path) -> None:
    """Held-out accuracy (± 1 SE) by step of both systems, with the target: the short variant, and
    beside it the early variant's first steps (scored after every step) when it ran."""
    from matplotlib.figure import Figure

    panels = [v for v in ("short", "early") if v in results]
    fig = Figure(figsize=(7 * len(panels), 4))
    for ax, name in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        rows = results[name]["rows"]
        runs = [results[name], *results[name].get("runs", [])]
        for color, (system, row) in zip(("C0", "C1"), rows.items()):
            if len(runs) > 1:  # one faint line per training seed, their mean bold
                for run in runs:
                    acc = run["rows"][system]["heldout"]
                    ax.plot([0] + [int(s) for s in acc], [results["start"]["mean"]] + [a["mean"] for a in acc.values()],
                            color=color, alpha=0.25, lw=1)
                mean = results[name]["summary"][system]["mean_heldout_by_step"]
                ax.plot([0] + [int(s) for s in mean], [results["start"]["mean"], *mean.values()], color=color,
                        marker="o", ms=3, lw=2, label=f"{system} (mean of {len(runs)} seeds)")
                continue
            steps = [0] + [int(s) for s in row["heldout"]]
            acc = [results["start"]] + list(row["heldout"].values())
            ax.errorbar(steps, [a["mean"] for a in acc], yerr=[a["stderr"] for a in acc], label=system, capsize=2,
                        marker="o", ms=3, color=color)
        ax.axhline(next(iter(rows.values()))["target"], color="k", ls="--", lw=1, label="start + 0.05")
        ax.set_xlabel("step")
        ax.set_ylabel(f"held-out accuracy (n = {results.get('heldout_n', '?')})")
        ax.set_title(f"{name}: Factory vs TRL GRPOTrainer, same policy, tasks, settings")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--heldout", type=int, default=1000, help="held-out tasks scored (the split has 1,000)")
    ap.add_argument("--samples", type=int, default=4, help="seeded completions per held-out task (mean@k)")
    ap.add_argument("--seeds", type=int, default=3, help="training seeds the early variant runs with")
    ap.add_argument("--long-steps", type=int, default=30)
    ap.add_argument("--trl-threads", type=int, default=2)
    ap.add_argument("--early-steps", type=int, default=10)
    ap.add_argument("--variants", nargs="+", default=["short", "early", "long"], choices=["short", "early", "long"])
    ap.add_argument("--factory-override", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override for Factory's side (repeatable), e.g. "
                         "algorithm.filter_zero_variance=false to train every group as TRL does")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "vs_trl.json"))
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from --out's results and stop")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return 0
    try:
        import trl
    except ImportError:
        ap.error("TRL is not installed: pip install -e '.[bench]'")

    from factory.training.base_policy import ensure_base_policy

    base = recipe_for(args.steps, 8, args.eval_every)
    policy = ensure_base_policy(base)
    print(f"base policy {policy}; held-out sample of {args.heldout}", flush=True)
    start = evaluate_all(base, policy, {"start": {0: policy}}, args.heldout, args.samples)["start"][0]
    results: dict = {"start": start, "trl_version": trl.__version__, "threads": {
        "factory": {"trainer": base.train.threads, "engine": base.rollout.cpus}, "trl": args.trl_threads}}
    if "short" in args.variants:
        results["short"] = variant("short", args.steps, 8, args, policy, start, args.eval_every)
    if "early" in args.variants:
        results["early"] = over_seeds([variant("early", args.early_steps, 8, args, policy, start, 1, seed)
                                       for seed in range(args.seeds)])
    if "long" in args.variants:
        results["long"] = variant("long", args.long_steps, 64, args, policy, start, args.eval_every)
    results["goals"] = GOALS
    results["heldout_n"] = args.heldout
    results["samples_per_task"] = args.samples
    results["factory_overrides"] = args.factory_override
    write_results(args.out, results)
    if "short" in results or "early" in results:
        plot(results, Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
