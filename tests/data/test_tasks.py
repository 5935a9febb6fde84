"""Task sources: seeded, disjoint splits over two families; a sampler that resumes exactly."""

from __future__ import annotations

from factory.data.tasks import ReasoningGymSource, TaskFamilySpec, TaskSampler
from factory.rewards.verifiers import reasoning_gym_reward

FAMILIES = [
    TaskFamilySpec("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                                        "operators": ["+"], "allow_parentheses": False, "allow_negation": False}),
    TaskFamilySpec("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}, weight=0.5),
]


def test_splits_are_disjoint_seeded_and_mixed():
    a = ReasoningGymSource(FAMILIES, train_size=300, heldout_size=100, seed=1)
    b = ReasoningGymSource(FAMILIES, train_size=300, heldout_size=100, seed=1)
    keys = lambda ts: {(t.family, t.question) for t in ts}  # noqa: E731
    assert not keys(a.train) & keys(a.heldout)
    assert [t.question for t in a.train] == [t.question for t in b.train]
    assert {t.family for t in a.train} == {"basic_arithmetic", "chain_sum"}
    assert sum(t.family == "basic_arithmetic" for t in a.train) == 200  # weights 1 : 0.5
    c = ReasoningGymSource(FAMILIES, train_size=300, heldout_size=100, seed=2)
    assert [t.question for t in a.heldout] != [t.question for t in c.heldout]


def test_verifier_scores_right_and_wrong_answers():
    task = ReasoningGymSource(FAMILIES, train_size=10, heldout_size=10).heldout[0]
    assert reasoning_gym_reward(task.answer, task) == 1.0
    assert reasoning_gym_reward(" " + task.answer + "\n", task) == 1.0
    assert reasoning_gym_reward(str(int(task.answer) + 1), task) == 0.0
    assert reasoning_gym_reward(None, task) == 0.0


def test_sampler_resumes_from_its_state_across_epochs():
    tasks = ReasoningGymSource(FAMILIES, train_size=30, heldout_size=10).train
    s = TaskSampler(tasks, seed=5)
    for _ in range(47):  # into the second epoch
        s.next()
    state = s.state_dict()
    expected = [s.next().task_id for _ in range(40)]
    resumed = TaskSampler(tasks, seed=0)
    resumed.load_state_dict(state)
    assert [resumed.next().task_id for _ in range(40)] == expected
    fresh = TaskSampler(tasks, seed=5)
    one_epoch = [fresh.next().task_id for _ in range(len(tasks))]
    assert sorted(one_epoch) == sorted(t.task_id for t in tasks)  # each task once per epoch
