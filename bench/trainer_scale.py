"""Trainer scale: peak memory and seconds per step of the trainer's step against an older commit's step
and a plain reference step, side by side in one run (each variant in a process of its own, so peak
memory is that variant's alone).

CPU (the default; what runs here): a model with vocabulary 151,936 and a small body (the logits, not
the body, are what a large vocabulary makes expensive).
  1. 8 samples x 512 tokens: the old step (the trainer at OLD_COMMIT, from a git worktree), the new
     step, and the plain reference, three steps each.
  2. The new step alone at 16 x 1,024 (the old one would not fit in 24 GiB).
  3. 1 rank against 2 FSDP2 ranks (gloo) on the same batch.
  4. A heavy-tailed mix of lengths: the new step with one packed row per micro-batch (train.packing:
     true), with rows as wide as the longest sample (`auto` on sdpa) and with micro-batches grouped by
     length, against the plain reference on the padded batch; then 64 short samples (the default
     recipe's shape) packed, in rows and grouped (`--heavy-tailed`: this part alone, written into the
     results file's `heavy_tailed` key).

GPU (`--gpu`): the Qwen2.5-0.5B and -1.5B shapes (random init) at 16 to 64 samples of 1,024 tokens,
the new step (bf16, activation checkpointing), the step on its defaults (`auto`: packing, chunk and
checkpointing chosen from the measured memory, compiled blocks) and the plain reference, eager and with
compiled decoder blocks: tokens/s, MFU (against 790 TFLOP/s, a measured bf16 matrix rate of an H200)
and peak memory. The `auto` and compiled variants have not run yet (no GPU since they were added). It needs only torch,
transformers and the project's pure-Python dependencies (no Ray, no vLLM). Its figures come from one H200
(bench/results/trainer_scale_gpu*.json).

The plain reference: fp32 master weights (bf16 autocast on GPU), the body once, logprobs of the
completion positions computed two rows at a time over full-vocabulary log-softmax (kept for the
backward pass), activation checkpointing on GPU, AdamW (fused on GPU).

    python bench/trainer_scale.py                 # CPU, ~10 min on 2 cores
    python bench/trainer_scale.py --gpu           # one GPU, ~4 min on an H200
    python bench/trainer_scale.py --gpu --knobs   # the trainer's knobs against the plain step, ~3.5 min
    python bench/trainer_scale.py [--gpu] --warm-up  # the first step with and without train.warm_up
On a GPU machine with only torch and transformers: `pip install pydantic httpx` (factory.recipe needs
them), `PYTHONPATH=<this repository>`; `--budget-s S` begins no run after S seconds and each finished
run is written at once, so a short lease keeps what it measured.
Results: bench/results/trainer_scale.json (or trainer_scale_gpu.json), a plot beside each.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OLD_COMMIT = "088012d"  # the trainer before the lean step (chunked logprobs, micro-batches)
VOCAB = 151_936
CPU_BODY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                intermediate_size=256)
GPU_SHAPES = {  # Qwen2.5 shapes (Llama-style blocks, tied embeddings as Qwen2.5-0.5B/1.5B)
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, tie_word_embeddings=True),
}
# in order of what a short GPU lease must answer first: the 0.5B shape, then the 1.5B shapes
GPU_RUNS = [("0.5B", 16), ("1.5B", 16), ("1.5B", 64), ("0.5B", 64), ("0.5B", 32)]
PEAK_TFLOPS = 790.0


def build_model(out: Path, body: dict, max_position: int = 2048, device: str = "cpu") -> Path:
    """A random-init Llama with the given body and vocabulary 151,936, plus a small tokenizer (the
    trainer reads only its pad id). On a GPU it is initialised there and saved in bf16 (a 1.5B model's
    fp32 init and save on the CPU would take a minute of a short lease)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from factory.model.tiny import build_tokenizer

    tok = build_tokenizer(["12+34=46", "7+8=15", "the answer is 9"] * 4, 270, out)
    cfg = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=max_position, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **body)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    if device != "cpu":
        model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    return out


