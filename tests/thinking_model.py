"""A tiny random model with a thinking chat template (Qwen3.5 / DeepSeek-R1 style: the prompt opens `<think>`,
`enable_thinking: false` closes it at once) that reads tools and shows Hermes-style calls."""

from tests.tiny_models import make_tiny_model

THINKING_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} {% endfor %}Call one as "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking "
    "is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)
# <tool_call> stays plain text: llguidance's bitmask allows an added non-special token that its own matcher then
# refuses (it files such tokens as special), so a grammar that writes the marker could not run on a Qwen-style one
THINK_TOKENS = ("<think>", "</think>")


CALL_TOKENS = ("<tool_call>", "</tool_call>")  # one token each, as in Qwen's vocabulary


def make_thinking_model(path: str, call_tokens: bool = False) -> str:
    """call_tokens: the call markers are added tokens too (a grammar must then write them as those tokens)."""
    extra = THINK_TOKENS + (CALL_TOKENS if call_tokens else ())
    return make_tiny_model(path, "qwen3", seed=5, extra_tokens=extra, chat_template=THINKING_TEMPLATE)
