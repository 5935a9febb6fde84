"""Supervised warm start: the examples, their batches and the loop that trains the tiny model on them.

The tiny model (a Llama, a Qwen2, a Qwen3 or a Qwen3-MoE, `model.architecture`) starts from random weights; a short SFT
on the task's own answers brings sampled held-out accuracy clearly above zero and far below 100%,
which is where RL has room to act. Building and caching the base policy is
`factory.training.base_policy`'s; where it is cached, `factory.model.policy_cache`'s.
"""

from __future__ import annotations

import os
import random

STOP_WINDOW = 50  # updates whose mean loss model.sft_stop_loss is compared with


def sft_examples(tokenizer, env, tasks) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + EOS) per task, with the prompt exactly as the gateway builds it.

    If the environment gives a `demonstration(task)` episode, each of its assistant turns is one
    example instead: (the ids the gateway would send the engine before that turn, the turn's ids up
    to its end token), so the loss falls on assistant tokens only, never on tool results."""
    from factory.model.tokens import encode_chat, encode_continuation, encode_reply

    demonstrate = getattr(env, "demonstration", None)
    out = []
    for t in tasks:
        episode = demonstrate(t) if demonstrate else None
        if not episode:
            prompt = encode_chat(tokenizer, env.prompt_messages(t))
            answer = tokenizer(t.answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            out.append((prompt, answer))
            continue
        turns = [i for i, m in enumerate(episode) if m["role"] == "assistant"]
        ids = encode_chat(tokenizer, episode[: turns[0]])
        for k, i in enumerate(turns):
            reply = encode_reply(tokenizer, episode[:i], episode[i])
            out.append((list(ids), reply))
            if k + 1 < len(turns):  # the tool/user messages up to the next turn, appended as the gateway does
                ids = ids + reply + encode_continuation(tokenizer, episode[: i + 1], episode[i + 1: turns[k + 1]])
    return out


def collate(pairs, pad_id: int):
    """Right-padded input ids, and targets that are -100 everywhere but the answer tokens."""
    import torch

    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    attn = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, (p, a) in enumerate(pairs):
        seq = p + a
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(a)
        attn[i, : len(seq)] = 1
    return ids, labels, attn


def warm_start(model, tokenizer, env, tasks, section, progress=None) -> list[float]:
    """AdamW on answer-only cross-entropy, linear warm-up then cosine decay to 10% of the peak
    learning rate; returns the loss curve.

    Measured here on 2-digit addition (400 held-out, same compute each): batch 128 x 300 steps
    reaches 4% sampled accuracy, batch 32 x 1200 steps 54-60% (two seeds), batch 16 x 2400 21%.
    The loss sits on a plateau and drops sharply after ~800 updates, so the number of updates,
    not the samples seen, is what buys accuracy; a constant rate and a 3x higher rate were worse.
    How long the plateau lasts depends on the seed (1,200 updates left two of three seeds on it), and
    once off it the policy soon knows its training questions (2,400 updates: 98% sampled, nothing left
    for RL), so `section.sft_stop_loss` ends the warm start just past the drop.
    """
    import math

    import torch

    rng = random.Random(section.seed)
    examples = sft_examples(tokenizer, env, tasks)
    opt = torch.optim.AdamW(model.parameters(), lr=section.sft_lr, weight_decay=0.0)
    warmup = max(1, section.sft_steps // 20)
    total = max(1, section.sft_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, total) / total))))
    model.train()
    # one process's job: its matrix products use every core this process may run on, whatever thread
    # count the process had (a trainer in the same process sets its own; a test session's warm starts
    # ran on one thread after one: 107 s against 71 s on two cores for a 400-step start)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    try:
        losses = _sft_loop(model, tokenizer, examples, opt, sched, rng, section, progress)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return losses


def _sft_loop(model, tokenizer, examples, opt, sched, rng, section, progress) -> list[float]:
    import torch

    losses: list[float] = []
    for step in range(section.sft_steps):
        ids, labels, _ = collate(rng.sample(examples, min(section.sft_batch_size, len(examples))), tokenizer.pad_token_id)
        # right padding under a causal mask cannot reach a counted token: no attention mask needed,
        # which lets attention take its plain causal path
        out = model(input_ids=ids, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(out.loss.item())
        if progress:
            progress(step + 1, section.sft_steps, losses[-1])
        if section.sft_stop_loss is not None and len(losses) >= STOP_WINDOW \
                and sum(losses[-STOP_WINDOW:]) / STOP_WINDOW <= section.sft_stop_loss:
            if progress:  # done: the bar ends here, at the updates it took
                progress(step + 1, step + 1, losses[-1])
            break
    return losses


def tokenizer_texts(prompt, train) -> list[str]:
    """What the tiny model's BPE tokenizer is trained on: the warm start's prompts (`prompt(task)`'s
    messages) and answers."""
    return [m["content"] for t in train for m in prompt(t)] + [t.answer for t in train]
