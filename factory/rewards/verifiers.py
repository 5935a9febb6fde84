"""Verifiers by name: how a reply (after its source's answer extractor) is scored against a task's
reference, as a reward in [0, 1].

| name          | reward 1 when                                                  | config (defaults)                         |
|---------------|----------------------------------------------------------------|-------------------------------------------|
| exact         | normalise(reply) == normalise(reference)                      | case_sensitive (false)                    |
| numeric       | |r − a| <= max(abs_tol, rel_tol·|a|) for numbers r, a            | abs_tol (1e-6), rel_tol (0)               |
| math_verify   | math-verify finds reply and reference equal (LaTeX, \\boxed{}) |                                           |
| regex         | the pattern matches the reply (whole, or anywhere with search) | pattern ("{answer}"), ignore_case, search |
| code          | fraction of the task's unit tests passed in the sandbox         | test_field, entry_point_field, prefix_field |
| reasoning_gym | reasoning-gym's own scorer of `family`                          | family, metadata_field                    |

A task carries its verifier in `metadata["verifier"]` (`{name, extract, config}`, set by a file
source, per source or per row) and its reference in `metadata["reference"]`; tasks of
reasoning-gym families carry none and are scored by reasoning-gym (code tasks by their tests).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import re
import threading
import unicodedata
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cache
from typing import Any

from factory.core import registries
from factory.core.registry import Registry
from factory.rewards.extract import EXTRACTORS, extract
from factory.core.types import Task

REQUIRED = object()  # an option without a default

# (reply after extraction, task, config with defaults filled in, sandbox) -> (reward, details)
ScoreFn = Callable[[str, Task, dict[str, Any], Any], "tuple[float, dict[str, Any]] | Awaitable[tuple[float, dict[str, Any]]]"]


@dataclass(frozen=True)
class Verifier:
    """A registered verifier: its scorer, its config options as name -> (type, default or REQUIRED),
    the row columns it reads (`reads(config)` -> metadata key -> column, None for an optional one left
    unset), a load-time check of one row (`check(reference, fields, config)` -> problem or None), and
    `warm(config)`: load what scoring needs (imports, built scorers) before the first reply arrives."""

    score: ScoreFn
    options: dict[str, tuple[type | tuple[type, ...], Any]] = field(default_factory=dict)
    reads: Callable[[dict[str, Any]], dict[str, str | None]] = lambda config: {}
    check: Callable[[str, dict[str, Any], dict[str, Any]], str | None] = lambda reference, fields, config: None
    needs_sandbox: bool = False
    warm: Callable[[dict[str, Any]], Any] = lambda config: None


VERIFIERS: Registry[Verifier] = registries.VERIFIERS


# ---- the comparisons, as pure functions of text -------------------------------------------------


def normalise(text: str, case_sensitive: bool = False) -> str:
    """NFKC, whitespace runs as one space, stripped, one trailing period dropped, case folded unless
    `case_sensitive`: "  Paris. " and "paris" normalise alike."""
    text = " ".join(unicodedata.normalize("NFKC", text).split())
    text = text[:-1].rstrip() if text.endswith(".") else text
    return text if case_sensitive else text.casefold()


def exact_match(reply: str, reference: str, case_sensitive: bool = False) -> float:
    return float(normalise(reply, case_sensitive) == normalise(reference, case_sensitive))


_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def parse_number(text: str) -> float | None:
    """A number written as a person writes one: `1,234.5`, `$12`, `50%` (50), `-3/4`, `1e-3`; None for
    anything else (`12 apples`, `1.2.3`)."""
    text = text.strip().replace(",", "").removeprefix("$").removesuffix("%").strip()
    if text.count("/") == 1:
        top, bottom = (part.strip() for part in text.split("/"))
        if re.fullmatch(r"[-+]?\d+", top) and re.fullmatch(r"\d+", bottom) and int(bottom) != 0:
            return float(Fraction(int(top), int(bottom)))
        return None
    return float(text) if _NUMBER.fullmatch(text) else None


def numeric_match(reply: str, reference: str, abs_tol: float = 1e-6, rel_tol: float = 0.0) -> float:
    """1 when both parse as numbers within max(abs_tol, rel_tol·|reference|) of each other."""
    got, want = parse_number(reply), parse_number(reference)
    if got is None or want is None:
        return 0.0
    return float(math.isclose(got, want, rel_tol=rel_tol, abs_tol=abs_tol))


def math_verify_match(reply: str, reference: str) -> float:
    """math-verify's equivalence of the reply (its last \\boxed{} or expression) and the reference (read
    as LaTeX: `\\frac{1}{2}`, `1/2` and `0.5` are equal). Its timeouts use SIGALRM, which only the
    main thread may set: elsewhere (a Ray actor's event loop) it runs without them."""
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(reference if "$" in reference or "\\boxed" in reference else f"${reference}$",
                 parsing_timeout=timeout)
    answer = parse(reply, parsing_timeout=timeout)
    return float(bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=timeout))


