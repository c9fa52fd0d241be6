"""Triton's CPU interpreter, made to patch triton.language once per kernel launch rather than once per call.

The interpreter swaps triton.language's builtins for interpreted ones when a kernel launches (restoring them when
it ends) and again at every call of a @triton.jit helper inside it, though the launch already did: an
`inspect.getmembers` scan over the language modules per call, about half the time of a kernel made of small
helpers (the sampler's draws: 27 s -> 16 s). A helper whose language modules the launch has patched is run as is;
one that sees other modules is patched as the interpreter does. What the kernels compute is unchanged.
"""

from __future__ import annotations

import inspect


def patch_once_per_launch() -> bool:
    """Install the wrapper around the interpreter's _patch_lang; False (nothing changed) where its internals
    differ from the Triton this was written against (3.x)."""
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    patch_lang, scope_type = getattr(interp, "_patch_lang", None), getattr(interp, "_LangPatchScope", None)
    if patch_lang is None or scope_type is None or getattr(patch_lang, "once_per_launch", False):
        return False
    patched: list[frozenset[int] | None] = [None]  # the modules the running launch has patched
    modules_of: dict[object, frozenset[int]] = {}

    def once(fn):
        langs = modules_of.get(fn)
        if langs is None:
            langs = modules_of[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
            )
        if patched[0] is not None and langs <= patched[0]:
            return scope_type()  # nothing to patch, nothing to restore
        scope = patch_lang(fn)
        if patched[0] is None:  # the launch's own scope: forget the modules when it restores them
            restore = scope.restore

            def restore_and_forget() -> None:
                patched[0] = None
                restore()

            scope.restore = restore_and_forget
            patched[0] = langs
        else:
            patched[0] = patched[0] | langs
        return scope

    once.once_per_launch = True
    interp._patch_lang = once
    return True
