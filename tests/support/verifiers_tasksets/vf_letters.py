"""Single turn: reply with as many letter e's as you can. The reward is the fraction of e's in the reply, which a
tiny model learns within a few RL steps (tandem's `LetterE`, as a verifiers taskset)."""

import verifiers.v1 as vf


class LettersConfig(vf.TasksetConfig):
    num_tasks: int = 16


class LettersTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.stop
    async def one_reply(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))

    @vf.reward(weight=1.0)
    async def letter_e(self, trace: vf.Trace) -> float:
        reply = trace.last_reply or ""
        return reply.count("e") / len(reply) if reply else 0.0


class LettersTaskset(vf.Taskset[LettersTask, LettersConfig]):
    def load(self) -> list[LettersTask]:
        return [
            LettersTask(vf.TaskData(prompt=f"Write word {i}.", name=f"word-{i % 4}"), self.config.task)
            for i in range(self.config.num_tasks)
        ]


__all__ = ["LettersTaskset"]
