"""The CPU backend: C kernels (csrc/, built at first use by library.py) and the data they read.

    library.py        builds and loads csrc/ once per machine; the kernels' thread count
    qgemm.py          the quantized GEMMs (few-row and panel kernels) and the dequantizer
    ops.py            a decode step's norm, activation, rotary and KV store; decode and prefill attention
    decoder_stack.py  a decode step's whole llama-family decoder stack in one C call
    repack.py         GGUF blocks -> PackedWeight, exactly; panel_layout.py: the panel order the kernels read
    weight_arena.py   the packed weights in one huge-page arena

Imports torch and numpy, never triton, and nothing of the package above it but platform.py.
"""