def batch_spec(n: int, prompt: int, completion: int | list[int], seed: int = 0) -> dict:
    return {"n": n, "prompt": prompt, "completion": completion, "seed": seed}


def _rooms() -> bool:
    """Whether the importable `factory` has its rooms (OLD_COMMIT's tree keeps every module at its root)."""
    import factory

    return (Path(factory.__file__).parent / "core").is_dir()


def make_batch(spec: dict):
    import torch

    if _rooms():
        from factory.core.types import Batch, Group, Sample, Task
    else:
        from factory.types import Batch, Group, Sample, Task

    g = torch.Generator().manual_seed(spec["seed"])
    comps = spec["completion"] if isinstance(spec["completion"], list) else [spec["completion"]] * spec["n"]
    samples = []
    for i, t in enumerate(comps):
        prompt = torch.randint(5, VOCAB, (spec["prompt"],), generator=g).tolist()
        samples.append(Sample(f"s{i}", f"g{i // 4}", "t", prompt_ids=prompt,
                              completion_ids=torch.randint(5, VOCAB, (t,), generator=g).tolist(),
                              logprobs=(-torch.rand(t, generator=g) * 5).tolist(), loss_mask=[1] * t, versions=[0] * t,
                              reward=float(i % 2)))
    groups = [Group(f"g{j}", Task("t", "f", "q", "a"), samples[j: j + 4]) for j in range(0, len(samples), 4)]
    return Batch(0, groups)


def heavy_tailed(n: int, seed: int = 0) -> list[int]:
    """Completion lengths as agentic rollouts make them: most short (16-96 tokens), one in five long
    (500-1,000)."""
    import random

    rng = random.Random(seed)
    return [rng.randint(500, 1000) if rng.random() < 0.2 else rng.randint(16, 96) for _ in range(n)]


# ---------------------------------------------------------------- variants (each in its own process)

def _recipe(overrides: list[str]):
    from factory.recipe import recipe_from_dict

    return recipe_from_dict({}, overrides=["rollout.max_new_tokens=1024", "rollout.max_model_len=2048", "model.max_position=2048",
                                           "train.lr=1e-5", *overrides])


def variant_trainer(model: str, spec: dict, steps: int, overrides: list[str], rank: int = 0, world: int = 1) -> dict:
    """The Trainer of whatever `factory` is importable (this tree's, or OLD_COMMIT's worktree)."""
    import inspect

    if _rooms():
        from factory.training.trainer import Trainer
    else:
        from factory.trainer import Trainer

    # every variant computes on the same threads: this machine's cores, shared by the ranks
    r = _recipe([f"train.threads={max(1, (os.cpu_count() or 1) // world)}", *overrides])
    kwargs = {"rank": rank, "world_size": world} if "world_size" in inspect.signature(Trainer).parameters else {}
    trainer = Trainer(model, r.algorithm, r.train, r.rollout, **kwargs)
    batch = make_batch(spec)
    times = []
    out: dict = {}
    warm: dict = {}
    if "train.warm_up=true" in overrides:  # --warm-up: what a run's trainer actor does while its engines start
        t0 = time.perf_counter()
        trainer.warm_up(prompt_tokens=spec["prompt"])
        _sync(trainer.device)
        warm["warm_up_s"] = time.perf_counter() - t0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = trainer.train_step(batch)
        _sync(trainer.device)
        times.append(time.perf_counter() - t0)
    settings = trainer.settings() if hasattr(trainer, "settings") else {}
    return {"step_s": times, "loss": out["train/loss"], "padding_share": out.get("train/padding_share"),
            "micro_batches": out.get("train/micro_batches"), **({"settings": settings} if settings else {}), **warm}


