import os
import time

import pytest

from rlactors.environments import BUILTIN_ENVIRONMENTS, load_environment
from rlactors.environments.calculator import CalculatorEnvironment
from rlactors.environments.guess_number import GuessNumberEnvironment
from rlactors.environments.protocol import ToolCall, Turn
from rlactors.environments.python_tool import PythonEnvironment, run_python


def turn(text, *calls, index=0):
    return Turn(text=text, tool_calls=list(calls), turn_index=index, finish_reason="stop")


def calc(expression, name="calc"):
    return ToolCall(name, {"input": expression})


def test_calculator_episode():
    env = CalculatorEnvironment(data_source="synthetic/calculator", ground_truth="2146", extra_info={}, unknown=1)
    assert env.reset() == ""
    result = env.step(turn("[calc 37*58]", calc("37*58")))
    assert (result.observation, result.reward, result.done) == ("=2146\n", 0.0, False)
    assert env.step(turn("2146", index=1)).reward == 1.0
    assert env.step(turn("2146.0")).done
    assert env.step(turn("2146.0")).reward == 1.0
    assert env.step(turn("2147")).reward == 0.0
    assert env.step(turn("no number")).reward == 0.0


def test_calculator_refusals_are_observations():
    env = CalculatorEnvironment(ground_truth="1", extra_info={"environment_kwargs": {"observation_prefix": " -> "}})
    cases = {"__import__('os').system('true')": "not arithmetic", "2**101": "exponent 101 is over 100",
             "10**60": "over 50 digits", "7/0": "division by zero", "1+": "cannot parse", "(-8)**0.5": "not a real"}
    for expression, reason in cases.items():
        observation = env.step(turn("", calc(expression))).observation
        assert observation.startswith(" -> error: ") and reason in observation, expression
    assert env.step(turn("", ToolCall("calculator", {"expression": "6/3"}))).observation == " -> 2\n"
    assert "unknown tool 'web'" in env.step(turn("", calc("1", name="web"))).observation
    assert "bad JSON" in env.step(turn("", ToolCall("", error="bad JSON"))).observation
    two = env.step(turn("", calc("1+1"), calc("2*3"))).observation
    assert two == " -> 2\n -> 6\n"


def test_unknown_setting_is_named():
    with pytest.raises(ValueError, match="unknown environment_kwargs \\['prefix'\\]"):
        CalculatorEnvironment(ground_truth="1", extra_info={"environment_kwargs": {"prefix": "="}})


def test_python_tool_output_and_reward():
    env = PythonEnvironment(ground_truth="703", extra_info={"environment_kwargs": None})
    result = env.step(turn("[python print(sum(range(1,38)))]", ToolCall("python", {"input": "print(sum(range(1,38)))"})))
    assert (result.observation, result.done) == ("=703\n", False)
    assert env.step(turn("703")).reward == 1.0
    error = env.step(turn("", ToolCall("python", {"code": "1/0"}))).observation
    assert error.startswith("=Traceback") and error.endswith("ZeroDivisionError: division by zero\n")


def test_python_timeout_kills_the_group(tmp_path):
    marker = tmp_path / "child.pid"
    code = (f"import subprocess, sys, time\nchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(marker)!r}, 'w').write(str(child.pid))\ntime.sleep(60)")
    start = time.monotonic()
    output = run_python(code, time_limit_s=1.5)
    assert time.monotonic() - start < 10 and "timed out after 1.5 s" in output
    child_pid = int(marker.read_text())
    for _ in range(50):  # the child is killed; its parent (our grandchild's group) reaps it or init does
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        with open(f"/proc/{child_pid}/stat") as stat:
            assert stat.read().split()[2] == "Z"  # a zombie awaiting init is dead


def test_python_memory_limit_and_truncation():
    assert "MemoryError" in run_python("x = bytearray(2 * 1024**3)", memory_limit_bytes=256 * 2**20)
    output = run_python("print('a' * 5000)", max_output_chars=100)
    assert output == "a" * 100 + "...(truncated)"
    mixed = run_python("print('a' * 5000); raise SystemExit('bye')", max_output_chars=100)
    assert mixed.endswith("bye") and len(mixed) < 140


def test_guess_number():
    env = GuessNumberEnvironment(ground_truth="11", extra_info={"environment_kwargs": {"low": 1, "high": 16}})
    assert env.reset() == ""
    assert env.step(turn("8")).observation == "higher\n"
    assert env.step(turn("I say 14")).observation == "lower\n"
    result = env.step(turn("hmm"))
    assert result.observation == "say a number\n" and result.reward == 0.0 and not result.done
    result = env.step(turn("11"))
    assert (result.reward, result.done) == (1.0, True)
    with pytest.raises(ValueError, match="outside 1..16"):
        GuessNumberEnvironment(ground_truth="20", extra_info={})


def test_load_environment(tmp_path):
    assert load_environment("calculator") is CalculatorEnvironment
    assert set(BUILTIN_ENVIRONMENTS) == {"calculator", "python", "guess_number"}
    assert load_environment("rlactors.environments.guess_number:GuessNumberEnvironment") is GuessNumberEnvironment
    module = tmp_path / "my_env.py"
    module.write_text("class Echo:\n    def __init__(self, **kwargs): pass\n    def reset(self): return 'hi'\n")
    assert load_environment(f"{module}:Echo")().reset() == "hi"
    for spec, reason in [("calculater", "not a built-in"), (f"{module}:Missing", "no callable 'Missing'"),
                         (f"{tmp_path}/nope.py:Echo", "no file"), ("no_such_package_x:Env", "No module named")]:
        with pytest.raises(ValueError, match="environment '" + spec.replace(".", "\\.") + "'.*" + reason):
            load_environment(spec)
