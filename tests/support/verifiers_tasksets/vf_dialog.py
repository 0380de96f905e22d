"""Multi-turn: a scripted user asks three questions in turn, each answer bridged onto the conversation so far; the
reward is the fraction of e's over every reply."""

import verifiers.v1 as vf

QUESTIONS = ("Say something.", "Say more.", "And once more.")


class DialogTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def letter_e(self, trace: vf.Trace) -> float:
        text = "".join(m.content or "" for m in trace.assistant_messages)
        return text.count("e") / len(text) if text else 0.0


class DialogEnv(vf.SingleAgentEnv):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            for question in QUESTIONS:
                if (await interaction.turn(question)).terminated:
                    break


class DialogTaskset(vf.Taskset[DialogTask, vf.TasksetConfig]):
    def load(self) -> list[DialogTask]:
        return [DialogTask(vf.TaskData(name=f"dialog-{i}"), self.config.task) for i in range(4)]


__all__ = ["DialogEnv", "DialogTaskset"]
