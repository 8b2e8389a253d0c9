"""``kvreuse diagnose PROMPTS.jsonl --tokenizer DIR [--chat]``: the drift report before a deployment.

A log of prompts (one per line: a JSON string, ``{"prompt": ...}``, or with ``--chat``
``{"messages": [...]}`` (with the request's ``"tools"`` when it had some) / a bare message list, rendered
with the tokenizer folder's chat template through kvreuse's own InputProcessor) runs, in order, through
the engine's own prefix index (`PrefixIndex`, unbounded: nothing is evicted), so matching, the
partial-block reuse and the divergence of each miss are exactly the engine's. The misses go into the
engine's `DriftLog`, whose report names the top divergence points, the volatile spans there and the
tools that changed or moved. Then each fix the report suggests (a volatile span held constant, which is
what moving it to the end of the prompt achieves for the prefix; trailing whitespace stripped; a
reordered block in one fixed order; the tools in one order; a tool whose definition changed sent as the
log first has it) is applied to every prompt of the log and the log is simulated again: the difference
in hit rate is what the fix would save.

Torch-free: only a tokenizer is loaded, never a model.
"""

from __future__ import annotations

import argparse
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvreuse.cache.blocks import BlockPool
from kvreuse.cache.hashing import extend_block_keys, namespace_key
from kvreuse.cache.prefix import PrefixIndex
from kvreuse.observatory.drift import DriftLog, cached_continuation
from kvreuse.observatory.scope import ALL, NamespaceOwners
from kvreuse.observatory.volatile import TEMPORAL, find_volatile_spans

DEFAULT_TOP = 5
CONTEXT_CHARS = 24  # text before a volatile span that identifies the field it fills (same line only)
MAX_FIXES = 8
FIX_ROUNDS = 3  # rounds of "fix what the report names, report again"


# --- the log ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoggedPrompt:
    """One line of the log: a plain prompt, or a conversation rendered with the chat template."""

    line: int
    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None  # the request's tools (OpenAI's shape), for the template


