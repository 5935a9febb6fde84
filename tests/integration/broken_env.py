"""A deliberately broken environment for the failure tests: it asks the model as single_turn does,
then its scoring raises. Named in a recipe as `tests.integration.broken_env:ScoringFailsEnvironment`
(each env worker process imports it by that name)."""

from __future__ import annotations

from factory.envs.single_turn import SingleTurnEnvironment


class ScoringFailsEnvironment(SingleTurnEnvironment):
    name = "scoring_fails"

    async def run_episode(self, client, model, task, sampling):
        reply = await client.chat.completions.create(model=model, messages=self.prompt_messages(task), **sampling)
        return self.score(reply.choices[0].message.content, task)

    def score(self, answer, task):
        raise ConnectionError(f"reward service unreachable while scoring {task.task_id} (deliberately broken)")