def variant_plain(model: str, spec: dict, steps: int, device: str = "cpu", compiled: bool = False) -> dict:
    """The plain reference step (see the module docstring); `compiled`: each decoder block
    torch.compile'd with dynamic shapes (the first step pays the compile)."""
    import torch
    from transformers import AutoModelForCausalLM

    from factory.model.logprobs import pad_samples, to_device

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).train()
    gpu = device == "cuda"
    if gpu:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compiled:
        for block in m.model.layers:
            block.compile(dynamic=True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=gpu or None)
    batch = make_batch(spec)
    t = to_device(pad_samples(batch.samples, 0), torch.device(device))
    adv = torch.tensor([s.reward - 0.5 for s in batch.samples], device=device)
    times = []
    loss = torch.zeros(())
    for _ in range(steps):
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=gpu):
            hidden = m.model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).last_hidden_state
            parts = []
            for lo in range(0, hidden.shape[0], 2):  # row chunks
                rows = slice(lo, lo + 2)
                pos = t["prompt_lens"][rows, None] + torch.arange(t["t_max"], device=device)[None] - 1
                pos = pos.clamp(max=hidden.shape[1] - 2)
                h = hidden[rows].gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))
                logp = torch.log_softmax(m.lm_head(h).float(), -1)
                tgt = t["input_ids"][rows].gather(1, pos + 1)
                parts.append(logp.gather(-1, tgt[..., None]).squeeze(-1))
            logp = torch.cat(parts)
        ratio = torch.exp(logp - t["old_logp"])
        loss = -(ratio * adv[:, None] * t["mask"]).sum() / t["mask"].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        _sync(torch.device(device))
        times.append(time.perf_counter() - t0)
    return {"step_s": times, "loss": float(loss)}


def _sync(device) -> None:
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize()


def _peak_gib() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def _ranks_worker(rank: int, world: int, model: str, spec: dict, steps: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29561"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = variant_trainer(model, spec, steps, [], rank, world)
    res["peak_gib"] = _peak_gib()
    Path(f"{out}.{rank}").write_text(json.dumps(res))
    dist.destroy_process_group()


def child(args) -> None:
    """One variant in this process; prints its result as JSON on the last line."""
    spec = json.loads(args.spec)
    overrides = json.loads(args.overrides)
    if args.child in ("plain", "plain_compiled"):
        res = variant_plain(args.model, spec, args.steps, args.device, compiled=args.child == "plain_compiled")
    elif args.child == "ranks":
        import torch.multiprocessing as mp

        out = tempfile.mktemp(prefix="bench-ranks-")
        mp.spawn(_ranks_worker, args=(args.world, args.model, spec, args.steps, out), nprocs=args.world)
        parts = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(args.world)]
        res = {"step_s": [max(s) for s in zip(*(p["step_s"] for p in parts))], "loss": parts[0]["loss"],
               "peak_gib_per_rank": max(p["peak_gib"] for p in parts)}
    else:
        res = variant_trainer(args.model, spec, args.steps, overrides)
    res.setdefault("peak_gib", _peak_gib())
    print(json.dumps(res))


