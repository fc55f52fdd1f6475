"""What a schema says about its settings besides their types, read from its source: the comment above (or beside) a
field is its help, and the literal bounds of its `problem()` method's range checks (`qie.config.ranges.out_of_range`
and `at_least`) are its range. Read once per class; a class without source (or bounds that are no literals) gives
none, and the form goes without.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import textwrap
import tokenize

Bounds = tuple[float | None, float | None]


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """Field name -> the comment lines right above it (or after it on its line), joined; {} without source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, tuple[bool, str]] = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                alone = token.line.lstrip().startswith("#")  # a line of its own, or after a field on its line
                comments[token.start[0]] = (alone, token.string.lstrip("#").strip())
    except (tokenize.TokenError, SyntaxError):
        return {}
    notes: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while comments.get(line, (False, ""))[0]:
            above.insert(0, comments[line][1])
            line -= 1
        alone, beside = comments.get(node.lineno, (True, ""))
        text = " ".join([*above, beside] if beside and not alone else above)
        if text:
            notes[node.target.id] = text
    return notes


@functools.cache
def field_bounds(cls: type) -> dict[str, Bounds]:
    """Dotted key -> (low, high) from the literal bounds in `cls.problem`'s calls of `out_of_range(key, value, low,
    high)` and `at_least(prefix, [(name, value, low), ...])`; {} where there are none."""
    method = cls.__dict__.get("problem")
    if method is None:
        return {}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    except (OSError, TypeError, SyntaxError):
        return {}
    bounds: dict[str, Bounds] = {}
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
        if call.func.id == "out_of_range" and len(call.args) >= 3:
            key = _literal(call.args[0])
            low = _literal(call.args[2])
            high = _literal(call.args[3]) if len(call.args) > 3 else None
            if isinstance(key, str):
                bounds[key] = (_number(low), _number(high))
        elif call.func.id == "at_least" and len(call.args) == 2:
            prefix, rows = _literal(call.args[0]), call.args[1]
            for row in rows.elts if isinstance(rows, ast.List | ast.Tuple) else []:
                if not (isinstance(row, ast.Tuple) and len(row.elts) == 3):
                    continue  # a starred list of rows built elsewhere has no literal bounds
                name, low = _literal(row.elts[0]), _literal(row.elts[2])
                if isinstance(prefix, str) and isinstance(name, str):
                    bounds[f"{prefix}.{name}"] = (_number(low), None)
    return bounds


def _literal(node: ast.AST) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _number(value: object) -> float | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


__all__ = ["field_bounds", "field_help"]
