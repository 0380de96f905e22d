"""End to end: real tiny SFT and eval runs, the dashboard serving them, headless Chromium rendering its pages."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from support.fake_openai import FakeServer
from support.runs import run_to_end, tandem_command, tandem_sft
from support.servers import free_port
from tandem.cli import main
from tandem.eval.traces import read_traces
from tandem.testing.progress import spawn

CHROMIUM = shutil.which("chromium")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium)"),
]
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--virtual-time-budget=8000",
]  # fmt: skip


def chromium(tmp_path: Path, *args: str) -> str:
    profile = tmp_path / f"profile-{time.monotonic_ns()}"
    command = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
    return run_to_end(command, watch=[profile]).stdout  # its renderers die with it if it stalls


def answers(url: str) -> bool:
    """Whether a server answers at `url` yet."""
    try:
        httpx.get(url)
    except httpx.TransportError:
        return False
    return True


def reverse_text_rows(path: Path) -> Path:
    from tandem.envs import load_taskset

    with path.open("w") as handle:
        for task in load_taskset("reverse_text", num_tasks=16).tasks():
            messages = [*task.messages(), {"role": "assistant", "content": task.answer}]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return path


def sft_run(outputs: Path, model_dir: Path, data: Path) -> None:
    flags = [
        "--model", str(model_dir), "--model.dtype", "float32", "--data.path", str(data), "--seq-len", "128",
        "--batch-size", "2", "--max-steps", "3", "--output-dir", str(outputs), "--run-name", "tiny-sft",
    ]  # fmt: skip
    tandem_sft(*flags)


def eval_run(outputs: Path) -> Counter:
    """A reverse_text eval against the fake server: right, echoed and timed-out answers. Returns outcome counts."""
    calls = iter(range(1000))
    with FakeServer(answer=lambda messages: str(messages[-1]["content"])[::-1]) as server:
        server.delay = lambda messages: 0.5 if next(calls) % 3 == 0 else 0.0
        common = ["--base-url", f"{server.url}/v1", "--output-dir", str(outputs), "--run-name", "tiny-eval"]
        flags = ["--env.args", "{num_tasks = 6}", "--env.timeout-s", "0.2", "--env.retries.backoff-s", "0.001"]
        assert main(["eval", "reverse_text", *flags, *common]) == 0
    return Counter(record["outcome"] for record in read_traces(outputs / "tiny-eval" / "traces.jsonl"))


def image_eval_run(outputs: Path) -> None:
    """A count_shapes eval (each prompt an image and a question) against the fake server."""
    with FakeServer(answer=lambda messages: "3") as server:
        common = ["--base-url", f"{server.url}/v1", "--output-dir", str(outputs), "--run-name", "shapes-eval"]
        assert main(["eval", "count_shapes", "--env.args", "{num_tasks = 2}", *common]) == 0


def polylines(page: str, chart: str) -> dict[str, tuple[int, int]]:
    """{series label: (points, last step)} of one chart in a dumped DOM."""
    svg = re.search(rf'<svg data-chart="{chart}"[^>]*>.*?</svg>', page, re.S)
    assert svg, f"no {chart} chart"
    found = re.findall(r'<polyline[^>]*data-series="([^"]+)" data-points="(\d+)" data-last-step="(\d+)"', svg.group(0))
    return {label: (int(points), int(last)) for label, points, last in found}


def test_the_dashboard_renders_real_runs_in_chromium(tmp_path, tiny_model_dir, outputs):
    synthetic_rl = outputs / "rl-run"
    outputs = tmp_path / "outputs"
    sft_run(outputs, tiny_model_dir("qwen3"), reverse_text_rows(tmp_path / "reverse_text.jsonl"))
    outcomes = eval_run(outputs)
    image_eval_run(outputs)
    shutil.copytree(synthetic_rl, outputs / "rl-run")  # RL charts: no real RL run is cheap enough here
    assert outcomes["timeout"] >= 1 and outcomes["timeout"] < sum(outcomes.values())

    port = free_port()
    command = tandem_command("dashboard", "--outputs", str(outputs), "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    with spawn(command) as dashboard:
        dashboard.wait_until(lambda: answers(f"{base}/api/runs"), "it answered")
        runs = httpx.get(f"{base}/api/runs").json()["runs"]
        assert {run["name"]: (run["kind"], run["status"]) for run in runs} == {
            "tiny-sft": ("sft", "finished"),
            "tiny-eval": ("eval", "finished"),
            "shapes-eval": ("eval", "finished"),
            "rl-run": ("rl", "finished"),
        }

        index = chromium(tmp_path, "--dump-dom", f"{base}/")
        assert 'href="/run/tiny-sft"' in index and 'href="/eval/tiny-eval"' in index

        run_page = chromium(tmp_path, "--dump-dom", f"{base}/run/tiny-sft")
        assert polylines(run_page, "loss") == {"loss": (3, 3)}
        assert polylines(run_page, "grad_norm") == {"grad norm": (3, 3)}
        assert polylines(run_page, "tokens_per_s") == {"trainer": (3, 3)}
        assert polylines(run_page, "step_time") == {"trainer step": (3, 3)}

        rl_page = chromium(tmp_path, "--dump-dom", f"{base}/run/rl-run")
        assert polylines(rl_page, "reward") == {"overall": (5, 5), "reward/a": (5, 5)}
        assert polylines(rl_page, "masked") == {"low": (5, 5), "high": (5, 5)}
        # async: step 1 alone trains on its own policy's samples (lag 0), later steps on the previous one's
        assert polylines(rl_page, "mismatch_kl") == {
            "lag 0": (1, 1),
            "all tokens": (5, 5),
            "off_policy_kl/lag1": (4, 5),
        }
        assert polylines(rl_page, "staleness") == {"mean staleness": (5, 5)}
        assert polylines(rl_page, "online_eval") == {"eval/a/reward": (1, 2)}
        assert polylines(rl_page, "online_eval_pass") == {"eval/a/pass@1": (1, 2)}
        assert polylines(rl_page, "idle_step") == {"trainer": (5, 5), "inference": (5, 5)}
        assert polylines(rl_page, "idle_total") == {"trainer": (5, 5), "inference": (5, 5)}
        assert polylines(rl_page, "inference_tokens") == {"tokens/s": (4, 15)}  # over seconds up: 0, 5, 10, 15
        assert polylines(rl_page, "inference_queue") == {"running": (4, 15), "waiting": (4, 15)}
        assert 'data-total="10"' in rl_page and len(re.findall(r'<tr data-outcome="', rl_page)) == 10
        assert 'id="rollouts" hidden' not in rl_page and 'id="rollouts" hidden' in run_page  # RL runs only
        step_two = chromium(tmp_path, "--dump-dom", f"{base}/run/rl-run?step=2&source=b")  # filters from the URL
        assert 'data-total="1"' in step_two and re.findall(r'<tr data-outcome="(\w+)"', step_two) == ["truncated"]
        assert "user: reverse 3" in step_two and "esrever 3" in step_two and "esrever 2" not in step_two
        tool_step = chromium(tmp_path, "--dump-dom", f"{base}/run/rl-run?step=5&source=b")  # turns, calls, results
        assert 'assistant: let me compute\n  call calculate({"expression": "6*7"})\ntool calculate: 42\n' in tool_step
        assert "assistant: It is 42." in tool_step

        eval_page = chromium(tmp_path, "--dump-dom", f"{base}/eval/tiny-eval")
        row = re.search(r'<tr data-source="reverse_text">.*?</tr>', eval_page, re.S)
        assert row, eval_page[-2000:]
        for outcome in ("ok", "truncated", "timeout", "error"):
            assert f'<td data-outcome="{outcome}">{outcomes[outcome]}</td>' in row.group(0), (outcome, row.group(0))
        timeouts = chromium(tmp_path, "--dump-dom", f"{base}/eval/tiny-eval?source=reverse_text&outcome=timeout")
        assert f'data-total="{outcomes["timeout"]}"' in timeouts
        assert re.findall(r'<tr data-outcome="(\w+)"', timeouts) == ["timeout"] * outcomes["timeout"]
        summary = json.loads((outputs / "tiny-eval" / "summary.json").read_text())["sources"]["reverse_text"]
        assert summary["outcomes"] == {o: outcomes[o] for o in summary["outcomes"]}
        assert f'data-total="{sum(outcomes.values())}"' in eval_page
        first = next(r for r in read_traces(outputs / "tiny-eval" / "traces.jsonl") if r["outcome"] == "ok")
        assert f"assistant: {first['completion'][0]['content'].splitlines()[0]}" in eval_page
        shapes = chromium(tmp_path, "--dump-dom", f"{base}/eval/shapes-eval")  # the prompt's image, inline
        assert len(re.findall(r'<img src="data:image/png;base64,[^"]+" class="sample-image">', shapes)) == 2
        assert "user: [image]How many" in shapes and "data:image/png;base64" not in re.sub(r"<img[^>]*>", "", shapes)

        pages = [
            ("dashboard-index.png", "/"),
            ("dashboard-sft.png", "/run/tiny-sft"),
            ("dashboard-rl.png", "/run/rl-run"),
        ]
        for name, url in [*pages, ("dashboard-eval.png", "/eval/tiny-eval")]:
            screenshot = tmp_path / name
            chromium(tmp_path, f"--screenshot={screenshot}", "--window-size=1280,1600", f"{base}{url}")
            assert screenshot.stat().st_size > 10_000
            print(f"screenshot: {screenshot}")


def chart_svg(page: str, chart: str) -> str:
    svg = re.search(rf'<svg data-chart="{chart}"[^>]*>.*?</svg>', page, re.S)
    assert svg, f"no {chart} chart"
    return svg.group(0)


def ticks(page: str, chart: str, axis: str) -> list[str]:
    """The tick labels of one axis of a chart in a dumped DOM: the top (or left) end first."""
    return re.findall(rf'<text[^>]*class="tick-{axis}"[^>]*>([^<]*)</text>', chart_svg(page, chart))


def test_axis_ticks_resolve_a_narrow_range_and_resumes_are_marked(tmp_path, outputs):
    """The synthetic RL run: entropy 10.37412 to 10.37416 (three decimals read 10.374 at both ends), and the
    trainer's record of step 4 saying it resumed from step 3's checkpoint."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with spawn(tandem_command("dashboard", "--outputs", str(outputs), "--port", str(port))) as dashboard:
        dashboard.wait_until(lambda: answers(f"{base}/api/runs"), "it answered")
        page = chromium(tmp_path, "--dump-dom", f"{base}/run/rl-run")
    assert ticks(page, "entropy", "y") == ["10.374160", "10.374120"]
    assert ticks(page, "entropy", "x") == ["1", "5"]
    assert ticks(page, "loss", "y") == ["1.00", "0.20"]  # a wide range keeps few decimals
    assert ticks(page, "inference_tokens", "x") == ["0", "15"]
    for chart in ("entropy", "loss", "reward", "staleness"):  # every chart over steps, trainer's or orchestrator's
        assert re.findall(r'<line[^>]*class="resume" data-step="(\d+)"', chart_svg(page, chart)) == ["3"], chart
    assert 'class="resume"' not in chart_svg(page, "inference_tokens")  # over seconds up: no step to mark
    assert "resumed from step 3" in page
