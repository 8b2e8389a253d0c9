"""kvreuse diagnose: the drift report over a log of prompts, offline, and what fixing its volatile spans saves.

The command runs as users run it (the installed console script, in a subprocess) on crafted logs: plain
prompts with a request id up front, and the chat log docs/observatory.md shows (a date in the system
prompt, a trailing space, a reordered few-shot block). The pieces (reading the log, the fixes, the
simulated cache) are checked in-process on small inputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvreuse.cli import main
from kvreuse.inputs import InputProcessor, common_prefix_length
from kvreuse.observatory.diagnose import (
    ConstantSpan,
    FixedOrder,
    StripWhitespace,
    ToolHeldConstant,
    ToolsInOneOrder,
    fixes_from,
    read_prompts,
    simulate,
)
from kvreuse.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
CHAT_LOG = REPO / "docs" / "examples" / "drift-chats.jsonl"
TOOLS_LOG = REPO / "docs" / "examples" / "drift-tools.jsonl"  # an agent's requests: tools swapped, a dated tool
KVREUSE = Path(sys.executable).parent / "kvreuse"  # the console script pip installed next to this interpreter
RULES = "You answer questions about orders. Be polite and precise. Never invent tracking data. " * 2


def test_read_prompts_forms_and_errors(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text('"plain"\n\n{"prompt": "dict"}\n{"messages": [{"role": "user", "content": "hi"}]}\n'
                   '[{"role": "user", "content": "bare"}]\n')
    prompts = read_prompts(log, chat=True)
    assert [(p.line, p.text) for p in prompts] == [(1, "plain"), (3, "dict"), (4, None), (5, None)]
    assert prompts[3].messages == ({"role": "user", "content": "bare"},)
    with pytest.raises(ValueError, match=r"log.jsonl:4: a message list; pass --chat"):
        read_prompts(log, chat=False)
    log.write_text('"ok"\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match=r"log.jsonl:2: expected a JSON string"):
        read_prompts(log, chat=False)
    log.write_text('"ok"\nnot json\n')
    with pytest.raises(ValueError, match=r"log.jsonl:2: not JSON"):
        read_prompts(log, chat=False)
    log.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        read_prompts(log, chat=False)


def test_fixes_change_only_what_they_name() -> None:
    text = "Today is Friday 2026-11-20.\nOrder 1182 ships on 2026-11-23. \nQ: b\nA: 2\nQ: a\nA: 1"
    held = ConstantSpan("date", "Today is ").apply(text)
    assert held.startswith("Today is <date>.\n") and "ships on 2026-11-23" in held  # other dates stay
    assert StripWhitespace().apply(text + " ") == text.replace(". \n", ".\n")
    ordered = FixedOrder(("Q: b", "A: 2", "Q: a", "A: 1")).apply(text)
    assert ordered.endswith("A: 1\nA: 2\nQ: a\nQ: b") and FixedOrder(("x", "y")).apply(text) == text


def test_logged_tools_and_the_tool_fixes(tmp_path: Path) -> None:
    log = tmp_path / "agent.jsonl"
    tool = {"type": "function", "function": {"name": "hours", "description": "Hours. Today is Monday 2026-11-16."}}
    other = {"type": "function", "function": {"name": "fetch", "parameters": {"type": "object"}}}
    log.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [tool, other]}) + "\n")
    (prompt,) = read_prompts(log, chat=True)
    assert prompt.tools == (tool, other) and prompt.messages == ({"role": "user", "content": "hi"},)
    log.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": {"x": 1}}) + "\n")
    with pytest.raises(ValueError, match=r"agent.jsonl:1: tools must be a list"):
        read_prompts(log, chat=True)

    assert ToolsInOneOrder().apply_tools([tool, other]) == [other, tool] and ToolsInOneOrder().apply("x") == "x"
    changed = json.loads(json.dumps(tool).replace("Monday", "Friday"))
    held = ToolHeldConstant("hours", json.dumps(tool))
    assert held.apply_tools([other, changed]) == [other, tool] and held.label.startswith("tool `hours` sent as first")
    # A text fix reaches the tools' strings too: a date in a description is held as one in a message.
    (fixed, _) = ConstantSpan("date", "Today is ").apply_tools([changed, other])
    assert fixed["function"]["description"] == "Hours. Today is <date>."

    # What a report's tools group suggests: one order for moved tools; a changed tool held, unless a volatile
    # span there has its own fix.
    group = {"volatile": [], "whitespace_only": False, "reordered_lines": None,
             "tools": {"moved": ["fetch", "hours"], "changed": [{"name": "hours", "path": "description",
                                                                 "change": "changed"}]}}
    assert fixes_from({"groups": [group]}, {"hours": tool}) == [ToolsInOneOrder(), held]
    assert fixes_from({"groups": [group]}) == [ToolsInOneOrder()]


def test_simulated_cache_reuses_as_the_engine() -> None:
    """Full blocks are cached, a hit may end inside a block, and never covers the last token."""
    first = list(range(10))
    result = simulate([first, first, first[:6] + [99, 98, 97]], block_size=4)
    # 2nd: the 8 tokens of the two full blocks; 3rd: block 0 whole and 2 tokens of block 1.
    assert (result.prompt_tokens, result.hit_tokens) == (29, 8 + 6)
    (record,) = result.drift.records
    assert record.position == 6 and list(record.cached_after) == [6, 7]


def test_the_cli_refuses_bad_input_naming_the_line(tmp_path: Path, tiny_model: Path, capsys) -> None:
    log = tmp_path / "chats.jsonl"
    log.write_text('[{"role": "user", "content": "hi"}]\n')
    assert main(["diagnose", str(log), "--tokenizer", str(tiny_model)]) == 2
    assert "chats.jsonl:1: a message list; pass --chat" in capsys.readouterr().err


def test_console_script_on_plain_and_chat_logs(tmp_path: Path, tiny_model: Path) -> None:
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"prompt": f"Request id: req_{index}f3k{index}l9x\n{RULES}\nQuestion {index}: "
                                                   "where is my parcel?"}) + "\n" for index in range(5)))
    runs = {name: subprocess.Popen([str(KVREUSE), "diagnose", str(log), "--tokenizer", str(tiny_model), *extra,
                                    "--json", str(tmp_path / f"{name}.json")],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for name, log, extra in (("plain", plain, []), ("chat", CHAT_LOG, ["--chat"]))}
    outputs = {name: process.communicate(timeout=120)[0] for name, process in runs.items()}
    for name, process in runs.items():
        assert process.returncode == 0, outputs[name]

    # Plain prompts: the request id up front; holding it constant reuses the rest up to the question number.
    output = outputs["plain"]
    assert "5 prompts" in output and "ideal hit rate" in output
    assert "4 requests of the prefix starting 'Request id: req_' diverge at token" in output, output
    assert "id 'req_4f3k4l9x' (this prompt)" in output and "move the id" in output
    result = json.loads((tmp_path / "plain.json").read_text())
    fix, number = result["fixes"]
    assert fix["fix"] == "the id after 'Request id:' held constant (moved to the end)" and fix["round"] == 1
    assert fix["hit_rate"] > result["hit_rate"] + 0.5, result
    # Once the id is held, the question number (the questions are otherwise the same) is the next drift.
    assert number["fix"] == "the number after 'Question' held constant (moved to the end)" and number["round"] == 2
    assert number["hit_rate"] > fix["hit_rate"]

    # The chat log of docs/observatory.md: the date first, then (once the date is held) the others.
    output = outputs["chat"]
    tokenizer = Tokenizer(tiny_model)
    inputs = InputProcessor(tokenizer)
    ids = [inputs.from_messages(prompt.messages).token_ids for prompt in read_prompts(CHAT_LOG, chat=True)]
    date_position = common_prefix_length(ids[-1], ids[0])
    assert tokenizer.decode(ids[-1][date_position:date_position + 3]).startswith(" Sat")
    assert (f"5 requests of the prefix starting 'system You are the support assistant of Northwind Books.' "
            f"diverge at token {date_position}, where the text changes ('Monday 2026-11-16' / 'Saturday 2026-11-21')"
            in output), output
    assert "(whitespace)" in output and "('polite.\\n' / 'polite. \\n')" in output
    result = json.loads((tmp_path / "chat.json").read_text())
    assert [fix["fix"] for fix in result["fixes"]] == [
        "the date after 'Books. Today is' held constant (moved to the end)", "trailing whitespace stripped",
        "the 4 reordered lines starting 'Q: Can I pay by card?' in one fixed order"]
    assert [fix["round"] for fix in result["fixes"]] == [1, 1, 2]
    rates = [result["hit_rate"]] + [fix["hit_rate"] for fix in result["fixes"]]
    assert rates == sorted(rates) and rates[-1] > rates[0] + 0.4, rates
    assert result["drift_after_fixes"][0]["groups"][0]["kinds"] == ["reordered"]


def test_console_script_names_the_tools_of_an_agent_log(tmp_path: Path, tiny_model: Path) -> None:
    """The agent log of docs/observatory.md: every third request lists two tools the other way round, and a
    tool's description carries the date. The report names both tools, the changed field, and the fixes."""
    output = subprocess.run([str(KVREUSE), "diagnose", str(TOOLS_LOG), "--tokenizer", str(tiny_model), "--chat",
                             "--json", str(tmp_path / "tools.json")],
                            capture_output=True, text=True, timeout=120, check=True).stdout
    prompts = read_prompts(TOOLS_LOG, chat=True)
    inputs = InputProcessor(Tokenizer(tiny_model))
    ids = [inputs.from_messages(list(prompt.messages), tools=list(prompt.tools)).token_ids for prompt in prompts]
    result = json.loads((tmp_path / "tools.json").read_text())
    swapped, dated = result["drift"]["groups"][:2]
    assert swapped["position"] == common_prefix_length(ids[2], ids[1]), swapped
    assert swapped["tools"]["summary"] == ["tools `search_catalog` and `fetch_page` swapped"]
    assert swapped["tools"]["request_tools"][:2] == ["fetch_page", "search_catalog"] and swapped["kinds"] == ["tools"]
    assert (swapped["cached_text"], swapped["request_text"]) == ("search_catalog", "fetch_page")
    assert dated["position"] == common_prefix_length(ids[4], ids[3]), dated
    assert dated["kinds"] == ["date", "tools"] and dated["request_text"] == "Tuesday 2026-11-17"
    assert dated["tools"]["changed"] == [{"name": "opening_hours", "path": "description", "change": "changed"}]
    assert ("(tools); tools `search_catalog` and `fetch_page` swapped" in output
            and "(date, tools); tool `opening_hours`: description changed" in output), output
    assert "tools: this prompt lists fetch_page, search_catalog, opening_hours, order_status; the cached one" in output
    assert [fix["fix"] for fix in result["fixes"]] == [
        "the tool list in one fixed order (sorted by name)",
        "the date after 'of a branch. Today is' held constant (moved to the end)"]
    rates = [result["hit_rate"]] + [fix["hit_rate"] for fix in result["fixes"]]
    assert rates == sorted(rates) and rates[-1] > rates[0] + 0.15, rates
    # Once both are fixed, what is left diverges where the users' questions start: nothing lost.
    assert all(group["tokens_lost_per_request"] == 0 for group in result["drift_after_fixes"][-1]["groups"])
