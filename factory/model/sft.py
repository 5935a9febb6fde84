"""Supervised warm start and the cached base policy a run starts from.

The tiny model (a Llama or a Qwen2, `model.architecture`) starts from random weights; a short SFT
on the task's own answers brings sampled held-out accuracy clearly above zero and far below 100%,
which is where RL has room to act.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

from factory.paths import exclusive, models_dir

STOP_WINDOW = 50  # updates whose mean loss model.sft_stop_loss is compared with


def policy_key(recipe) -> dict:
    """Everything the base policy depends on: the model and data sections and the environment prompt
    (kept beside each new policy as key.json, so the next build can say what changed)."""
    model = recipe.model.model_dump(mode="json")
    for name in ("architecture", "num_kv_heads", "sft_stop_loss"):  # added later: at their defaults, cached Llamas keep their key
        if model[name] == type(recipe.model).model_fields[name].default:
            del model[name]
    key = {
        "model": model,
        # data.overlong decides which tasks a run keeps, not what the warm start trains on
        "data": {k: v for k, v in recipe.data.model_dump(mode="json").items() if k != "overlong"},
        "system_prompt": recipe.environment.system_prompt,
        "version": 3,  # bump when the warm start's procedure changes
    }
    return key


def policy_fingerprint(recipe) -> str:
    """The cache key of `recipe`'s base policy: a digest of `policy_key`."""
    return hashlib.sha256(json.dumps(policy_key(recipe), sort_keys=True).encode()).hexdigest()[:12]


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


def base_policy_path(recipe) -> Path | None:
    """Where `recipe`'s base policy is (model.path, or the cached warm start), or None if not built yet."""
    if recipe.model.path:
        return Path(recipe.model.path)
    out = cached_policy_dir(recipe)
    return out if (out / "sft.json").is_file() else None


def cached_policy_dir(recipe) -> Path:
    """Where the warm start of `recipe`'s tiny model is cached: tiny-<fingerprint> (the Llama, as
    always) or tiny-<architecture>-<fingerprint>."""
    arch = recipe.model.architecture
    return models_dir() / f"tiny-{'' if arch == 'llama' else arch + '-'}{policy_fingerprint(recipe)}"


SFT_SECONDS_PER_STEP = 0.25  # a build's seconds per warm-start update, setup included: the suite's Llama, 2 cores
KEY_FIELDS = {"system_prompt": "environment.system_prompt", "version": "the warm start's procedure (its version)"}


def key_differences(key: dict, other: dict) -> list[str]:
    """The recipe fields, dotted, whose values differ between two `policy_key`s (a field one key
    lacks differs: a key leaves out some fields at their defaults)."""
    def flat(value, path: str) -> dict[str, object]:
        if isinstance(value, dict) and value:
            items = [(f"{path}.{name}" if path else name, item) for name, item in value.items()]
        elif isinstance(value, list) and value:
            items = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
        else:
            return {path: value}
        return {k: v for sub, item in items for k, v in flat(item, sub).items()}

    a, b = flat(key, ""), flat(other, "")
    missing = object()
    changed = [k for k in sorted(a.keys() | b.keys()) if a.get(k, missing) != b.get(k, missing)]
    return [KEY_FIELDS.get(k, k) for k in changed]


def cached_policies(architecture: str) -> list[tuple[Path, dict, dict | None]]:
    """The built warm starts of `architecture` in the state dir: (dir, its sft.json, its key.json or None)."""
    out = []
    for path in sorted(models_dir().glob("tiny-*")):
        try:
            meta = json.loads((path / "sft.json").read_text())
            key = json.loads((path / "key.json").read_text()) if (path / "key.json").is_file() else None
        except (OSError, ValueError):  # not a built policy (a lock, a build under way)
            continue
        if "fingerprint" in meta and meta.get("architecture", "llama") == architecture:  # not a policy built on one
            out.append((path, meta, key))
    return out