def run_variant(name: str, variant: str, model: Path, spec: dict, steps: int = 3, overrides: list[str] | None = None,
                tree: Path = REPO, device: str = "cpu", world: int = 1) -> dict:
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    cmd = [sys.executable, str(REPO / "bench" / "trainer_scale.py"), "--child", variant, "--model", str(model),
           "--spec", json.dumps(spec), "--steps", str(steps), "--overrides", json.dumps(overrides or []),
           "--device", device, "--world", str(world)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        res = {"error": " | ".join(tail) or f"exit {proc.returncode}"}
    else:
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        steady = res["step_s"][1:] or res["step_s"]
        res["s_per_step"] = sum(steady) / len(steady)
        tokens = sum(spec["completion"]) + spec["prompt"] * spec["n"] if isinstance(spec["completion"], list) \
            else spec["n"] * (spec["prompt"] + spec["completion"])
        res["tokens_per_s"] = tokens / res["s_per_step"]
    res["wall_s"] = time.perf_counter() - t0
    shown = f"{res['s_per_step']:.2f} s/step, peak {res.get('peak_gib', 0):.2f} GiB" if "error" not in res else res["error"]
    print(f"  {name:<34} {shown}", flush=True)
    return res


def old_tree() -> Path:
    """The trainer before the lean step, checked out beside the repository (a git worktree)."""
    path = Path(tempfile.gettempdir()) / f"factory-{OLD_COMMIT}"
    if not (path / "factory" / "trainer.py").is_file():
        subprocess.run(["git", "worktree", "add", "-f", "--detach", str(path), OLD_COMMIT], cwd=REPO, check=True,
                       capture_output=True)
    return path


def ratio(a: dict, b: dict, key: str) -> float | None:
    return a[key] / b[key] if key in a and key in b and b[key] else None


def cpu(args) -> dict:
    print("trainer scale, CPU: vocabulary 151,936, small body", flush=True)
    work = Path(tempfile.mkdtemp(prefix="trainer-scale-"))
    model = build_model(work / "model", CPU_BODY)
    results: dict = {"machine": f"{os.cpu_count()} CPUs", "vocab": VOCAB, "body": CPU_BODY, "old_commit": OLD_COMMIT}
    spec = batch_spec(8, 128, 384)
    print("8 samples x 512 tokens:", flush=True)
    old = run_variant("old step (before the lean step)", "trainer", model, spec, tree=old_tree())
    new = run_variant("new step", "trainer", model, spec)
    plain = run_variant("plain reference", "plain", model, spec)
    results["8x512"] = {"old": old, "new": new, "plain": plain,
                        "old_over_new_peak": ratio(old, new, "peak_gib"),
                        "new_over_old_time": ratio(new, old, "s_per_step"),
                        "new_over_plain_time": ratio(new, plain, "s_per_step")}
    print("16 samples x 1,024 tokens:", flush=True)
    results["16x1024"] = {"new": run_variant("new step", "trainer", model, batch_spec(16, 256, 768))}
    print("1 rank against 2 FSDP2 ranks (gloo), 8 x 512:", flush=True)
    one = run_variant("1 rank", "ranks", model, spec, world=1)
    two = run_variant("2 ranks", "ranks", model, spec, world=2)
    results["ranks"] = {"one": one, "two": two, "two_over_one_time": ratio(two, one, "s_per_step")}
    results["heavy_tailed"] = heavy_tailed_cpu(model)
    return results


def heavy_tailed_cpu(model: Path) -> dict:
    """16 samples of 64 prompt tokens and heavy-tailed completions, a 4,096-token budget: packed rows,
    micro-batches grouped by length, and the plain reference on the padded batch."""
    lens = heavy_tailed(16, seed=1)
    mix = batch_spec(16, 64, lens)
    print(f"heavy-tailed completions {sorted(lens)}:", flush=True)
    budget = "train.micro_batch_tokens=4096"
    packed = run_variant("new step, packed rows of 4,096", "trainer", model, mix, overrides=[budget, "train.packing=true"])
    rows = run_variant("new step, auto: rows as wide as the longest", "trainer", model, mix,
                       overrides=[budget, "train.packing=auto"])
    grouped = run_variant("new step, grouped micro-batches 4,096", "trainer", model, mix,
                          overrides=[budget, "train.packing=false"])
    padded = run_variant("plain reference, padded batch", "plain", model, mix)
    return {"lengths": lens, "packed": packed, "rows": rows, "new": grouped, "plain": padded,
            "plain_over_new_time": ratio(padded, grouped, "s_per_step"),
            "packed_over_grouped_time": ratio(packed, grouped, "s_per_step"),
            "rows_over_grouped_time": ratio(rows, grouped, "s_per_step"),
            "rows_over_packed_time": ratio(rows, packed, "s_per_step"),
            "plain_over_packed_time": ratio(padded, packed, "s_per_step"),
            "short": short_mix_cpu(model)}


def short_mix_cpu(model: Path) -> dict:
    """Many short samples, the default recipe's shape (64 samples, 32 prompt tokens, completions of 8 to 48):
    where one long packed row's dense mask loses, the rows `auto` packs on sdpa against grouped and one row."""
    import random

    rng = random.Random(2)
    mix = batch_spec(64, 32, [rng.randint(8, 48) for _ in range(64)])
    print("64 short samples (the default recipe's shape):", flush=True)
    out = {name: run_variant(f"new step, {label}", "trainer", model, mix, overrides=[f"train.packing={value}"])
           for name, label, value in (("grouped", "grouped (packing off)", "false"),
                                      ("rows", "auto: rows as wide as the longest", "auto"),
                                      ("packed", "one packed row", "true"))}
    out["rows_over_grouped_time"] = ratio(out["rows"], out["grouped"], "s_per_step")
    out["packed_over_grouped_time"] = ratio(out["packed"], out["grouped"], "s_per_step")
    return out


GPU_NEW = ["train.device=cuda", "train.precision=bf16", "train.activation_checkpointing=true",
           "train.packing=false", "train.compile=false", "train.logprob_chunk_tokens=512"]  # the lean step as first measured
GPU_AUTO = ["train.device=cuda"]  # the defaults: auto precision, packing, chunk, checkpointing and compile


class Lease:
    """A GPU run's results, written to `out` after every run, and the `--budget-s` after which no run
    begins (those are named in `skipped`): a lease that ends early still leaves what was measured."""

    def __init__(self, args, out: Path):
        import torch

        self.out, self.budget_s, self.t0 = out, args.budget_s, time.perf_counter()
        self.results: dict = {"peak_tflops": PEAK_TFLOPS, "device": torch.cuda.get_device_name(0),
                              "torch": torch.__version__, "runs": {}, "skipped": []}
        self.work = Path(tempfile.mkdtemp(prefix="trainer-scale-gpu-"))

    def begins(self, name: str) -> bool:
        if self.budget_s and time.perf_counter() - self.t0 > self.budget_s:
            self.results["skipped"].append(name)
            self.save()
            return False
        return True

    def save(self) -> dict:
        self.results["wall_s"] = time.perf_counter() - self.t0
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.results, indent=1))
        return self.results


