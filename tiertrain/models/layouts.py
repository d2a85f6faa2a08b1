"""A decoder layer's layout, read from its own ``forward``: the two residual branches it runs
(attention, then the MLP or mixture of experts), each a module between optional norms and a
residual add, so that ``sublayers.py`` can run each branch as a unit of its own.

A layer is cut only where its ``forward`` is, statement for statement, this form (read with
``ast`` from the installed transformers' source, never assumed from the class's name)::

    residual = hidden_states
    hidden_states = self.<pre>(hidden_states)          # optional: a pre-norm
    <out>, _ = self.<attention>(hidden_states=hidden_states, <keywords>)
    <out> = self.<post>(<out>)                         # optional: a post-norm
    hidden_states = residual + <out>                   # or + self.<dropout>(<out>),
                                                       # or + <out> * self.<multiplier>
    residual = hidden_states
    ... the same for the MLP, called as self.<mlp>(hidden_states) ...
    return hidden_states

That covers the pre-norm Llama layer and its copies (Mistral, Qwen2 and 3, Gemma, the mixtures
of experts built on it), the post-norm OLMo 2 (and EXAONE 4, OLMo 3, FlexOlmo), Gemma 2 and 3
and GLM-4 (four norms), Phi-3 (residual dropouts), Granite and MiniCPM3 (residual
multipliers), HyperCLOVA X, Apertus, Nemotron, gpt-oss and JetMoE (modules returning tuples).
Each statement is matched whole: one target a statement, ``residual`` the input, the outputs
named apart from the names read later, attention given ``hidden_states=``, no decorator but
``deprecate_kwarg`` (a keyword renamed) and ``auto_docstring``; residual multipliers must be
numbers and no module with parameters may serve both branches (``layout_of``). Attention and
MLP side by side on one normed input, their outputs added to the residual in
some order (Cohere, Command R7B, Phi), are read as ``Layout.parallel``. Anything else
(a branch of another form inside the forward: StableLM) is refused by name. Llama 4's
``if self.is_moe_layer: out, _ = out`` and ``residual + out.view(residual.shape)`` are read
too (``Branch.tuple_if``, ``Branch.view``).
A unit replaying a branch makes the same calls in the same order, so it computes the whole
layer's values and gradients bit for bit (``tests/test_layouts.py``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "Branch",
    "Layout",
    "layout_of",
    "run_branch",
    "finish",
    "attention_keywords",
    "parallel_attention",
    "parallel_mlp",
    "down_last_problem",
    "before_down",
    "source_of",
]

# the keywords a layer may pass its attention, each as the same-named argument of its forward
_ATTENTION_KEYWORDS = ("attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "position_embeddings")


@dataclass(frozen=True)
class Branch:
    """One residual branch: ``h + combine(post(module(pre(h))))``.

    ``module``: the layer's attribute called (``self_attn``, ``mlp``, ``block_sparse_moe``);
    ``pre``/``post``: norms before and after it (None: none); ``outputs``: how many values it
    returns (1: a tensor; more: a tuple whose first is taken); ``dropout``: a module applied to
    its output before the add; ``multiplier``: a layer attribute the output is multiplied by;
    ``keywords``: for attention, the keywords the layer passes it besides ``hidden_states``;
    ``tuple_if``: a layer attribute under which the module's output is a tuple whose first is
    taken (Llama 4's MoE layers); ``view``: the output viewed as the residual's shape before
    the add (Llama 4's)."""

    module: str
    pre: str | None = None
    post: str | None = None
    outputs: int = 1
    dropout: str | None = None
    multiplier: str | None = None
    keywords: tuple[str, ...] = ()
    tuple_if: str | None = None
    view: bool = False

    @property
    def modules(self) -> tuple[str, ...]:
        """The layer's children this branch calls, in order."""
        return tuple(m for m in (self.pre, self.module, self.post, self.dropout) if m is not None)


@dataclass(frozen=True)
class Layout:
    """A layer's two branches, in forward order. ``parallel``: None where the MLP's branch takes
    the attention branch's output; else attention and MLP side by side on the attention's
    normed input (``mlp.pre`` None), their outputs added to the residual in this order of
    ``"residual"``, ``"attention"``, ``"mlp"`` (Cohere, Phi)."""

    attention: Branch
    mlp: Branch
    parallel: tuple[str, ...] | None = None


class _NotTheForm(Exception):
    pass


@functools.lru_cache(maxsize=None)
def source_of(fn: Any) -> str | None:
    """``fn``'s source, dedented (None where it cannot be read): what the forms are checked on."""
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _self_attr(node: ast.AST) -> str | None:
    """``x`` for ``self.x``, else None."""
    if isinstance(node, ast.Attribute) and _is_name(node.value, "self"):
        return node.attr
    return None


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise _NotTheForm(what)


def _assign(stmt: ast.stmt | None, what: str) -> ast.Assign:
    """``stmt`` as an assignment to one target (not ``a = b = ...``), else not the form."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        raise _NotTheForm(what)
    return stmt


# the decorators a layer's forward may have: they rename a keyword or write its docstring
_DECORATORS = {"deprecate_kwarg", "auto_docstring"}


class _Reader:
    """Reads the statements of a layer's forward against the form of the module docstring."""

    def __init__(self, body: list[ast.stmt], hidden: str) -> None:
        self.body, self.i, self.h = body, 0, hidden

    def end(self) -> None:
        stmt = self._next()
        _expect(isinstance(stmt, ast.Return) and _is_name(stmt.value, self.h), "it returns something else")
        _expect(self._peek() is None, "statements after the return")

    def _next(self) -> ast.stmt:
        _expect(self.i < len(self.body), "the forward ends early")
        self.i += 1
        return self.body[self.i - 1]

    def _peek(self) -> ast.stmt | None:
        return self.body[self.i] if self.i < len(self.body) else None

    def _unary(self, stmt: ast.stmt | None, var: str) -> str | None:
        """``m`` where ``stmt`` is ``var = self.m(var)``."""
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and _is_name(stmt.targets[0], var)):
            return None
        call = stmt.value
        if not (isinstance(call, ast.Call) and len(call.args) == 1 and not call.keywords):
            return None
        return _self_attr(call.func) if _is_name(call.args[0], var) else None

    def branch(self, attention: bool) -> Branch:
        h = self.h
        stmt = _assign(self._next(), f"a branch that does not start with residual = {h}")
        _expect(
            _is_name(stmt.targets[0], "residual") and _is_name(stmt.value, h),
            f"a branch that does not start with residual = {h}",
        )
        if not attention:
            return self._mlp_branch()
        pre = self._unary(self._peek(), h)
        if pre is not None:
            self.i += 1
        out, outputs, module, keywords = self._call(self._next(), attention)
        post = self._unary(self._peek(), out)
        if post is not None:
            self.i += 1
        dropout, multiplier, view = self._residual(self._next(), out)
        return Branch(module, pre, post, outputs, dropout, multiplier, keywords, view=view)

    def _mlp_branch(self) -> Branch:
        """``h = self.m(h)`` statements: the MLP (the one not named a norm) between at most one
        norm before and one after; or a tuple-returning MLP call after at most one norm."""
        h, calls = self.h, []
        while (m := self._unary(self._peek(), h)) is not None:
            calls.append(m)
            self.i += 1
        nxt = self._peek()
        if len(calls) <= 1 and isinstance(nxt, ast.Assign) and isinstance(nxt.targets[0], ast.Tuple):
            out, outputs, module, _ = self._call(self._next(), attention=False)
            pre = calls[0] if calls else None
            _expect(pre is None or "norm" in pre, f"{pre} before the MLP is not a norm")
            post = self._unary(self._peek(), out)
            self.i += post is not None
        else:
            mains = [i for i, m in enumerate(calls) if "norm" not in m]
            _expect(len(mains) == 1 and len(calls) <= 3, f"the MLP branch calls {calls}: not one MLP between norms")
            j = mains[0]
            _expect(j <= 1 and len(calls) - j <= 2, f"the MLP branch calls {calls}: more than one norm on a side")
            module, out, outputs = calls[j], h, 1
            pre = calls[0] if j == 1 else None
            post = calls[j + 1] if j + 1 < len(calls) else None
        tuple_if = self._tuple_if(out) if outputs == 1 and post is None else None
        dropout, multiplier, view = self._residual(self._next(), out)
        return Branch(module, pre, post, outputs, dropout, multiplier, (), tuple_if, view)

    def _tuple_if(self, out: str) -> str | None:
        """``flag`` where the next statement is ``if self.flag: <out>, _ = <out>`` (no else)."""
        stmt = self._peek()
        if not (isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1):
            return None
        flag, inner = _self_attr(stmt.test), stmt.body[0]
        if flag is None or not isinstance(inner, ast.Assign) or len(inner.targets) != 1:
            return None
        target = inner.targets[0]
        if not (isinstance(target, ast.Tuple) and _is_name(inner.value, out) and target.elts):
            return None
        names = [e.id if isinstance(e, ast.Name) else "" for e in target.elts]
        if names[0] != out or not all(names) or any(n in (self.h, "residual") for n in names[1:]):
            return None
        self.i += 1
        return flag

    def parallel(self) -> Layout:
        """The side-by-side form: ``residual = h; h = self.norm(h); a, _ = self.attn(...);
        [a = self.drop(a)]; m = [self.drop(]self.mlp(h)[)]; h = <residual, a, m added>``."""
        h = self.h
        stmt = _assign(self._next(), "no residual = first")
        _expect(_is_name(stmt.targets[0], "residual") and _is_name(stmt.value, h), f"no residual = {h} first")
        pre = self._unary(self._next(), h)
        _expect(pre is not None, "no norm first")
        a, outputs, attention, keywords = self._call(self._next(), attention=True)
        # the MLP takes the normed input: attention's output must not overwrite it
        _expect(a not in (h, "residual"), f"attention's output named {a}")
        a_drop = self._unary(self._peek(), a)
        self.i += a_drop is not None
        stmt = _assign(self._next(), "no MLP output")
        _expect(isinstance(stmt.targets[0], ast.Name), "no MLP output")
        assert isinstance(stmt.targets[0], ast.Name)
        m, call, m_drop = stmt.targets[0].id, stmt.value, None
        _expect(m not in (h, "residual", a), f"the MLP's output named {m}")
        if isinstance(call, ast.Call) and len(call.args) == 1 and isinstance(call.args[0], ast.Call):
            _expect(not call.keywords, "the MLP's output through a call with keywords")
            m_drop, call = _self_attr(call.func), call.args[0]  # self.drop(self.mlp(h))
            _expect(m_drop is not None, "the MLP's output through a function")
        _expect(isinstance(call, ast.Call) and len(call.args) == 1 and _is_name(call.args[0], h), "the MLP's call")
        assert isinstance(call, ast.Call)
        mlp = _self_attr(call.func)
        _expect(mlp is not None and not call.keywords, "the MLP is not self.<m>(h)")
        stmt = _assign(self._next(), "no sum")
        _expect(_is_name(stmt.targets[0], h), "no sum")
        terms: list[str] = []
        node = stmt.value
        while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.right, ast.Name):
            terms.insert(0, node.right.id)
            node = node.left
        _expect(isinstance(node, ast.Name), "a sum of another form")
        assert isinstance(node, ast.Name)
        terms.insert(0, node.id)
        names = {"residual": "residual", a: "attention", m: "mlp"}
        _expect(sorted(terms) == sorted(names), "a sum of other terms")
        return Layout(
            Branch(attention, pre, None, outputs, a_drop, None, keywords),
            Branch(mlp or "", None, None, 1, m_drop),
            tuple(names[t] for t in terms),
        )

    def _call(self, stmt: ast.stmt, attention: bool) -> tuple[str, int, str, tuple[str, ...]]:
        stmt = _assign(stmt, "a branch's module is not called alone")
        target, call = stmt.targets[0], stmt.value
        if isinstance(target, ast.Tuple):  # out, _ = ...: the first value taken, the others unused
            names = [e.id if isinstance(e, ast.Name) else "" for e in target.elts]
            _expect(all(names) and not any(n in (self.h, "residual") for n in names[1:]), "a tuple output used")
            out, outputs = names[0], len(names)
        else:
            _expect(isinstance(target, ast.Name), "a branch's output is not a name")
            assert isinstance(target, ast.Name)
            out, outputs = target.id, 1
        _expect(out != "residual", "a branch's output named residual")
        _expect(isinstance(call, ast.Call) and _self_attr(call.func) is not None, "a branch's module is not self.<m>")
        assert isinstance(call, ast.Call)
        module = _self_attr(call.func) or ""
        if not attention:
            _expect(len(call.args) == 1 and _is_name(call.args[0], self.h) and not call.keywords, "the MLP's call")
            return out, outputs, module, ()
        _expect(not call.args, "attention called with positional arguments")
        given = {kw.arg for kw in call.keywords}
        _expect("hidden_states" in given, "attention not given hidden_states=")
        keywords = []
        for kw in call.keywords:
            if kw.arg is None:  # **kwargs: the layer's own, empty in the units' calls
                _expect(_is_name(kw.value, "kwargs"), "attention given ** of something else")
            elif kw.arg == "hidden_states":
                _expect(_is_name(kw.value, self.h), "attention given another input")
            else:
                _expect(kw.arg in _ATTENTION_KEYWORDS and _is_name(kw.value, kw.arg), f"attention's {kw.arg}=")
                keywords.append(kw.arg)
        return out, outputs, module, tuple(keywords)

    def _residual(self, stmt: ast.stmt, out: str) -> tuple[str | None, str | None, bool]:
        """(dropout, multiplier, view) of ``h = residual + <out>``, ``+ self.d(<out>)``, ``+ <out>
        * self.m``, ``+ <out>.view(residual.shape)``."""
        stmt = _assign(stmt, "no residual add")
        _expect(_is_name(stmt.targets[0], self.h), "no residual add")
        add = stmt.value
        _expect(
            isinstance(add, ast.BinOp) and isinstance(add.op, ast.Add) and _is_name(add.left, "residual"),
            "a residual add of another form",
        )
        assert isinstance(add, ast.BinOp)
        right = add.right
        if _is_name(right, out):
            return None, None, False
        if isinstance(right, ast.Call) and len(right.args) == 1 and not right.keywords and _is_view(right, out):
            return None, None, True
        if isinstance(right, ast.Call) and len(right.args) == 1 and _is_name(right.args[0], out) and not right.keywords:
            dropout = _self_attr(right.func)
            _expect(dropout is not None, "a residual through a function")
            return dropout, None, False
        if isinstance(right, ast.BinOp) and isinstance(right.op, ast.Mult) and _is_name(right.left, out):
            multiplier = _self_attr(right.right)
            _expect(multiplier is not None, "a residual multiplied by something else")
            return None, multiplier, False
        raise _NotTheForm("a residual add of another form")


