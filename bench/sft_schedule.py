"""Warm-start SFT: batch size × steps at equal compute, side by side (why the default is 32 × 1,200).

Each row trains the default recipe's tiny model from the same random init with
`factory.model.sft.warm_start` (the code the runs use) and scores sampled (T = 1) and greedy
held-out accuracy on `--heldout` tasks with a plain batched decoder. Writes
bench/results/sft_schedule.json.

    python bench/sft_schedule.py [--rows 128x300 32x1200] [--heldout 400]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results_file import write_results  # noqa: E402


def accuracy(model, tokenizer, env, tasks, greedy: bool, max_new: int = 6, seed: int = 1) -> float:
    """Share of tasks whose decoded answer equals the reference (left-padded batch, one pass per token)."""
    import torch

    from factory.model.tokens import encode_chat

    prompts = [encode_chat(tokenizer, env.prompt_messages(t)) for t in tasks]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        att[i, width - len(p):] = 1
    gen = torch.Generator().manual_seed(seed)
    out = []
    model.eval()
    with torch.no_grad():
        for _ in range(max_new):
            pos = (att.cumsum(1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, -1].float()
            nxt = logits.argmax(-1) if greedy else torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
            out.append(nxt)
            ids = torch.cat([ids, nxt[:, None]], 1)
            att = torch.cat([att, torch.ones_like(nxt)[:, None]], 1)
    rows = torch.stack(out, 1).tolist()
    ok = 0
    for t, row in zip(tasks, rows):
        row = row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
        ok += tokenizer.decode(row).strip() == t.answer
    return ok / len(tasks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=["128x300", "32x1200"], help="BATCHxSTEPS per row")
    ap.add_argument("--heldout", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0, help="model.seed: the init and the SFT sample order")
    ap.add_argument("--stop-loss", type=float, default=None, help="model.sft_stop_loss for every row")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sft_schedule.json"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from factory.data.tasks import ReasoningGymSource, seeded_subset
    from factory.envs.base import make_environment
    from factory.model.sft import warm_start
    from factory.model.tiny import build_model, build_tokenizer
    from factory.recipe import load_recipe

    torch.set_num_threads(os.cpu_count() or 1)
    base = load_recipe(REPO / "recipes" / "default.yaml")
    source = ReasoningGymSource.from_recipe(base.data)
    env = make_environment(base.environment)
    train = source.train[: base.model.sft_examples]
    heldout = seeded_subset(source.heldout, args.heldout, base.eval.seed)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        texts = [m["content"] for t in train for m in env.prompt_messages(t)] + [t.answer for t in train]
        tokenizer = build_tokenizer(texts, base.model.bpe_vocab_size, Path(tmp))
        for spec in args.rows:
            batch, steps = map(int, spec.split("x"))
            section = base.model.model_copy(update={"sft_batch_size": batch, "sft_steps": steps,
                                                                "seed": args.seed, "sft_stop_loss": args.stop_loss})
            model = build_model(tokenizer, section, Path(tmp))  # seeded: the same init for every row
            t0 = time.perf_counter()
            losses = warm_start(model, tokenizer, env, train, section)
            row = {"batch": batch, "steps": steps, "steps_run": len(losses), "samples_seen": batch * len(losses),
                   "seconds": time.perf_counter() - t0, "final_loss": sum(losses[-50:]) / len(losses[-50:]),
                   "sampled_accuracy": accuracy(model, tokenizer, env, heldout, greedy=False),
                   "greedy_accuracy": accuracy(model, tokenizer, env, heldout, greedy=True)}
            results.append(row)
            print(f"batch {batch:>4} x {steps:>5} steps (ran {len(losses)}): loss {row['final_loss']:.3f}, sampled "
                  f"{row['sampled_accuracy']:.3f}, greedy {row['greedy_accuracy']:.3f} ({row['seconds']:.0f}s)",
                  flush=True)
    write_results(args.out, {"recipe": "recipes/default.yaml", "heldout": len(heldout), "seed": args.seed,
                             "stop_loss": args.stop_loss,
                                "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
