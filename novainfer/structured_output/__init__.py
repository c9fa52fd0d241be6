"""Structured outputs: grammars compiled once per constraint, one matcher per sequence, token bitmasks for the sampler.

backend.py is the interface, guidance_backend.py the llguidance implementation, manager.py the engine's
handle (what LLMEngine calls when a request arrives, before a step, and when a token is appended).
"""

from novainfer.structured_output.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
