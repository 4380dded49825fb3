"""The environment and tool API (mmrl.envs): parser formats, built-in tools, registry."""

import pytest
from PIL import Image

from mmrl.envs import get_environment
from mmrl.envs.builtin import ToolEnvironment
from mmrl.envs.tools import ToolCall, ToolError, calculator, get_tool, parse_tool_calls, zoom


def test_parser_reads_each_format():
    qwen = 'I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    assert parse_tool_calls(qwen) == [ToolCall("calculator", {"expression": "2*3"})]
    mistral = '[TOOL_CALLS][{"name": "zoom", "arguments": "{\\"x\\": 0.25}"}]'
    assert parse_tool_calls(mistral) == [ToolCall("zoom", {"x": 0.25})]
    llama = '{"name": "zoom", "parameters": {"size": 0.5}}'
    assert parse_tool_calls(llama) == [ToolCall("zoom", {"size": 0.5})]
    assert parse_tool_calls("zoom(x=0.5, y=1) then calc(1+2)", known=["zoom", "calc"]) == [
        ToolCall("zoom", {"x": 0.5, "y": 1}), ToolCall("calc", {"input": "1+2"})]
    assert parse_tool_calls("zoom()", known=["zoom"]) == [ToolCall("zoom", {})]
    assert parse_tool_calls("the answer is 3") == []
    assert parse_tool_calls("print(3)", known=["zoom"]) == []  # unknown names are text
    with pytest.raises(ToolError, match="not JSON"):
        parse_tool_calls("<tool_call>{name: zoom}</tool_call>")


def test_calculator():
    assert calculator({"expression": "(2 + 3) * 4 - 1"}, {}) == "19"
    assert calculator({"input": "7 / 2"}, {}) == "3.5"
    for bad, message in (("__import__('os')", "not arithmetic"), ("1/0", "division by zero"), ("2 +", "parse")):
        with pytest.raises(ToolError, match=message):
            calculator({"expression": bad}, {})


def test_zoom_crops_the_full_resolution_image():
    image = Image.new("RGB", (100, 60), "white")
    image.paste((255, 0, 0), (50, 30, 100, 60))  # bottom-right quarter red
    (part,) = zoom({"x": 0.75, "y": 0.75, "size": 0.5}, {"images": [image]})
    assert part["type"] == "image" and part["image"].size == (50, 30)
    assert part["image"].getpixel((10, 10)) == (255, 0, 0)
    assert zoom({}, {"images": [image]})[0]["image"] is image  # the whole image: no copy
    assert zoom({"x": 0.2, "size": 1}, {"images": [image]})[0]["image"] is image
    assert zoom({"size": 0.9}, {"images": [image]})[0]["image"] is not image
    with pytest.raises(ToolError, match="no image 1"):
        zoom({"image": 1}, {"images": [image]})
    with pytest.raises(ToolError, match="size"):
        zoom({"size": 2}, {"images": [image]})


def _row():
    image = Image.new("RGB", (56, 56), "white")
    image.paste((0, 0, 0), (20, 20, 36, 36))
    return {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
            "images": [image], "answer": "1"}


def test_tool_environment_replies_with_an_image_and_counts():
    env = get_environment("tools", tools=["zoom", "calculator"], max_calls=2, thumbnail=7)()
    messages = env.reset(_row())
    shown = messages[0]["content"][0]["image"]
    assert shown.size == (56, 56) and shown.getpixel((28, 28)) != (0, 0, 0)  # detail lost
    reply, done, reward = env.step([*messages, {"role": "assistant", "content": "zoom()"}])
    assert not done and reward is None and reply[0]["role"] == "tool"
    assert reply[0]["content"][0]["image"].getpixel((28, 28)) == (0, 0, 0)  # the original
    reply, done, _ = env.step([*messages, {"role": "assistant", "content": "calculator(expression='1/0')"}])
    assert reply == [{"role": "tool", "content": "error: division by zero"}] and not done
    assert (env.tool_calls, env.tool_errors) == (2, 1)
    assert env.step([*messages, {"role": "assistant", "content": "zoom()"}]) == ([], True, None)  # budget
    assert env.step([*messages, {"role": "assistant", "content": "1"}]) == ([], True, None)  # an answer


