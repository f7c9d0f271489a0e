"""What the pieces that recompile one of vLLM's methods from its own source
share (``schedule_running``, ``process_outputs``): the method's syntax tree,
the names a block assigns, and compiling a changed tree back into vLLM's
module."""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from typing import Any


def function_tree(method: Any) -> tuple[ast.Module, ast.FunctionDef, str]:
    """(module tree, the def, source file) of ``method``, its line numbers
    those of vLLM's file.  ValueError where the source is not a def."""
    source = textwrap.dedent(inspect.getsource(method))
    tree = ast.parse(source)
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef):
        raise ValueError(f"{method.__qualname__}'s source is not a def")
    ast.increment_lineno(tree, method.__code__.co_firstlineno - 1)
    return tree, function, inspect.getsourcefile(method) or "<vllm>"


def assigned(statements: list[ast.stmt]) -> set[str]:
    """The names ``statements`` assign."""
    return {node.id for statement in statements for node in ast.walk(statement)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}


def compile_in_module(tree: ast.Module, filename: str, owner: Any,
                      closure: dict[str, Any]) -> Any:
    """The one def of ``tree``, compiled in ``owner``'s module (its globals:
    vLLM's names, live), with ``closure``'s names as its free variables."""
    function = tree.body[0]
    outer = ast.FunctionDef(
        name="_fastbatch_make", args=ast.arguments(
            posonlyargs=[], args=[ast.arg(arg=name) for name in closure], kwonlyargs=[],
            kw_defaults=[], defaults=[]),
        body=[function, ast.Return(value=ast.Name(id=function.name, ctx=ast.Load()))],
        decorator_list=[], returns=None, type_params=[])
    module = ast.Module(body=[outer], type_ignores=[])
    ast.copy_location(outer, function)
    ast.fix_missing_locations(module)
    namespace: dict[str, Any] = {}
    exec(compile(module, filename, "exec", dont_inherit=True),
         vars(sys.modules[owner.__module__]), namespace)
    return namespace["_fastbatch_make"](*closure.values())
