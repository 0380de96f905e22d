"""Two agents: a trainable solver answers, then a critic (not trained) reviews the answer; only the solver's traces
train."""

import verifiers.v1 as vf


class DuoTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.stop
    async def one_reply(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def letter_e(self, trace: vf.Trace) -> float:
        reply = trace.last_reply or ""
        return reply.count("e") / len(reply) if reply else 0.0


class DuoConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    critic: vf.AgentConfig = vf.AgentConfig()


class DuoEnv(vf.Env[DuoConfig]):
    async def setup(self, agents: vf.Agents) -> None:
        agents.critic.trainable = False

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        solved = await agents.solver.run(task)
        review = DuoTask(vf.TaskData(prompt=f"Is this a good answer? {solved.last_reply!r}"), task.config)
        await agents.critic.run(review)


class DuoTaskset(vf.Taskset[DuoTask, vf.TasksetConfig]):
    def load(self) -> list[DuoTask]:
        return [DuoTask(vf.TaskData(prompt=f"Write word {i}."), self.config.task) for i in range(4)]


__all__ = ["DuoConfig", "DuoEnv", "DuoTaskset"]
