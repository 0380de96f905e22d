"""Tools through a `Toolset`: the task asks for a sum, an MCP tool server (verifiers starts one per rollout, this
module run as `python -m vf_tools`) adds, and the reward is 1 when the final reply carries the tool's result."""

import verifiers.v1 as vf


class AddToolset(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers and return their sum."""
        return str(a + b)


class ToolsTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ToolsData(vf.TaskData):
    a: int
    b: int


class ToolsTask(vf.Task[ToolsData, vf.State, ToolsTaskConfig]):
    @classmethod
    def toolsets(cls, config: ToolsTaskConfig) -> list[vf.Toolset]:
        return [AddToolset(config.tools)]

    @vf.metric
    async def tool_results(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))

    @vf.reward(weight=1.0)
    async def sum_from_the_tool(self, trace: vf.Trace) -> float:
        total = str(self.data.a + self.data.b)
        used = any(str(message.content).strip() == total for message in trace.tool_messages)
        return float(used and total in trace.last_reply)


class ToolsConfig(vf.TasksetConfig):
    num_tasks: int = 4
    task: ToolsTaskConfig = ToolsTaskConfig()


class ToolsTaskset(vf.Taskset[ToolsTask, ToolsConfig]):
    def load(self) -> list[ToolsTask]:
        return [
            ToolsTask(ToolsData(prompt=f"What is {i} + {i + 2}? Use the add tool.", a=i, b=i + 2), self.config.task)
            for i in range(self.config.num_tasks)
        ]


__all__ = ["ToolsTaskset"]

if __name__ == "__main__":
    AddToolset.run()