def read_prompts(path: Path, chat: bool) -> list[LoggedPrompt]:
    """The prompts of a JSONL log; a line that is neither a prompt nor (with ``chat``) a conversation is
    a ValueError naming the line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error})") from None
        tools = None
        if isinstance(value, dict) and "messages" in value:
            tools = value.get("tools")
            if tools is not None and not isinstance(tools, list):
                raise ValueError(f"{path}:{number}: tools must be a list of tools")
            value = value["messages"]
        if isinstance(value, list):
            if not chat:
                raise ValueError(f"{path}:{number}: a message list; pass --chat to render conversations with the "
                                 "tokenizer's chat template")
            prompts.append(LoggedPrompt(number, messages=tuple(value), tools=tuple(tools) if tools else None))
        elif isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("prompt"), str)):
            prompts.append(LoggedPrompt(number, text=value if isinstance(value, str) else value["prompt"]))
        else:
            shapes = 'a JSON string, {"prompt": "..."}' + (', a message list or {"messages": [...]}' if chat else "")
            raise ValueError(f"{path}:{number}: expected {shapes}")
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


# --- fixes: what the report suggests, applied to every prompt ----------------------------------------------


class Fix(ABC):
    """A change to every prompt: to its text (each message's content for conversations), or to its tools."""

    label: str

    @abstractmethod
    def apply(self, text: str) -> str:
        """The text with this fix applied."""

    def apply_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation's tools with this fix applied: a text fix changes every string in them (a date in
        a tool's description is held constant as one in the system prompt is)."""
        return [_map_strings(tool, self.apply) for tool in tools]


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {key: _map_strings(item, change) for key, item in value.items()}
    if isinstance(value, list):
        return [_map_strings(item, change) for item in value]
    return value


def tool_name(tool: Any) -> str | None:
    """A logged tool's name: OpenAI's ``{"function": {"name"}}`` or a bare ``{"name"}``."""
    if not isinstance(tool, dict):
        return None
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else tool.get("name")
    return name if isinstance(name, str) else None


@dataclass(frozen=True)
class ConstantSpan(Fix):
    """Hold a volatile field constant: every span of its kind after the same text on its line."""

    kind: str
    context: str  # the text just before the span on its line (may be empty: the span starts the line)

    @property
    def label(self) -> str:
        where = f"after {self.context.strip()!r}" if self.context.strip() else "at the start of a line"
        return f"the {self.kind} {where} held constant (moved to the end)"

    def _same_kind(self, kind: str) -> bool:
        return kind == self.kind or (kind in TEMPORAL and self.kind in TEMPORAL)

    def apply(self, text: str) -> str:
        pieces, last = [], 0
        for span in find_volatile_spans(text):
            line = text[:span.start].rsplit("\n", 1)[-1]
            if self._same_kind(span.kind) and line.endswith(self.context):
                pieces += [text[last:span.start], f"<{self.kind}>"]
                last = span.end
        return "".join(pieces) + text[last:]


@dataclass(frozen=True)
class StripWhitespace(Fix):
    label: str = "trailing whitespace stripped"

    def apply(self, text: str) -> str:
        return re.sub(r"[ \t]+(?=\n)", "", text).rstrip(" \t")


@dataclass(frozen=True)
class FixedOrder(Fix):
    """Put a block of lines that comes in several orders into one (sorted) order."""

    lines: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"the {len(self.lines)} reordered lines starting {self.lines[0][:30]!r} in one fixed order"

    def apply(self, text: str) -> str:
        lines, wanted, size = text.split("\n"), sorted(self.lines), len(self.lines)
        for start in range(len(lines) - size + 1):
            if sorted(lines[start:start + size]) == wanted:
                lines[start:start + size] = wanted
        return "\n".join(lines)


@dataclass(frozen=True)
class ToolsInOneOrder(Fix):
    """Send the tools in one order (sorted by name) whatever order a request had them in."""

    label: str = "the tool list in one fixed order (sorted by name)"

    def apply(self, text: str) -> str:
        return text

    def apply_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return sorted(tools, key=lambda tool: tool_name(tool) or "")


@dataclass(frozen=True)
class ToolHeldConstant(Fix):
    """Send one tool with the same definition every time: the one the log first has."""

    name: str
    definition: str  # that tool as JSON (a frozen dataclass holds no dict)

    @property
    def label(self) -> str:
        return f"tool `{self.name}` sent as first logged (its definition held constant)"

    def apply(self, text: str) -> str:
        return text

    def apply_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [json.loads(self.definition) if tool_name(tool) == self.name else tool for tool in tools]


def fixes_from(report: dict[str, Any], first_tools: dict[str, dict[str, Any]] | None = None) -> list[Fix]:
    """The fixes the report's groups suggest, in the report's order, each once. ``first_tools``: each tool's
    first logged definition, by name (what a tool whose definition changed is held to)."""
    fixes: list[Fix] = []
    for group in report["groups"]:
        for span in group["volatile"]:
            line = span["context"][:span["start"]].rsplit("\n", 1)[-1]
            context = line[-CONTEXT_CHARS:]
            if len(line) > CONTEXT_CHARS and " " in context:  # start at a word
                context = context[context.index(" ") + 1:]
            fixes.append(ConstantSpan(span["kind"], context))
        if group["whitespace_only"]:
            fixes.append(StripWhitespace())
        if group.get("reordered_lines"):
            fixes.append(FixedOrder(tuple(group["reordered_lines"])))
        tools = group.get("tools")
        if tools:
            if tools["moved"]:
                fixes.append(ToolsInOneOrder())
            for change in tools["changed"]:
                # A volatile span found there has its own fix, which keeps the rest of the tool as sent.
                if first_tools and change["name"] in first_tools and not group["volatile"]:
                    fixes.append(ToolHeldConstant(change["name"], json.dumps(first_tools[change["name"]])))
    return list(dict.fromkeys(fixes))[:MAX_FIXES]


# --- simulation ------------------------------------------------------------------------------------------


@dataclass
class Simulation:
    prompt_tokens: int
    hit_tokens: int
    drift: DriftLog

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


NAMESPACE = namespace_key(None, None, "kvreuse diagnose")


def simulate(token_lists: Sequence[Sequence[int]], block_size: int) -> Simulation:
    """Run the prompts in order through an unbounded prefix index: each reuses the longest cached prefix
    (as the engine: full blocks, then part of a block; never the last token) and leaves its full blocks
    cached. Misses go to a DriftLog as the engine records them."""
    pool = BlockPool(max(1, sum(len(tokens) // block_size for tokens in token_lists)))
    index = PrefixIndex(pool, block_size)
    drift = DriftLog()
    prompt_tokens = hit_tokens = 0
    for tokens in token_lists:
        tokens = list(tokens)
        keys: list[bytes] = []
        extend_block_keys(keys, NAMESPACE, tokens, block_size)
        match = index.match(NAMESPACE, tokens, keys, len(tokens) - 1)
        prompt_tokens += len(tokens)
        hit_tokens += match.num_tokens
        if match.num_tokens < len(tokens) - 1:
            divergence = index.divergence(NAMESPACE, tokens, match)
            drift.record(NAMESPACE, tokens, divergence.position,
                         cached_continuation(index, NAMESPACE, match, divergence))
        parent = match.nodes[-1] if match.nodes else None
        nodes = list(match.nodes)
        for block in range(match.num_blocks, len(keys)):
            block_id = pool.allocate(1)[0]
            parent = index.insert(NAMESPACE, parent, keys[block], tokens[block * block_size:(block + 1) * block_size],
                                  block_id)
            nodes.append(parent)
            pool.release(block_id)  # cached and idle, as a finished request leaves it
        index.touch(nodes)
    return Simulation(prompt_tokens, hit_tokens, drift)


# --- the command -----------------------------------------------------------------------------------------


class Diagnosis:
    """Tokenizes a log (with or without fixes), simulates it and reports."""

    def __init__(self, prompts: list[LoggedPrompt], tokenizer_dir: str, block_size: int) -> None:
        from kvreuse.inputs import InputProcessor
        from kvreuse.tokenizer import Tokenizer

        if block_size < 1:
            raise ValueError(f"--block-size must be at least 1, got {block_size}")
        self.prompts = prompts
        self.tokenizer = Tokenizer(tokenizer_dir)
        self.inputs = InputProcessor(self.tokenizer)  # no length / vocabulary limits: nothing runs a model
        self.block_size = block_size

    def first_tools(self) -> dict[str, dict[str, Any]]:
        """Each tool's definition as the log first has it, by name."""
        first: dict[str, dict[str, Any]] = {}
        for prompt in self.prompts:
            for tool in prompt.tools or ():
                name = tool_name(tool)
                if name is not None:
                    first.setdefault(name, tool)
        return first

    def token_lists(self, change: Callable[[str], str] = lambda text: text,
                    change_tools: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] = lambda tools: tools,
                    ) -> list[list[int]]:
        lists = []
        for prompt in self.prompts:
            param = f"line {prompt.line}"
            if prompt.messages is not None:
                messages = [dict(message, content=change(message["content"]))
                            if isinstance(message, dict) and isinstance(message.get("content"), str) else message
                            for message in prompt.messages]
                tools = change_tools(list(prompt.tools)) if prompt.tools else None
                prompt_ids = self.inputs.from_messages(messages, tools=tools, param=param, validate=False).token_ids
                lists.append(prompt_ids)
            else:
                lists.append(self.inputs.from_text(change(prompt.text or ""), param=param, validate=False).token_ids)
        return lists

    def simulate(self, fixes: Sequence[Fix] = ()) -> Simulation:
        def change(text: str) -> str:
            for fix in fixes:
                text = fix.apply(text)
            return text

        def change_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
            for fix in fixes:
                tools = fix.apply_tools(tools)
            return tools

        return simulate(self.token_lists(change, change_tools), self.block_size)

    def report(self, simulation: Simulation, top: int) -> dict[str, Any]:
        return simulation.drift.report(ALL, top, self.tokenizer.decode, _single_owner())

    def run(self, top: int, rounds: int = FIX_ROUNDS) -> dict[str, Any]:
        """The log as it is, then its fixes one by one, each on top of the ones before. A divergence hides
        the ones after it in the same prompt, so once a round's fixes are in, the log is reported again and
        the fixes that report suggests make the next round."""
        logged = self.simulate()
        reports = [self.report(logged, top)]
        first_tools = self.first_tools()
        applied: list[Fix] = []
        outcomes = []
        for round_number in range(1, rounds + 1):
            new = [fix for fix in fixes_from(reports[-1], first_tools) if fix not in applied]
            if not new or len(applied) >= MAX_FIXES:
                break
            fixed = logged
            for fix in new[:MAX_FIXES - len(applied)]:
                applied.append(fix)
                fixed = self.simulate(applied)
                outcomes.append({"fix": fix.label, "round": round_number, "hit_rate": fixed.hit_rate,
                                 "hit_tokens": fixed.hit_tokens, "prompt_tokens": fixed.prompt_tokens,
                                 "hit_rate_gain": fixed.hit_rate - logged.hit_rate})
            reports.append(self.report(fixed, top))
        return {
            "object": "kvreuse.diagnose",
            "prompts": len(self.prompts),
            "block_size": self.block_size,
            "prompt_tokens": logged.prompt_tokens,
            "hit_tokens": logged.hit_tokens,
            "hit_rate": logged.hit_rate,
            "drift": reports[0],
            # Each fix on top of the ones above it (cumulative); "round" 2 fixes were hidden behind round 1's.
            "fixes": outcomes,
            "drift_after_fixes": reports[1:],  # the report after each round of fixes
        }


def _single_owner() -> NamespaceOwners:
    owners = NamespaceOwners()
    owners.add(NAMESPACE, None)
    return owners


def format_diagnosis(result: dict[str, Any]) -> str:
    report = result["drift"]
    lines = [
        f"{result['prompts']:,} prompts, {result['prompt_tokens']:,} prompt tokens, block size {result['block_size']}",
        f"ideal hit rate {result['hit_rate']:.1%} ({result['hit_tokens']:,} of {result['prompt_tokens']:,} prompt "
        "tokens reused by an unbounded prefix cache, in log order)",
        "",
    ]
    if not report["groups"]:
        lines.append("no divergence: every prompt reuses all that an earlier one shares with it")
    else:
        lines.append(f"top divergence points ({report['recorded_misses']:,} misses in {report['num_groups']:,} "
                     "groups, most tokens lost first)")
    for number, group in enumerate(report["groups"], 1):
        lines.append(f"{number}. {group['sentence']}")
        spans = [f"{span['kind']} {span['text']!r} ({'this prompt' if span['side'] == 'request' else 'cached'})"
                 for span in group["volatile"]]
        if spans:
            lines.append(f"   volatile: {', '.join(spans)}")
        if group["reordered_items"]:
            lines.append(f"   reordered: the same {group['reordered_items']} items in another order")
        tools = group.get("tools")
        if tools and tools["request_tools"] != tools["cached_tools"]:  # what changed is in the sentence already
            seen = "" if tools["complete"] else " (as far as the windows kept show)"
            lines.append(f"   tools: this prompt lists {', '.join(tools['request_tools']) or 'none'}; the cached "
                         f"one {', '.join(tools['cached_tools']) or 'none'}{seen}")
        for advice in group["advice"]:
            lines.append(f"   advice: {advice}")
    if result["fixes"]:
        lines += ["", "what fixing them would save (the whole log simulated again, each fix on top of the ones above;",
                  "round 2 fixes what round 1's fixes uncovered)"]
        width = max(len(outcome["fix"]) for outcome in result["fixes"])
        lines.append(f"  round  {'fix':<{width}}  hit rate   change   tokens reused")
        lines.append(f"         {'as logged':<{width}}  {result['hit_rate']:>8.1%}   {'':>6}   "
                     f"{result['hit_tokens']:>13,}")
        for outcome in result["fixes"]:
            lines.append(f"  {outcome['round']:>5}  {outcome['fix']:<{width}}  {outcome['hit_rate']:>8.1%}   "
                         f"{outcome['hit_rate_gain'] * 100:>+6.1f}   {outcome['hit_tokens']:>13,}")
    for number, later in enumerate(result["drift_after_fixes"], 1):
        if later["groups"]:
            lines += ["", f"after fix round {number}, the top divergence point: {later['groups'][0]['sentence']}"]
    return "\n".join(lines)


def add_diagnose_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", metavar="PROMPTS.jsonl",
                        help="one prompt per line: a JSON string or {\"prompt\": ...}; with --chat also "
                             "{\"messages\": [...]} or a bare message list")
    parser.add_argument("--tokenizer", required=True, metavar="DIR",
                        help="model or tokenizer folder (tokenizer.json, and its chat template for --chat)")
    parser.add_argument("--chat", action="store_true",
                        help="render message lists with the tokenizer's chat template (as the server does)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size of the simulated cache (16)")
    parser.add_argument("--top", type=int, default=DEFAULT_TOP, help=f"divergence points shown ({DEFAULT_TOP})")
    parser.add_argument("--json", metavar="OUT", help="also write the whole result as JSON to OUT")


def run_diagnose(args: argparse.Namespace) -> int:
    prompts = read_prompts(Path(args.prompts), args.chat)
    result = Diagnosis(prompts, args.tokenizer, args.block_size).run(max(args.top, 0))
    print(format_diagnosis(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0