def test_registry_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown environment 'maze'"):
        get_environment("maze")
    with pytest.raises(ValueError, match="environment 'tools'.*max_turns"):
        get_environment("tools", max_turns=3)
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg'"):
        get_tool("no_such_pkg:fn")
    assert get_environment("mmrl.envs.builtin:SingleTurn")().step([]) == ([], True, None)
    assert isinstance(get_environment(ToolEnvironment, tools=["zoom"])(), ToolEnvironment)


def test_thumbnail_share_is_the_same_for_a_row_every_time():
    env = ToolEnvironment(tools=["zoom"], thumbnail=1, thumbnail_share=0.5)
    rows = []
    for shade in range(40):
        image = Image.new("RGB", (56, 56), "white")
        image.paste((shade * 5, 0, 0), (0, 0, 28, 56))
        rows.append({"prompt": [{"role": "user", "content": [{"type": "image"}]}], "images": [image]})
    shown = [[ToolEnvironment(tools=["zoom"], thumbnail=1, thumbnail_share=0.5).reset(r)[0]["content"][0]["image"]
              for _ in range(2)] for r in rows]
    blurred = [a.getpixel((0, 0)) != r["images"][0].getpixel((0, 0)) for (a, _), r in zip(shown, rows)]
    assert all(a.tobytes() == b.tobytes() for a, b in shown)
    assert 5 < sum(blurred) < 35  # about half
    with pytest.raises(ValueError, match="thumbnail_share"):
        ToolEnvironment(thumbnail_share=2)
    assert env.thumbnail_share == 0.5


def test_restate_puts_the_question_after_a_reply_image():
    env = ToolEnvironment(tools=["zoom"], max_calls=1, restate=True, reply_role="user")
    messages = env.reset(_row())
    reply, done, _ = env.step([*messages, {"role": "assistant", "content": "zoom()"}])
    parts = reply[0]["content"]
    assert [p["type"] for p in parts] == ["image", "text"] and parts[1]["text"] == "What?" and not done
    # An error reply is text, then the question.
    env = ToolEnvironment(tools=["calculator"], max_calls=1, restate=True)
    env.reset(_row())
    reply, _, _ = env.step([{"role": "assistant", "content": "calculator(expression='1/0')"}])
    assert reply[0]["content"] == "error: division by zero"  # tool errors are not replies to restate
    plain = ToolEnvironment(tools=["zoom"], max_calls=1)
    plain.reset(_row())
    assert len(plain.step([{"role": "assistant", "content": "zoom()"}])[0][0]["content"]) == 1


def test_tool_use_reward_pays_an_answer_after_a_tool_reply_only():
    def episode(*turns, **options):
        env = ToolEnvironment(tools=["zoom"], max_calls=1, tool_use_reward=0.3, **options)
        messages, rewards = env.reset(_row()), []
        for turn in turns:
            messages.append({"role": "assistant", "content": turn})
            reply, done, reward = env.step(messages)
            rewards.append(reward)
            messages += reply
        return rewards, done

    assert episode("3") == ([None], True)  # a direct answer: nothing
    assert episode("zoom()", "3") == ([None, 0.3], True)  # zoomed, then answered
    assert episode("zoom()", "zoom()") == ([None, None], True)  # past the budget: no answer, nothing
    assert episode("zoom(size=2)", "3") == ([None, None], True)  # the call failed: no reply, nothing


def test_opening_calls_and_hidden_images():
    env = ToolEnvironment(tools=["zoom"], max_calls=0, thumbnail=7, reply_role="user", opening_calls=["zoom()"])
    messages = env.reset(_row())
    assert [m["role"] for m in messages] == ["user", "assistant", "user"] and messages[1]["content"] == "zoom()"
    assert messages[2]["content"][0]["image"].getpixel((28, 28)) == (0, 0, 0)  # the original, not the thumbnail
    assert (env.tool_calls, env.tool_errors) == (0, 0)  # the environment's calls are not the policy's
    with pytest.raises(ValueError, match="opening_calls: 'look\\(\\)' is not a call of a tool here"):
        ToolEnvironment(tools=["zoom"], opening_calls=["look()"]).reset(_row())
    hidden = ToolEnvironment(tools=["zoom"], hide_images=True, reply_role="user")
    messages = hidden.reset(_row())
    assert [p["type"] for p in messages[0]["content"]] == ["text"]
    reply, done, _ = hidden.step([*messages, {"role": "assistant", "content": "zoom()"}])
    assert reply[0]["content"][0]["image"].size == (56, 56) and not done  # the tool still sees the image
