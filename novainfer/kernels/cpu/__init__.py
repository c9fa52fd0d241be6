"""The CPU backend: C kernels (csrc/) built and loaded by library.py, bound by qgemm.py, ops.py and decoder_stack.py,
and the packed weights they read (repack.py, panel_layout.py, weight_arena.py). Imports no triton."""