def gpu(args, out: Path) -> dict:
    print("trainer scale, GPU (Qwen2.5 shapes, random init)", flush=True)
    lease = Lease(args, out)
    for shape, n in GPU_RUNS:
        if not lease.begins(f"{shape}x{n}"):
            continue
        model = lease.work / shape
        if not model.is_dir():
            build_model(model, GPU_SHAPES[shape], device="cuda")
        params = _param_count(model)
        spec = batch_spec(n, 256, 768)
        new = run_variant(f"{shape} {n}x1024 new", "trainer", model, spec, device="cuda", overrides=GPU_NEW)
        auto = run_variant(f"{shape} {n}x1024 defaults (auto)", "trainer", model, spec, device="cuda",
                           overrides=GPU_AUTO)
        plain = run_variant(f"{shape} {n}x1024 plain", "plain", model, spec, device="cuda")
        compiled = run_variant(f"{shape} {n}x1024 plain, compiled blocks", "plain_compiled", model, spec, device="cuda")
        for r in (new, auto, plain, compiled):
            if "tokens_per_s" in r:
                r["mfu"] = 6 * params * r["tokens_per_s"] / (PEAK_TFLOPS * 1e12)
        lease.results["runs"][f"{shape}x{n}"] = {"params": params, "new": new, "auto": auto, "plain": plain,
                                                 "plain_compiled": compiled,
                                                 "new_over_plain_tokens_per_s": ratio(new, plain, "tokens_per_s"),
                                                 "auto_over_plain_tokens_per_s": ratio(auto, plain, "tokens_per_s"),
                                                 "auto_over_compiled_tokens_per_s": ratio(auto, compiled, "tokens_per_s"),
                                                 "new_over_plain_peak": ratio(new, plain, "peak_gib")}
        lease.save()
    if lease.begins("heavy_tailed"):
        lens = heavy_tailed(32, seed=1)
        mix = batch_spec(32, 256, lens)
        grouped = run_variant("0.5B heavy-tailed new", "trainer", lease.work / "0.5B", mix, device="cuda",
                              overrides=[*GPU_NEW, "train.micro_batch_tokens=16384"])
        padded = run_variant("0.5B heavy-tailed plain (padded)", "plain", lease.work / "0.5B", mix, device="cuda")
        lease.results["heavy_tailed"] = {"lengths": lens, "new": grouped, "plain": padded,
                                         "plain_over_new_time": ratio(padded, grouped, "s_per_step")}
    return lease.save()


