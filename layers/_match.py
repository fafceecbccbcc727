"""Deciding whether a piece of transformers code is the code one of our kernels reproduces.

Two checks, both cached by their callers (the hub layers' through :func:`class_verdict`):

* :func:`same_code`: two functions compile to the same bytecode, names and constants (classes
  "copied from" Llama compile to identical code; a different formula does not);
* :func:`statements_digest`: a digest of a function's statements as ``ast.unparse`` prints them
  (docstring dropped), compared with the digest of the transformers version a kernel was written
  against. It catches the reference itself changing in a later transformers, which the first
  check cannot see (every copy would change with it).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import textwrap

import torch


def class_verdict(judge):
    """Decorator for ``judge(cls) -> bool``, a check of a class's code: computed once per class and
    cached; under ``torch.compile`` dynamo calls it while tracing and puts its result into the graph
    as a constant (``torch.compiler.assume_constant_result``) instead of tracing into it. The hub
    layers call such a verdict in ``forward`` (``kernels`` or a ``.train()``/``.eval()`` switch may
    graft them onto any class of their hub name); the judges read source (``inspect``) and frames,
    which dynamo cannot trace, and a traced lookup would break the graph at every layer.

    The returned function has ``cache_clear()`` (tests) and ``judge`` (the undecorated check).
    """
    cache: dict[type, bool] = {}

    @functools.wraps(judge)
    def verdict(cls: type) -> bool:
        ok = cache.get(cls)
        if ok is None:
            ok = cache[cls] = bool(judge(cls))
        return ok

    verdict.cache_clear = cache.clear
    verdict.judge = judge
    return torch.compiler.assume_constant_result(verdict)


def _code_body(code, docstring: bool):
    # Bytecode, names and constants of a code object; nested ones (generator expressions, lambdas)
    # by the same key, so that where they sit in their file (co_firstlineno) does not count.
    consts = code.co_consts[1:] if docstring and code.co_consts and isinstance(code.co_consts[0], str) \
        else code.co_consts
    consts = tuple(_code_body(c, False) if inspect.iscode(c) else c for c in consts)
    return (code.co_code, code.co_names, consts, code.co_varnames, code.co_argcount)


def _code_key(fn):
    # Defaults too: the same code with another default (unsqueeze_dim=2) computes something else.
    return (_code_body(fn.__code__, True), fn.__defaults__, fn.__kwdefaults__)


def same_code(fn, ref) -> bool:
    """True if ``fn`` and ``ref`` are Python functions with the same code (see module docstring)."""
    try:
        return _code_key(fn) == _code_key(ref)
    except AttributeError:  # not a Python function
        return False


def statements_digest(fn) -> str | None:
    """16 hex digits of SHA-256 over ``fn``'s body statements, one per line as ``ast.unparse``
    prints them (docstring dropped), or None when the source cannot be read."""
    try:
        return source_digest(inspect.getsource(fn))
    except (OSError, TypeError, SyntaxError):
        return None


def source_digest(source: str) -> str:
    """:func:`statements_digest` of the first function defined in ``source``.

    Raises:
        SyntaxError: ``source`` is no Python.
    """
    tree = ast.parse(textwrap.dedent(source))
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    text = "\n".join(ast.unparse(s) for s in body)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
