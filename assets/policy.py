"""The base policy: the tiny model built and warm-started by SFT (cached by fingerprint), or `model.path`."""

import json

import dagster as dg

from assets.data import task_dataset
from assets.resources import ProgressResource
from assets.runs import RecipeConfig, calls, user_error


@dg.asset(group_name="policy", deps=[task_dataset], kinds={"pytorch"}, pool="trainer")
def base_policy(context: dg.AssetExecutionContext, config: RecipeConfig,
                progress: ProgressResource) -> dg.MaterializeResult:
    """The policy RL starts from: built once per model+data fingerprint under `<state>/models/`."""
    from factory.model.policy_cache import policy_fingerprint
    from factory.training.base_policy import ensure_base_policy

    recipe = config.load()
    every = max(1, recipe.model.sft_steps // 10)

    def log_sft_step(step: int, total: int, loss: float) -> None:
        if step % every == 0 or step == total:
            context.log.info(f"SFT step {step}/{total} loss {loss:.4f}")

    with progress.bars(recipe.train.steps) as bars:
        try:
            path = ensure_base_policy(recipe, progress=calls(log_sft_step, bars and bars.on_sft_step))
        except FileNotFoundError as err:  # model.path without a model in it
            raise user_error(str(err)) from None
    metadata: dict = {"path": dg.MetadataValue.path(str(path)), "recipe": recipe.name}
    sft = path / "sft.json"
    if sft.is_file():
        info = json.loads(sft.read_text())
        metadata.update({
            "parameters": info.get("parameters"),
            "sft_steps": info.get("sft_steps"),
            "sft_final_loss": info.get("final_loss"),
            "sft_seconds": round(info.get("seconds") or 0.0, 1),
            "fingerprint": info.get("fingerprint"),
        })
    else:
        metadata["source"] = "model.path (not warm-started here)"
    return dg.MaterializeResult(metadata=metadata,
                                data_version=dg.DataVersion(policy_fingerprint(recipe) if not recipe.model.path
                                                            else str(path)))