def base_policy_plan(recipe) -> str:
    """The line before the base policy is made ready: where it comes from, or that a new warm start is
    built, why (the fields that differ from the nearest cached policy of the architecture) and about how
    long it takes (that policy's seconds per update, else the median of the cached ones', else
    SFT_SECONDS_PER_STEP, times `model.sft_steps`)."""
    if recipe.model.path:
        return f"base policy (model.path: {recipe.model.path})"
    built = base_policy_path(recipe)
    if built is not None:
        return f"base policy (cached: {built.name})"
    arch = recipe.model.architecture
    cached = cached_policies(arch)
    key = policy_key(recipe)
    keyed = [(key_differences(key, other), path, meta) for path, meta, other in cached if other is not None]
    if keyed:
        fields, nearest, meta = min(keyed, key=lambda k: (len(k[0]), k[1].name))
        why = f"{', '.join(fields)} differ{'s' if len(fields) == 1 else ''} from the cached policy {nearest.name}"
        rates = [_seconds_per_step(meta)]
    else:
        why = f"no cached policy of this architecture ({arch})"
        if cached:
            why += f" holds a key.json to compare with ({len(cached)} cached)"
        rates = [_seconds_per_step(meta) for _, meta, _ in cached]
    known = sorted(r for r in rates if r)
    rate = known[len(known) // 2] if known else SFT_SECONDS_PER_STEP
    steps = recipe.model.sft_steps
    sooner = ", model.sft_stop_loss may end it sooner" if recipe.model.sft_stop_loss is not None else ""
    return (f"base policy: building a new SFT warm start into {cached_policy_dir(recipe).name} ({why}); "
            f"model.sft_steps={steps} at ~{rate:.2f} s each: about {_duration(steps * rate)}{sooner}")


def _seconds_per_step(meta: dict) -> float | None:
    steps = meta.get("sft_steps_run") or meta.get("sft_steps")
    return meta["seconds"] / steps if steps and meta.get("seconds") else None


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def ensure_base_policy(recipe, progress=None) -> Path:
    """The warm-started policy for `recipe`, built once and cached under the state dir.

    With `model.path` set, that directory is used as it is.
    """
    if recipe.model.path:
        path = Path(recipe.model.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path: {path} holds no config.json (not a Hugging Face model dir)")
        return path
    return build_once(cached_policy_dir(recipe), lambda tmp: _build_base_policy(recipe, tmp, progress))


def build_once(out: Path, build) -> Path:
    """`out` (a policy dir, complete once it holds sft.json), made by `build(tmp)` unless it exists.
    One build at a time per dir: processes that need it together (a sweep's runs, two test sessions)
    wait for the first, then find it published. `build` writes into a dir of this process's own,
    sft.json last, published by one rename: a crash mid-build leaves no half-made policy, and builders
    the lock cannot reach (another machine, a filesystem without flock) cannot mix their files (seen
    before the lock: a shared dir got mixed files); the first to finish publishes.

    `out` may be a link to where the policy is shared (a test session links the user's state dir's
    policies, even one still being built there): the lock, the build and the publish then happen at the
    link's target, so this waits for a builder there instead of building a second copy."""
    if (out / "sft.json").is_file():
        return out
    target = out.resolve()

    def waiting(holder: str) -> None:
        print(f"waiting for pid {holder}, which is building the policy {target.name}", file=sys.stderr, flush=True)

    with exclusive(target.with_name(f".{target.name}.lock"), on_wait=waiting):
        if not (target / "sft.json").is_file():
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            build(tmp)
            try:
                tmp.rename(target)  # atomic publish
            except OSError:  # another process published the same policy first (the same inputs, the same result)
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def tokenizer_texts(prompt, train) -> list[str]:
    """What the tiny model's BPE tokenizer is trained on: the warm start's prompts (`prompt(task)`'s
    messages) and answers."""
    return [m["content"] for t in train for m in prompt(t)] + [t.answer for t in train]


def _build_base_policy(recipe, tmp: Path, progress) -> None:
    """The warm start of `recipe`'s tiny model, written to `tmp` (sft.json last)."""
    import torch

    from factory.data.tasks import ReasoningGymSource
    from factory.envs.base import make_environment
    from factory.model.tiny import build_model, build_tokenizer

    t0 = time.time()
    source = ReasoningGymSource.from_recipe(recipe.data)
    env = make_environment(recipe.environment)
    train = source.train[: recipe.model.sft_examples]
    tokenizer = build_tokenizer(tokenizer_texts(env.prompt_messages, train), recipe.model.bpe_vocab_size, tmp,
                                recipe.model.architecture)
    model = build_model(tokenizer, recipe.model, tmp)
    torch.manual_seed(recipe.model.seed)
    losses = warm_start(model, tokenizer, env, train, recipe.model, progress)
    model.save_pretrained(tmp)
    meta = {
        "fingerprint": policy_fingerprint(recipe),
        "architecture": recipe.model.architecture,
        "sft_steps": recipe.model.sft_steps,
        "sft_steps_run": len(losses),
        "final_loss": losses[-1] if losses else None,
        "loss_curve": losses,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": time.time() - t0,
    }
    (tmp / "key.json").write_text(json.dumps(policy_key(recipe), indent=1, sort_keys=True))
    (tmp / "sft.json").write_text(json.dumps(meta))
