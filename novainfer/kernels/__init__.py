"""Triton kernels for the GPU path; each has a plain-torch reference in novainfer/attention/torch_backend.py.

Importing this package imports triton, so only the Triton attention backend and the kernel tests do.
"""
