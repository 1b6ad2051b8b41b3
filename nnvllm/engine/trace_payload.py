"""What a trace block sends to the engine (docs/engines.md, "What a trace sends to the engine").

nnsight sends each invoke's code as source with the values of the names it reads from the scope
around it (``nnsight.intervention.serialization.code_reduce``), the model's envoy tree among them.
Two things here make that payload smaller: :func:`trace_blocks_ship_only_what_they_read` leaves out
the names a block assigns before reading them (installed wherever nnvllm's model class is built:
an in-process engine, an isolated client and its server), and :func:`envoys_by_reference` sends the envoys as
``Envoy:<path>`` ids that the engine resolves to its own (:func:`envoy_ids`).
"""

from __future__ import annotations

import ast
import functools

__all__ = ["envoy_ids", "envoys_by_reference", "trace_blocks_ship_only_what_they_read"]


def _stored(target) -> set[str]:
    """The names an assignment target binds (an attribute or a subscript binds none)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(set(), *(_stored(t) for t in target.elts))
    if isinstance(target, ast.Starred):
        return _stored(target.value)
    return set()


def _reads(node, bound: set[str]) -> set[str]:
    """The names ``node`` reads anywhere inside it (lambdas, comprehensions, nested ``def``s included),
    less ``bound``."""
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Load, ast.Del))}
    names |= {n.target.id for n in ast.walk(node) if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name)}
    return names - bound


def _read_early(body: list, bound: set[str]) -> tuple[set[str], set[str]]:
    """``(names body may read before it has bound them, names bound whenever body runs to its end)``,
    for statements run in order with ``bound`` already bound.

    Conservative: a loop's, a ``with``'s or a ``try``'s own bindings hold only inside it, an ``if``
    binds what both branches bind, and any other compound statement counts every name it reads.
    """
    bound, early = set(bound), set()
    for stmt in body:
        if isinstance(stmt, (ast.For, ast.AsyncFor)):
            early |= _reads(stmt.iter, bound) | _reads(stmt.target, bound)  # (a target `d[k]` reads d and k)
            early |= _read_early(stmt.body, bound | _stored(stmt.target))[0] | _read_early(stmt.orelse, bound)[0]
        elif isinstance(stmt, ast.While):
            early |= _reads(stmt.test, bound) | _read_early(stmt.body, bound)[0] | _read_early(stmt.orelse, bound)[0]
        elif isinstance(stmt, ast.If):
            (e1, b1), (e2, b2) = _read_early(stmt.body, bound), _read_early(stmt.orelse, bound)
            early |= _reads(stmt.test, bound) | e1 | e2
            bound |= b1 & b2
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            inner = set(bound)
            for item in stmt.items:
                early |= _reads(item.context_expr, inner)
                if item.optional_vars is not None:
                    early |= _reads(item.optional_vars, inner)
                    inner |= _stored(item.optional_vars)
            early |= _read_early(stmt.body, inner)[0]
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            for part in (stmt.body, stmt.orelse, stmt.finalbody):
                early |= _read_early(part, bound)[0]
            for handler in stmt.handlers:
                if handler.type is not None:
                    early |= _reads(handler.type, bound)
                early |= _read_early(handler.body, bound | ({handler.name} if handler.name else set()))[0]
        else:
            early |= _reads(stmt, bound)
            if isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    bound |= _stored(target)
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and stmt.value is not None:
                bound |= _stored(stmt.target)
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                bound |= {(a.asname or a.name).split(".")[0] for a in stmt.names if a.name != "*"}
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(stmt.name)
            elif isinstance(stmt, ast.Delete):
                bound -= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    return early, bound


def _rebound_first(source: str) -> set[str]:
    """Names the block ``source`` binds, and never reads before binding them on any path."""
    tree = ast.parse(source)
    stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    stored |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
               if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names if a.name != "*"}
    stored |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                                                ast.ExceptHandler)) and n.name}
    return stored - _read_early(tree.body, set())[0]


def trace_blocks_ship_only_what_they_read() -> None:
    """Make a trace block's payload leave out the names the block assigns before it reads them
    (process-wide; idempotent).

    nnsight ships, with every invoke, the value each name the block reads has in the enclosing scope
    when the trace runs, including a name the block assigns before it reads it. The collecting idiom
    ``steps = list().save()`` then ``steps.append(...)`` under ``tracer.iter`` reads ``steps``, so a
    notebook cell run a second time sends the previous run's ``steps`` (every invoke's) along with
    every invoke: the payload grows with the square of the prompts, and the block overwrites the value
    before reading it. Such names stay behind; any name the block may read before binding it ships
    as before. Touches nnsight's ``nnsight.intervention.serialization._referenced_names``.
    """
    from nnsight.intervention import serialization

    read = serialization._referenced_names
    if getattr(read, "_nnvllm", False):
        return

    @functools.lru_cache(maxsize=256)  # (every invoke of a trace sends the same source: analysed once)
    def names(source: str) -> frozenset[str]:
        return frozenset(read(source) - _rebound_first(source))

    def referenced_names(source: str) -> set[str]:
        return set(names(source))

    referenced_names._nnvllm = True
    referenced_names.__wrapped__ = read
    serialization._referenced_names = referenced_names


def envoy_ids(model) -> dict:
    """``{"Envoy:<path>": envoy}`` for every envoy of ``model``'s tree but the root: what a process that
    runs trace blocks resolves the ids :func:`envoys_by_reference` gives to."""
    return {f"Envoy:{e.path}": e for e in model.modules() if e is not model}


def envoys_by_reference(model) -> None:
    """Send ``model``'s envoys (all but the root) by path, not by value, in trace payloads.

    nnsight pickles the envoy tree a block reaches (through ``model``, every module's envoy) by value
    with every invoke, the modules inside it by reference; the engine side rebuilds a copy over its
    own modules. Its own envoys, at the same paths, are the same thing: the trees are built from the
    same vLLM model class, which nnsight's ``Module:<path>`` ids already rely on.
    """
    for path, envoy in envoy_ids(model).items():
        envoy.__dict__["_persistent_id"] = path
