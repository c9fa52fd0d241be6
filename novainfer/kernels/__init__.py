"""Kernels: Triton ones for the GPU path in these modules, each with a plain-torch reference in
novainfer/attention/torch_backend.py; the CPU backend's C kernels in cpu/.

Importing one of the Triton modules imports triton, so only the Triton attention backend and the kernel tests do;
this package itself and cpu/ import no triton.
"""