def warm_up(args, out: Path) -> dict:
    """--warm-up: the trainer's first step with and without `train.warm_up` (Trainer.warm_up, which a run's
    trainer actor calls while the engines start), each in a fresh process; GPU: the Qwen2.5 shapes at
    16 x 1,024, CPU: this bench's CPU body at 8 x 512."""
    lease = Lease(args, out) if args.gpu else None
    work = lease.work if lease else Path(tempfile.mkdtemp(prefix="trainer-scale-warm-"))
    results = lease.results if lease else {"runs": {}}
    device, base = ("cuda", GPU_NEW) if args.gpu else ("cpu", [])
    cases = [("0.5B", GPU_SHAPES["0.5B"], 16, 1024), ("1.5B", GPU_SHAPES["1.5B"], 16, 1024)] if args.gpu \
        else [("cpu-body", CPU_BODY, 8, 512)]
    for name, body, n, length in cases:
        if lease and not lease.begins(name):
            continue
        model = work / name
        if not model.is_dir():
            build_model(model, body, device=device)
        spec = batch_spec(n, length // 4, length - length // 4)
        row = {w: run_variant(f"{name} {n}x{length} warm_up={w}", "trainer", model, spec, device=device,
                              overrides=[*base, f"train.warm_up={w}"]) for w in ("false", "true")}
        cold, warm = row["false"], row["true"]
        if "error" not in cold and "error" not in warm:
            row["first_step_cold_s"], row["first_step_warm_s"] = cold["step_s"][0], warm["step_s"][0]
            row["first_over_later_cold"] = cold["step_s"][0] / cold["s_per_step"]
            row["first_over_later_warm"] = warm["step_s"][0] / warm["s_per_step"]
        results["runs"][name] = row
        if lease:
            lease.save()
    if lease:
        return lease.save()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    return results


KNOBS = [  # --knobs: where the new step's time goes against the plain one, at one shape
    [],
    ["train.logprob_chunk_tokens=2048"],
    ["train.logprob_chunk_tokens=8192"],
    ["train.logprob_chunk_tokens=2048", "train.micro_batch_tokens=0"],
    ["train.logprob_chunk_tokens=2048", "train.activation_checkpointing=false"],
]


def knobs(args, out: Path) -> dict:
    """The new step under each of KNOBS against the plain reference, 0.5B and 1.5B at 16 x 1,024."""
    lease = Lease(args, out)
    for shape in ("0.5B", "1.5B"):
        model = build_model(lease.work / shape, GPU_SHAPES[shape], device="cuda")
        spec = batch_spec(16, 256, 768)
        rows = lease.results["runs"][shape] = {"plain": run_variant(f"{shape} plain", "plain", model, spec, device="cuda")}
        for extra in KNOBS:
            name = " ".join(extra) or "defaults"
            if lease.begins(f"{shape} {name}"):
                rows[name] = run_variant(f"{shape} {name}", "trainer", model, spec, device="cuda", overrides=[*GPU_NEW, *extra])
                rows[name]["over_plain_tokens_per_s"] = ratio(rows[name], rows["plain"], "tokens_per_s")
                lease.save()
    return lease.save()


def plot_gpu(results: dict, out: Path) -> None:
    """Seconds per step and peak GPU memory, trainer against plain, per shape x batch (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(name, r) for name, r in results["runs"].items() if "s_per_step" in r["new"] and "s_per_step" in r["plain"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(runs))
    for ax, key, label in ((axes[0], "s_per_step", "seconds per step"), (axes[1], "peak_gib", "peak GPU memory (GiB)")):
        ax.bar([i - 0.2 for i in x], [r["new"][key] for _, r in runs], 0.4, label="trainer (defaults)", color="tab:blue")
        ax.bar([i + 0.2 for i in x], [r["plain"][key] for _, r in runs], 0.4, label="plain bf16 step", color="tab:orange")
        ax.set_xticks(list(x), [n.replace("x", " x ") + " x 1,024" for n, _ in runs], rotation=20)
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle(f"trainer step on {results.get('device', 'one GPU')}, vocabulary {VOCAB:,}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot(results: dict, out: Path) -> None:
    """Seconds per step and peak memory of each CPU variant, side by side (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("8x512 old", results["8x512"]["old"]), ("8x512 new", results["8x512"]["new"]),
            ("8x512 plain", results["8x512"]["plain"]), ("16x1024 new", results["16x1024"]["new"]),
            ("tailed packed", results["heavy_tailed"].get("packed", {})),
            ("tailed rows", results["heavy_tailed"].get("rows", {})),
            ("tailed grouped", results["heavy_tailed"]["new"]), ("tailed plain", results["heavy_tailed"]["plain"]),
            *((f"short {k}", results["heavy_tailed"].get("short", {}).get(k, {})) for k in ("packed", "rows", "grouped"))]
    rows = [(n, r) for n, r in rows if "s_per_step" in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "s_per_step", "seconds per step"), (axes[1], "peak_gib", "peak memory (GiB)")):
        colours = ["tab:grey" if "old" in n else "tab:orange" if "plain" in n else "tab:blue" for n, _ in rows]
        ax.bar([n for n, _ in rows], [r[key] for _, r in rows], color=colours)
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"trainer step, vocabulary {VOCAB:,} (grey: before the lean step, blue: new, orange: plain reference)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _param_count(model: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    import torch

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return sum(p.numel() for p in m.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--child", choices=["trainer", "plain", "plain_compiled", "ranks"])
    ap.add_argument("--model")
    ap.add_argument("--spec")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--overrides", default="[]")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--knobs", action="store_true", help="GPU: the new step's knobs against the plain step")
    ap.add_argument("--warm-up", action="store_true", help="the first step with and without the trainer's warm-up")
    ap.add_argument("--heavy-tailed", action="store_true",
                    help="CPU: only the heavy-tailed batch (packed, grouped, plain), into the results file's heavy_tailed")
    ap.add_argument("--budget-s", type=float, default=0.0, help="GPU: begin no run after this many seconds")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from the results file (with --gpu: the GPU one)")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    out = Path(args.out or REPO / "bench" / "results" / ("trainer_scale_gpu.json" if args.gpu else "trainer_scale.json"))
    if not args.plot_only:
        if args.warm_up:
            name = "trainer_warm_up_gpu.json" if args.gpu else "trainer_warm_up.json"
            print(json.dumps(warm_up(args, Path(args.out or REPO / "bench" / "results" / name)), indent=1))
            return
        if args.knobs:
            knobs(args, Path(args.out or REPO / "bench" / "results" / "trainer_scale_gpu_knobs.json"))
            return
        if args.gpu:
            gpu(args, out)
        elif args.heavy_tailed:
            results = json.loads(out.read_text()) if out.is_file() else {}
            work = Path(tempfile.mkdtemp(prefix="trainer-scale-"))
            results["heavy_tailed"] = heavy_tailed_cpu(build_model(work / "model", CPU_BODY))
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1))
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(cpu(args), indent=1))
        print(f"results: {out}")
    (plot_gpu if args.gpu else plot)(json.loads(out.read_text()), out.with_suffix(".png"))
    print(f"plot: {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