def _is_view(call: ast.Call, out: str) -> bool:
    """``call`` is ``<out>.view(residual.shape)``."""
    f, arg = call.func, call.args[0]
    return (
        isinstance(f, ast.Attribute)
        and f.attr == "view"
        and _is_name(f.value, out)
        and isinstance(arg, ast.Attribute)
        and arg.attr == "shape"
        and _is_name(arg.value, "residual")
    )


def _decorator(node: ast.expr) -> str:
    """A decorator's name (``deprecate_kwarg`` of ``@deprecate_kwarg(...)``)."""
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _body(fn: Any) -> tuple[list[ast.stmt], str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    _expect(isinstance(func, ast.FunctionDef), "its forward is not a def")
    assert isinstance(func, ast.FunctionDef)
    odd = [n for n in map(_decorator, func.decorator_list) if n not in _DECORATORS]
    _expect(not odd, f"its forward is decorated with {', '.join(odd) or 'something'}")
    body = list(func.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    args = [a.arg for a in func.args.args]
    return body, (args[1] if len(args) > 1 else "")


@functools.lru_cache(maxsize=None)
def _layout(cls: type) -> Layout | str:
    try:
        body, hidden = _body(getattr(cls, "forward"))  # noqa: B009 (a class, not a module)
    except (OSError, TypeError, SyntaxError):
        return "its forward's source cannot be read"
    except _NotTheForm as e:
        return f"{e} (not read as two branches)"
    try:
        reader = _Reader(body, hidden)
        layout = Layout(reader.branch(attention=True), reader.branch(attention=False))
        reader.end()
        return layout
    except _NotTheForm as e:
        why = str(e)
    try:
        reader = _Reader(body, hidden)
        layout = reader.parallel()
        reader.end()
        return layout
    except _NotTheForm:
        pass
    return (
        f"its forward is not two residual branches (attention, then MLP), nor attention and MLP side by side, "
        f"as sublayers.py cuts them: {why}"
    )


def layout_of(layer: nn.Module) -> Layout | str:
    """``layer``'s layout, or why its forward is not of the form this module cuts (its
    residual multipliers numbers, and no module with parameters in both branches: each
    branch's modules go to a unit of their own)."""
    layout = _layout(type(layer))
    if isinstance(layout, str):
        return layout
    for m in {layout.attention.multiplier, layout.mlp.multiplier} - {None}:
        if not isinstance(getattr(layer, m or "", None), (int, float)):
            return f"its residual multiplier {m} is not a number"
    for m in set(layout.attention.modules) & set(layout.mlp.modules):
        if any(True for _ in getattr(layer, m).parameters()):
            return f"its module {m} is in both branches and has parameters"
    return layout


def attention_keywords(mask: Any, position_ids: Any, rope: Any, cache: Any) -> dict[str, Any]:
    """Every keyword a layer may pass its attention (``run_branch`` gives it those it does), as
    the layer's forward has them when the model calls it (``use_cache``: with a cache)."""
    return {
        "attention_mask": mask,
        "position_ids": position_ids,
        "position_embeddings": rope,
        "cache": cache,
        "past_key_values": cache,
        "use_cache": cache is not None,
    }


def run_branch(
    layer: nn.Module, branch: Branch, h: torch.Tensor, modules: nn.Module, keywords: dict[str, Any] | None = None
) -> torch.Tensor:
    """``branch`` of ``layer`` on ``h``, calling the children held by ``modules`` (a unit's
    shell of the layer's own modules) as the layer's forward does. Attention takes ``keywords``
    (every one of ``_ATTENTION_KEYWORDS``; it is given those the layer passes it); the MLP, None."""
    x = getattr(modules, branch.pre)(h) if branch.pre else h
    return finish(layer, branch, h, _module_out(layer, branch, x, modules, keywords), modules)


def _module_out(
    layer: nn.Module, branch: Branch, x: torch.Tensor, modules: nn.Module, keywords: dict[str, Any] | None
) -> torch.Tensor:
    """``branch``'s module on ``x`` as the layer calls it (attention: ``hidden_states=`` and the
    keywords it passes), the first of a tuple where it returns one."""
    fn = getattr(modules, branch.module)
    out = fn(x) if keywords is None else fn(hidden_states=x, **{k: keywords[k] for k in branch.keywords})
    if branch.outputs > 1 or (branch.tuple_if and getattr(layer, branch.tuple_if)):
        out = out[0]
    return out


def finish(layer: nn.Module, branch: Branch, h: torch.Tensor, out: torch.Tensor, modules: nn.Module) -> torch.Tensor:
    """The end of ``branch`` after its module gave ``out``: its post-norm, then the residual add
    (through its dropout, or times its multiplier)."""
    if branch.post:
        out = getattr(modules, branch.post)(out)
    if branch.view:
        return h + out.view(h.shape)
    if branch.dropout:
        return h + getattr(modules, branch.dropout)(out)
    if branch.multiplier:
        return h + out * getattr(layer, branch.multiplier)
    return h + out


def parallel_attention(
    layer: nn.Module, layout: Layout, h: torch.Tensor, modules: nn.Module, keywords: dict[str, Any]
) -> torch.Tensor:
    """The first unit of a side-by-side layer: ``[h, x, a]`` (the residual, the normed input
    the MLP takes too, the attention's output through its dropout), concatenated."""
    branch = layout.attention
    x = getattr(modules, branch.pre)(h)
    a = _module_out(layer, branch, x, modules, keywords)
    if branch.dropout:
        a = getattr(modules, branch.dropout)(a)
    return torch.cat([h, x, a], dim=-1)


def parallel_mlp(layer: nn.Module, layout: Layout, s: torch.Tensor, modules: nn.Module) -> torch.Tensor:
    """The second: the MLP on ``x``, then the three terms added in the layer's order."""
    h, x, a = s.chunk(3, dim=-1)
    branch = layout.mlp
    m = _module_out(layer, branch, x, modules, None)
    if branch.dropout:
        m = getattr(modules, branch.dropout)(m)
    terms = {"residual": h, "attention": a, "mlp": m}
    order = layout.parallel or ()
    out = terms[order[0]]
    for name in order[1:]:
        out = out + terms[name]
    return out


@functools.lru_cache(maxsize=None)
def down_last_problem(cls: type) -> str:
    """Why an MLP class's ``forward`` is not ``... return self.down_proj(<a>)`` with
    ``self.down_proj`` named once ('' where it is): then ``before_down`` gives ``<a>``, the
    MLP's computation up to its last matrix, whatever its form (gated, fused, two matrices)."""
    try:
        body, _ = _body(getattr(cls, "forward"))  # noqa: B009 (a class, not a module)
        src = ast.unparse(ast.Module(body=body, type_ignores=[]))
    except (OSError, TypeError, SyntaxError, _NotTheForm):
        return f"{cls.__name__}'s forward cannot be read"
    if src.count("self.down_proj") != 1:
        return f"{cls.__name__} does not call self.down_proj once"
    last = body[-1]
    if not isinstance(last, ast.Return) or last.value is None:
        return f"{cls.__name__}'s forward does not end in a return"
    value = last.value
    if isinstance(value, ast.Name) and len(body) >= 2:  # down = self.down_proj(...); return down
        prev = body[-2]
        if isinstance(prev, ast.Assign) and len(prev.targets) == 1 and _is_name(prev.targets[0], value.id):
            value = prev.value
    if not (isinstance(value, ast.Call) and _self_attr(value.func) == "down_proj" and len(value.args) == 1):
        return f"{cls.__name__}'s forward does not end in self.down_proj(...)"
    return ""


class _Stop(Exception):
    """Raised by the hook on ``down_proj``: the MLP's forward stops with its input."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


def before_down(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What ``mlp``'s forward hands ``down_proj`` for ``x`` (``down_last_problem`` first): its
    own forward, run up to that call and stopped there, so every operation before it is the
    model's (``down_proj`` itself never runs: its weights may be in another unit)."""

    def stop(module, args):
        raise _Stop(args[0])

    handle = mlp.down_proj.register_forward_pre_hook(stop)
    try:
        mlp(x)
    except _Stop as got:
        return got.value
    finally:
        handle.remove()
    raise RuntimeError(f"{type(mlp).__name__}'s forward returned without calling down_proj")
