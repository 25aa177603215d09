"""gpt-oss's harmony chat format, as a chat template for a gpt-oss model that comes without its own.

Harmony (https://github.com/openai/harmony) writes every message as `<|start|>ROLE<|channel|>CHANNEL<|message|>TEXT`
ended by `<|end|>` (a tool call by `<|call|>`, the last answer by `<|return|>`): a system message that sets the
reasoning effort, a developer message with the instructions and the tools (as a TypeScript namespace), then the
turns. The assistant reasons in the `analysis` channel, answers in `final` and calls tools in `commentary` with
`to=functions.NAME`; engine/load/reply_format.py reads those channels back. Past reasoning is dropped, except
before a tool call the model is still answering (the turns after the last user message), as the format asks.

The template reads `reasoning_effort` (low, medium, high; minimal is low; default medium), as gpt-oss's own does.
A model's own template always wins: this one is only for checkpoints and GGUF files that carry none.
"""
from __future__ import annotations

# Written without whitespace control: the sandbox renders with trim_blocks, so a line break right after a block tag
# is written as an expression ({{ NL }}).
# The JSON schema of a tool's parameters as the TypeScript type harmony shows the model.
_TS_TYPE = (
    "{% macro ts(s) %}"
    "{% if s is not mapping %}any"
    "{% elif s.enum is defined %}{% for v in s.enum %}{{ v | tojson }}{{ ' | ' if not loop.last }}{% endfor %}"
    "{% elif s.anyOf is defined %}{% for v in s.anyOf %}{{ ts(v) }}{{ ' | ' if not loop.last }}{% endfor %}"
    "{% elif s.type == 'string' %}string"
    "{% elif s.type in ('number', 'integer') %}number"
    "{% elif s.type == 'boolean' %}boolean"
    "{% elif s.type == 'null' %}null"
    "{% elif s.type == 'array' %}{{ ts(s['items']) if s['items'] is defined else 'any' }}[]"
    "{% elif s.type == 'object' and s.properties %}{ "
    "{% for k, v in s.properties.items() %}{{ k }}{{ '' if k in (s.required or []) else '?' }}: {{ ts(v) }}"
    "{{ ', ' if not loop.last }}{% endfor %} }"
    "{% elif s.type == 'object' %}object"
    "{% else %}any{% endif %}"
    "{% endmacro %}"
)

_TOOLS = (
    "# Tools{{ NL }}{{ NL }}## functions{{ NL }}{{ NL }}namespace functions {{ '{' }}{{ NL }}{{ NL }}"
    "{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "{% if f.description %}// {{ f.description }}{{ NL }}{% endif %}"
    "type {{ f.name }} = "
    "{% set p = f.parameters %}"
    "{% if p is mapping and p.properties %}(_: {{ '{' }}{{ NL }}"
    "{% for k, v in p.properties.items() %}"
    "{% if v is mapping and v.description %}// {{ v.description }}{{ NL }}{% endif %}"
    "{{ k }}{{ '' if k in (p.required or []) else '?' }}: {{ ts(v) }},{{ NL }}"
    "{% endfor %}{{ '}' }}) => any;{{ NL }}{{ NL }}"
    "{% else %}() => any;{{ NL }}{{ NL }}{% endif %}"
    "{% endfor %}{{ '}' }} // namespace functions"
)

HARMONY_TEMPLATE = (
    "{% set NL = '\\n' %}" + _TS_TYPE
    + "{% set effort = reasoning_effort if reasoning_effort in ('low', 'medium', 'high') else "
      "('low' if reasoning_effort == 'minimal' else 'medium') %}"
    "{% set ns = namespace(last_user=-1, calls=[], answered=0, instructions=[]) %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% if m.role in ('system', 'developer') and m.content %}"
    "{% set ns.instructions = ns.instructions + [m.content] %}{% endif %}"
    "{% endfor %}"
    "<|start|>system<|message|>Knowledge cutoff: 2024-06{{ NL }}{{ NL }}Reasoning: {{ effort }}{{ NL }}{{ NL }}"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{% if tools %}{{ NL }}Calls to these tools must go to the commentary channel: 'functions'.{% endif %}"
    "<|end|>"
    "{% if ns.instructions or tools %}<|start|>developer<|message|>"
    "{% if ns.instructions %}# Instructions{{ NL }}{{ NL }}{{ ns.instructions | join(NL + NL) }}"
    "{% if tools %}{{ NL }}{{ NL }}{% endif %}{% endif %}"
    "{% if tools %}" + _TOOLS + "{% endif %}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' and m.tool_calls %}"
    "{% if m.reasoning_content and loop.index0 > ns.last_user %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ m.reasoning_content }}<|end|>{% endif %}"
    "{% if m.content %}<|start|>assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% set ns.calls = m.tool_calls %}{% set ns.answered = 0 %}"
    "{% for c in m.tool_calls %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}<|call|>"
    "{% endfor %}"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'tool' %}"
    "{% set name = m.name if m.name else (ns.calls[ns.answered].function.name "
    "if ns.answered < ns.calls | length else 'tool') %}{% set ns.answered = ns.answered + 1 %}"
    "<|start|>functions.{{ name }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

HARMONY_ARCHITECTURES = ("gpt_oss", "gpt-oss")  # a checkpoint's model_type, a GGUF's general.architecture


def fallback_template(architecture: str | None) -> str | None:
    """The chat template a model of `architecture` gets when it carries none (None: it gets none)."""
    return HARMONY_TEMPLATE if architecture in HARMONY_ARCHITECTURES else None
