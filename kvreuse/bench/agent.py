"""The agent workload's parts that are not prompts: the tool list, the messages of each turn, and the
tool calls a streamed reply carries.

An agent sends its system prompt, a tool list (OpenAI ``tools``) and its task; every reply's
``tool_calls`` go back into the history exactly as the server returned them (``arguments`` is the
string it sent, never re-serialised), followed by one ``role: "tool"`` message per call with a
synthetic result, and the next turn is sent. A reply without a tool call (a server that ignores
``tools``) goes back as plain assistant content followed by a user message holding the result, so
the loop still runs; the client counts such replies.

The tool schemas are small and bounded (enums, integers with a range, strings with a short
``maxLength``, every property required, no extra properties), so a call that a grammar forces out of
a random-weight model ends within a few dozen tokens.

A leaf of kvreuse.bench: the workload generator (workloads.py) and the client (client.py) import it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Each entry: (name, description, {property: schema}); every property is required.
_STRING = {"type": "string", "maxLength": 24}
_PATH = {"type": "string", "maxLength": 32}
CATALOGUE: tuple[tuple[str, str, dict[str, dict[str, Any]]], ...] = (
    ("search_documents", "Search the company knowledge base and return the titles and ids of the best matching "
     "documents, most relevant first.",
     {"query": {**_STRING, "description": "Keywords to search for."},
      "top_k": {"type": "integer", "minimum": 1, "maximum": 10, "description": "How many documents to return."},
      "source": {"type": "string", "enum": ["wiki", "tickets", "email", "code"],
                 "description": "Which collection to search."}}),
    ("read_document", "Return the text of one document from the knowledge base, by id, one page at a time.",
     {"document_id": {"type": "integer", "minimum": 1, "maximum": 99999, "description": "The document's id."},
      "page": {"type": "integer", "minimum": 1, "maximum": 50, "description": "Page to return, from 1."}}),
    ("read_file", "Read a file of the checked-out repository and return the requested lines.",
     {"path": {**_PATH, "description": "Path relative to the repository root."},
      "start_line": {"type": "integer", "minimum": 1, "maximum": 5000, "description": "First line, from 1."},
      "num_lines": {"type": "integer", "minimum": 1, "maximum": 200, "description": "How many lines."}}),
    ("list_directory", "List the files and folders of a directory of the repository, with their sizes.",
     {"path": {**_PATH, "description": "Directory relative to the repository root."},
      "recursive": {"type": "boolean", "description": "Descend into subdirectories."}}),
    ("run_sql", "Run a read-only SQL query against the analytics warehouse and return at most 50 rows.",
     {"query": {"type": "string", "maxLength": 32, "description": "A single SELECT statement."},
      "database": {"type": "string", "enum": ["sales", "support", "product"], "description": "Which database."}}),
    ("get_weather", "Get the current weather and a short forecast for a city.",
     {"city": {**_STRING, "description": "City name, e.g. Lisbon."},
      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit."},
      "days": {"type": "integer", "minimum": 1, "maximum": 7, "description": "Days of forecast."}}),
    ("send_email", "Send a short email on the user's behalf. Only use this after the user has confirmed.",
     {"to": {**_STRING, "description": "Recipient address."},
      "subject": {**_STRING, "description": "Subject line."},
      "priority": {"type": "string", "enum": ["low", "normal", "high"], "description": "Delivery priority."}}),
    ("create_ticket", "Open a ticket in the issue tracker and return its number.",
     {"title": {**_STRING, "description": "One-line summary."},
      "component": {"type": "string", "enum": ["api", "web", "billing", "infra"], "description": "Component."},
      "severity": {"type": "integer", "minimum": 1, "maximum": 4, "description": "1 (critical) to 4 (minor)."}}),
    ("update_ticket", "Change the status of an existing ticket and add a comment to it.",
     {"ticket": {"type": "integer", "minimum": 1, "maximum": 99999, "description": "Ticket number."},
      "status": {"type": "string", "enum": ["open", "in_progress", "blocked", "done"], "description": "New status."},
      "comment": {**_STRING, "description": "Comment to add."}}),
    ("calendar_find_slot", "Find free meeting slots shared by a list of people within the next days.",
     {"attendees": {**_STRING, "description": "Comma-separated user names."},
      "duration_minutes": {"type": "integer", "minimum": 15, "maximum": 120, "description": "Meeting length."},
      "within_days": {"type": "integer", "minimum": 1, "maximum": 14, "description": "Search horizon in days."}}),
    ("http_get", "Fetch a web page from an allow-listed domain and return its readable text.",
     {"url": {**_PATH, "description": "Absolute https URL."},
      "max_chars": {"type": "integer", "minimum": 100, "maximum": 4000, "description": "Truncate to this length."}}),
    ("convert_currency", "Convert an amount between two currencies at today's reference rate.",
     {"amount": {"type": "integer", "minimum": 1, "maximum": 1000000, "description": "Amount in whole units."},
      "from_currency": {"type": "string", "enum": ["EUR", "USD", "GBP", "JPY"], "description": "Source currency."},
      "to_currency": {"type": "string", "enum": ["EUR", "USD", "GBP", "JPY"], "description": "Target currency."}}),
    ("get_customer", "Look up a customer account by id: plan, seats, renewal date and open invoices.",
     {"customer_id": {"type": "integer", "minimum": 1, "maximum": 999999, "description": "Account id."},
      "include_invoices": {"type": "boolean", "description": "Also list open invoices."}}),
    ("run_tests", "Run a subset of the repository's test suite and return the failures, if any.",
     {"pattern": {**_STRING, "description": "Test file or name pattern."},
      "timeout_s": {"type": "integer", "minimum": 10, "maximum": 600, "description": "Give up after this long."}}),
    ("translate_text", "Translate a short text between two languages.",
     {"text": {**_PATH, "description": "Text to translate."},
      "target": {"type": "string", "enum": ["en", "fr", "de", "es", "ja"], "description": "Target language."}}),
    ("set_reminder", "Set a reminder for the user at a given time today.",
     {"hour": {"type": "integer", "minimum": 0, "maximum": 23, "description": "Hour, 24-hour clock."},
      "minute": {"type": "integer", "minimum": 0, "maximum": 59, "description": "Minute."},
      "note": {**_STRING, "description": "What to remind the user of."}}),
)


def tool_definition(name: str, description: str, properties: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One OpenAI ``tools`` entry: a function whose parameters are all required, nothing else allowed."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": copy.deepcopy(properties), "required": list(properties),
                       "additionalProperties": False},
    }}


def tools_json_text(tools: Sequence[dict[str, Any]]) -> str:
    """The tool list as the workload stores and sends it (compact JSON, key order kept)."""
    return json.dumps(list(tools), ensure_ascii=False)


def build_tool_list(order: Sequence[int], target_tokens: int, count_tokens: Callable[[str], int],
                    filler: Callable[[int], str]) -> list[dict[str, Any]]:
    """Tools of ``CATALOGUE`` (in ``order``) whose JSON is about ``target_tokens`` tokens long.

    Whole tools are taken while they fit; the rest of the budget goes into "Notes:" sentences of
    ``filler(n)`` words (about n tokens) appended to the descriptions, spread over the tools taken,
    so a long tool list is still a handful of realistic functions. The length is that of the
    compact JSON, within a few percent of the target: a template renders it with its own markup."""
    if target_tokens < 1:
        raise ValueError(f"agent_tools_len must be >= 1, got {target_tokens}")
    entries = [CATALOGUE[index] for index in order]
    tools: list[dict[str, Any]] = []
    for name, description, properties in entries:
        candidate = tools + [tool_definition(name, description, properties)]
        if tools and count_tokens(tools_json_text(candidate)) > target_tokens:
            break
        tools = candidate
    remaining = target_tokens - count_tokens(tools_json_text(tools))
    if remaining <= 0:
        return tools
    # Each " Notes:" sentence costs a few tokens of its own; aim a little low, then top up the last.
    shares = [remaining // len(tools) + (1 if index < remaining % len(tools) else 0) for index in range(len(tools))]
    for tool, share in zip(tools, shares):
        if share > 4:
            tool["function"]["description"] += " Notes:" + filler(share - 4)
    for _ in range(8):
        remaining = target_tokens - count_tokens(tools_json_text(tools))
        if remaining <= 0:
            break
        tools[-1]["function"]["description"] += filler(remaining)
    return tools


def tools_as_system_text(tools: Sequence[dict[str, Any]]) -> str:
    """The tool list written into the system prompt, for servers sent no ``tools`` (the baseline
    that keeps the prompt as long as with tools)."""
    return "\n\n# Tools\nYou may call one of these functions:\n" + "\n".join(
        json.dumps(tool, ensure_ascii=False) for tool in tools)


# --------------------------------------------------------------------------------------------------
# Messages


def first_messages(system_text: str, task_text: str) -> list[dict[str, Any]]:
    """Turn 0: the system prompt and the task."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_text}] if system_text else []
    return messages + [{"role": "user", "content": task_text}]