def regex_pattern(reference: str, pattern: str = "{answer}") -> str:
    """The regex a reply must match: `pattern` with `{answer}` replaced by the reference (itself a
    regex: a row's answer may be a pattern)."""
    return pattern.replace("{answer}", reference)


def regex_match(reply: str, reference: str, pattern: str = "{answer}", ignore_case: bool = False,
                search: bool = False) -> float:
    """1 when the regex (`regex_pattern`) matches the whole stripped reply, or any part of it with
    `search`."""
    regex = re.compile(regex_pattern(reference, pattern), re.IGNORECASE if ignore_case else 0)
    found = regex.search(reply) if search else regex.fullmatch(reply.strip())
    return float(found is not None)


# ---- registry entries -----------------------------------------------------------------------------


def _reference(task: Task) -> str:
    return str(task.metadata.get("reference", task.answer))


VERIFIERS.register("exact", Verifier(
    lambda reply, task, config, sandbox: (exact_match(reply, _reference(task), config["case_sensitive"]), {}),
    {"case_sensitive": (bool, False)}))

def _number_problem(reference: str, fields: dict[str, Any], config: dict[str, Any]) -> str | None:
    return None if parse_number(reference) is not None else f"reference {reference!r} is not a number"


VERIFIERS.register("numeric", Verifier(
    lambda reply, task, config, sandbox: (numeric_match(reply, _reference(task), config["abs_tol"],
                                                        config["rel_tol"]), {}),
    {"abs_tol": ((int, float), 1e-6), "rel_tol": ((int, float), 0.0)},
    check=_number_problem))

VERIFIERS.register("math_verify", Verifier(
    lambda reply, task, config, sandbox: (math_verify_match(reply, _reference(task)), {}),
    warm=lambda config: importlib.import_module("math_verify")))


def _regex_problem(reference: str, fields: dict[str, Any], config: dict[str, Any]) -> str | None:
    try:
        re.compile(regex_pattern(reference, config["pattern"]))
    except re.error as err:
        return f"regex {regex_pattern(reference, config['pattern'])!r} does not compile ({err})"
    return None


VERIFIERS.register("regex", Verifier(
    lambda reply, task, config, sandbox: (regex_match(reply, _reference(task), config["pattern"],
                                                      config["ignore_case"], config["search"]), {}),
    {"pattern": (str, "{answer}"), "ignore_case": (bool, False), "search": (bool, False)},
    check=_regex_problem))


async def _code_score(reply: str, task: Task, config: dict[str, Any], sandbox) -> tuple[float, dict[str, Any]]:
    from factory.rewards.code import score_code

    score = await score_code(reply, task, sandbox)
    return score.fraction, {"tests": score.to_dict()}


def _code_problem(reference: str, fields: dict[str, Any], config: dict[str, Any]) -> str | None:
    from factory.rewards.code import count_cases

    if not isinstance(fields["entry_point"], str) or not fields["entry_point"].isidentifier():
        return f"entry point {fields['entry_point']!r} is not a Python name"
    if not isinstance(fields["test"], str):
        return f"tests must be Python source, got {type(fields['test']).__name__}"
    try:
        count_cases(fields["test"])
    except ValueError as err:
        return f"tests: {err}"
    return None


VERIFIERS.register("code", Verifier(
    _code_score,
    {"test_field": (str, "test"), "entry_point_field": (str, "entry_point"), "prefix_field": ((str, type(None)), None)},
    reads=lambda config: {"test": config["test_field"], "entry_point": config["entry_point_field"],
                          "prompt": config["prefix_field"]},
    check=_code_problem, needs_sandbox=True))


@cache
def _score_fn(family: str):
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(family)


def reasoning_gym_reward(answer: str | None, task: Task, family: str | None = None) -> float:
    """The reasoning-gym scorer of `family` (default: the task's family) on `answer` (surrounding
    whitespace ignored)."""
    if answer is None:
        return 0.0
    entry = task.metadata.get("rg_entry") or {"answer": _reference(task), "metadata": {}}
    return float(_score_fn(family or task.family)(answer.strip(), entry))


