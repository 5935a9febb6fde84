"""The thread budget's rule (factory/support/threads.py) and its recipe settings."""

import pytest

from factory.recipe import RecipeError, load_recipe
from factory.support.threads import DEFAULT_SHAPE, available_cores, resolve, shape_of, thread_split

DEFAULT = "recipes/default.yaml"


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 16, 64])
@pytest.mark.parametrize("engines", [1, 2, 3])
def test_async_runs_split_all_but_one_core_and_give_each_side_at_least_one_thread(cores, engines):
    trainer, engine = thread_split(cores, engines, max_staleness=2)
    assert trainer >= 1 and engine >= 1
    if cores - 1 >= engines + 1:
        assert trainer + engines * engine <= cores - 1  # one core left for the API server, env workers, driver
        assert trainer + engines * engine >= cores - 1 - engines  # and not much idle
    else:
        assert trainer == engine == 1  # fewer cores than processes: one thread each, the OS shares them


def test_on_two_cores_auto_is_the_split_measured_best():
    """bench/results/thread_budget.json (2 cores): η = 0 trainer 2 + engine 1, η ≥ 1 one each."""
    assert thread_split(2, 1, max_staleness=0) == (2, 1)
    assert thread_split(2, 1, max_staleness=1) == (1, 1)


@pytest.mark.parametrize("cores", [1, 2, 8])
@pytest.mark.parametrize("engines", [1, 2])
def test_sync_runs_give_the_trainer_every_core_since_the_sides_take_turns(cores, engines):
    trainer, engine = thread_split(cores, engines, max_staleness=0)
    assert trainer == cores and engine == max(1, (cores - 1) // engines)


def test_roles_on_their_own_nodes_take_their_nodes():
    assert thread_split(8, 1, max_staleness=3, shared=False) == (8, 7)


def test_a_number_is_taken_as_given_and_auto_follows_this_machine():
    assert resolve(3, "trainer") == 3
    cores = available_cores()
    sync = {"engines": 1, "max_staleness": 0, "shared": True}
    assert (resolve("auto", "trainer", sync), resolve("auto", "engine", sync)) == (cores, max(1, cores - 1))
    assert (resolve("auto", "trainer"), resolve("auto", "engine")) == thread_split(cores, **DEFAULT_SHAPE)


def test_the_shape_comes_from_the_recipe():
    recipe = load_recipe(DEFAULT, ["async.max_staleness=0", "rollout.num_engines=2"])
    assert shape_of(recipe) == {"engines": 2, "max_staleness": 0, "shared": True}
    placed = load_recipe(DEFAULT, ["placement.trainer={trainer: 1}"])
    assert shape_of(placed)["shared"] is False
    assert shape_of(load_recipe(DEFAULT), generating_only=True)["max_staleness"] == 0


@pytest.mark.parametrize("value", ["0", "-2", "many", "1.5", "true"])
def test_a_bad_thread_setting_is_one_line_naming_the_field(value):
    with pytest.raises(RecipeError) as err:
        load_recipe(DEFAULT, [f"train.threads={value}"])
    assert str(err.value).count("\n") == 0 and "train.threads" in str(err.value) and "'auto'" in str(err.value)


def test_thread_settings_accept_auto_and_numbers():
    recipe = load_recipe(DEFAULT, ["train.threads=auto", "rollout.cpus=2"])
    assert recipe.train.threads == "auto" and recipe.rollout.cpus == 2