@dataclass
class AgentReply:
    """What a turn's reply carried: its text and its tool calls, as the server sent them."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def assistant_message(reply: AgentReply) -> dict[str, Any]:
    """The reply as the next turn's history holds it: the tool calls untouched (content null when the
    reply had no text, as OpenAI sends it), or the plain text when there was no call."""
    if reply.tool_calls:
        return {"role": "assistant", "content": reply.content or None,
                "tool_calls": copy.deepcopy(reply.tool_calls)}
    return {"role": "assistant", "content": reply.content}


def followup_messages(reply: AgentReply, result_text: str) -> list[dict[str, Any]]:
    """What the next turn appends after the previous prompt: the assistant message, then one tool
    message per call (``tool_call_id`` from the call) holding ``result_text``; without a call, a user
    message with the result instead."""
    messages = [assistant_message(reply)]
    if reply.tool_calls:
        messages += [{"role": "tool", "tool_call_id": call.get("id", ""), "content": result_text}
                     for call in reply.tool_calls]
    else:
        messages.append({"role": "user", "content": result_text})
    return messages


class ToolCallDeltas:
    """Joins streamed ``delta.tool_calls`` into whole calls, keyed by ``index`` (OpenAI's streaming
    format): ``id`` and ``type`` from the first delta that has them, ``function.name`` and
    ``function.arguments`` concatenated in arrival order, so the arguments are exactly the string
    the server produced."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}

    def add(self, deltas: Any) -> None:
        if not isinstance(deltas, list):
            return
        for position, delta in enumerate(deltas):
            if not isinstance(delta, dict):
                continue
            index = delta.get("index")
            index = index if isinstance(index, int) else position
            call = self._calls.setdefault(index, {"id": "", "type": "", "name": "", "arguments": ""})
            for key in ("id", "type"):
                if delta.get(key) and not call[key]:
                    call[key] = str(delta[key])
            function = delta.get("function")
            if isinstance(function, dict):
                call["name"] += function.get("name") or ""
                arguments = function.get("arguments")
                call["arguments"] += arguments if isinstance(arguments, str) else ""

    def calls(self) -> list[dict[str, Any]]:
        """The calls in index order, shaped as a non-streamed ``message.tool_calls``."""
        return [{"id": call["id"], "type": call["type"] or "function",
                 "function": {"name": call["name"], "arguments": call["arguments"]}}
                for _, call in sorted(self._calls.items())]
