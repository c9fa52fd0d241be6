"""Every function a Triton kernel calls by name is itself a Triton function. The CPU interpreter runs a plain Python
helper inside a kernel without complaint, but the GPU compiler refuses it ("Unsupported function referenced"), so
a missing @triton.jit passes every CPU test and breaks the kernel on a GPU; this reads the kernels' sources."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap

import pytest

import novainfer.kernels


def _jit_functions(module):
    for name, obj in vars(module).items():
        fn = getattr(obj, "fn", None)  # JITFunction and the interpreter's InterpretedFunction wrap .fn
        if callable(fn) and inspect.isfunction(fn) and fn.__module__ == module.__name__:
            yield name, obj


def _modules():
    for info in pkgutil.walk_packages(novainfer.kernels.__path__, "novainfer.kernels."):
        try:
            yield importlib.import_module(info.name)
        except ImportError:  # a kernel module whose backend this machine lacks
            continue


@pytest.mark.parametrize("module", list(_modules()), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_kernels_call_only_triton_functions(module):
    plain = []
    for name, kernel in _jit_functions(module):
        tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                target = kernel.fn.__globals__.get(node.func.id)
                if inspect.isfunction(target):  # not a Triton function (those are objects wrapping .fn)
                    plain.append(f"{name} calls {node.func.id}")
    assert not plain, f"{module.__name__}: plain Python functions called from Triton kernels: {plain}"