def reasoning_gym_families() -> list[str]:
    """Every dataset reasoning-gym can build (importing it takes a couple of seconds)."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _rg_problem(reference: str, fields: dict[str, Any], config: dict[str, Any]) -> str | None:
    metadata = fields.get("rg_metadata")
    if metadata is not None and not isinstance(metadata, dict):
        return f"reasoning-gym metadata must be an object, got {type(metadata).__name__}"
    return None


VERIFIERS.register("reasoning_gym", Verifier(
    lambda reply, task, config, sandbox: (reasoning_gym_reward(reply, task, config["family"]), {}),
    {"family": (str, REQUIRED), "metadata_field": ((str, type(None)), None)},
    reads=lambda config: {"rg_metadata": config["metadata_field"]},
    check=_rg_problem, warm=lambda config: _score_fn(config["family"])))


# ---- specs: checking them, and scoring with them ----------------------------------------------------


def _type_names(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {bool: "true or false", str: "text", int: "a number", float: "a number", type(None): "null"}
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def spec_problems(name: Any, extract_name: Any, config: Any) -> list[str]:
    """What is wrong with a verifier spec, as "field: problem" fragments (empty when it is usable):
    an unknown verifier or extractor, an unknown, missing or mistyped config option."""
    if not isinstance(name, str) or name not in VERIFIERS:
        return [f"name: unknown verifier {name!r}; choose one of {VERIFIERS.names()}"]
    problems = []
    if extract_name is not None and (not isinstance(extract_name, str) or extract_name not in EXTRACTORS):
        problems.append(f"extract: unknown answer extractor {extract_name!r}; choose one of {EXTRACTORS.names()}")
    if not isinstance(config, Mapping):
        return [*problems, f"config: expected a mapping of options, got {config!r}"]
    options = VERIFIERS[name].options
    for key, value in config.items():
        if key not in options:
            known = ", ".join(options) or "none"
            problems.append(f"config.{key}: {name} has no option {key!r}; its options: {known}")
            continue
        kind = options[key][0]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            problems.append(f"config.{key}: expected {_type_names(kind)}, got {value!r}")
    problems += [f"config.{key}: {name} needs this option" for key, (_, default) in options.items()
                 if default is REQUIRED and key not in config]
    if name == "reasoning_gym" and isinstance(config.get("family"), str):
        families = reasoning_gym_families()
        if config["family"] not in families:
            problems.append(f"config.family: unknown reasoning-gym dataset {config['family']!r}")
    return problems


registries.VALIDATORS.register("verifier_spec", spec_problems)  # the recipe checks a VerifierSpec with it


def with_defaults(name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The verifier's config with every option it leaves out at its default."""
    return {key: config.get(key, default) for key, (_, default) in VERIFIERS[name].options.items()}


async def score_with(spec: Mapping[str, Any], answer: str | None, task: Task, sandbox=None) -> tuple[float, dict[str, Any]]:
    """(reward, details) of `answer` under `spec` (`{name, extract, config}`): the reply goes through the
    extractor (none found: reward 0), then the verifier."""
    verifier = VERIFIERS[spec["name"]]
    if verifier.needs_sandbox and sandbox is None:
        raise ValueError(f"task {task.task_id}: the {spec['name']} verifier needs a sandbox")
    reply = extract(spec.get("extract"), answer)
    if reply is None:
        return 0.0, {"extracted": None}
    result = verifier.score(reply, task, with_defaults(spec["name"], spec.get("config") or {}), sandbox)
    reward, details = (await result) if inspect.isawaitable(result) else result
    return reward, ({"extracted": reply, **details} if spec.get("extract") else details)


def warm_up(specs: Iterable[Mapping[str, Any]]) -> None:
    """Load what each verifier in `specs` needs to score (reasoning-gym's scorers: ~1 CPU-s of imports),
    so a process's first replies are not scored behind it. A spec that cannot warm is logged and left
    to fail where it is scored (as that episode's failure)."""
    log = logging.getLogger(__name__)
    for spec in specs:
        problems = spec_problems(spec.get("name"), spec.get("extract"), spec.get("config") or {})
        if problems:
            log.warning("verifier %s did not warm up: %s", spec.get("name"), "; ".join(problems))
            continue
        try:
            VERIFIERS[spec["name"]].warm(with_defaults(spec["name"], spec.get("config") or {}))
        except Exception as err:
            log.warning("verifier %s did not warm up: %s", spec["name"], err)
