"""A tiny random model that speaks harmony (gpt-oss's format): its tokenizer has harmony's special tokens and its
chat template (written here, from the format's public description) renders system, developer, user, assistant
(reasoning, calls, answers) and tool messages, the reasoning effort and the function tools."""

import json
import os

from transformers import AutoTokenizer

from tests.tiny_models import make_tiny_model

HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")

HARMONY_TEMPLATE = """
{%- set ns = namespace(instructions="", tool="") -%}
<|start|>system<|message|>You are a tiny test model.
Reasoning: {{ reasoning_effort | default("medium") }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.
{%- endif %}<|end|>
{%- for m in messages if m.role in ("system", "developer") -%}
{%- set ns.instructions = ns.instructions + m.content -%}
{%- endfor -%}
{%- if ns.instructions or tools -%}
<|start|>developer<|message|>
{%- if ns.instructions %}# Instructions

{{ ns.instructions }}
{%- endif %}
{%- if tools %}

# Tools

## functions

namespace functions {
{% for t in tools %}
// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions
{%- endif %}<|end|>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == "user" -%}
<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == "assistant" -%}
{%- if m.thinking -%}
<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>
{%- endif -%}
{%- if m.content -%}
<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- for c in m.tool_calls or [] -%}
{%- set ns.tool = c.function.name -%}
<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary <|constrain|>json<|message|>
{%- if c.function.arguments is string %}{{ c.function.arguments }}{% else %}{{ c.function.arguments | tojson }}{% endif -%}
<|call|>
{%- endfor -%}
{%- elif m.role == "tool" -%}
<|start|>functions.{{ ns.tool }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}
"""


def make_harmony_model(path: str) -> str:
    """The tiny Llama checkpoint, with harmony's markers as special tokens of its vocabulary and room for tools."""
    make_tiny_model(path, "llama", seed=7, extra_tokens=HARMONY_TOKENS, chat_template=HARMONY_TEMPLATE.strip())
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": list(HARMONY_TOKENS)})
    tok.save_pretrained(path)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["max_position_embeddings"] = 1024  # the tools' schemas take a few hundred tokens of this tiny vocabulary
    with open(config_path, "w") as f:
        json.dump(config, f)
    return path
