"""Lab (session 22): a Qwen3.5 CPU decode step split into the decoder stack's one C call and the LM head (wrappers
from s21/labtime.py), three rounds of 128 tokens. python q35_split.py <Qwen3.5 Q4_K_M GGUF>"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "s21"))
import labtime as lt  # noqa: E402

from novainfer import LLM  # noqa: E402
from novainfer.models import llama  # noqa: E402
from novainfer.worker import cpu_hybrid_stack  # noqa: E402

lt.wrap(cpu_hybrid_stack.CPUHybridStack, "forward", "stack")
lt.wrap(llama.LlamaForCausalLM, "compute_logits", "logits")
llm = LLM(sys.argv[1])
lt.generate_s(llm, 8)
for _ in range(3):
    lt.step_report(llm, 128)
