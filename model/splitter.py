"""Automated splitting of a model at its attention operators.

The model is traced with torch.fx into a graph whose edges carry tensors; each
edge is weighted by the bytes its tensor holds (from shapes propagated with an
example input). For every attention operator A_i we take the minimum weighted
cut that separates everything A_i needs (its ancestors, and everything earlier
slices already computed) from everything that needs A_i (its descendants).
Values crossing the cut are the *context* one slice hands to the next; A_i's
inputs (Q, K, V) leave the slice separately so Q can be sent first.

Nodes computed from graph inputs and parameters alone by plain functions (RoPE's
cos/sin tables, for example) are cheap and are recomputed in every slice that
uses them instead of being shipped; modules (embeddings, linears) never are.

For n attention operators this yields n + 1 slices:
    slice 0:      graph inputs                  -> (q_0, k_0, v_0), context_0
    slice i:      attn_out_{i-1}, context_{i-1} -> (q_i, k_i, v_i), context_i
    slice n:      attn_out_{n-1}, context_{n-1} -> model output
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import fx, nn


@dataclass
class Slice:
    """One invokable piece of the model.

    Call it with the graph inputs it uses (by name), the previous attention
    output (all but slice 0) and the previous context, in `context_in` order.
    """

    index: int
    module: fx.GraphModule
    graph_inputs: list[str]  # names of model inputs this slice reads
    context_in: list[str]  # names of the context values it receives
    context_out: list[str]  # names of the context values it hands on
    takes_attention: bool  # whether it receives the previous attention output
    is_last: bool
    # The same computation in one native call where it takes the step (a LLaMA model's
    # middle slices: lamina.model.fused_slice); it returns None to leave a step to `module`.
    fused: Callable[[dict[str, Any], torch.Tensor | None, Sequence[torch.Tensor]], SliceOutput | None] | None = None

    def __call__(
        self,
        inputs: dict[str, Any],
        attn_out: torch.Tensor | None = None,
        context: Sequence[torch.Tensor] = (),
    ) -> SliceOutput:
        if self.fused is not None:
            out = self.fused(inputs, attn_out, context)
            if out is not None:
                return out
        args: list[Any] = [inputs[name] for name in self.graph_inputs]
        if self.takes_attention:
            args.append(attn_out)
        args.extend(context)
        # The generated forward itself: the module call's hook machinery costs a few
        # microseconds, 31 times a step (slices have no hooks).
        result = self.module.forward(*args)
        if self.is_last:
            return SliceOutput(None, [], result)
        q, k, v, *ctx = result
        return SliceOutput((q, k, v), list(ctx), None)


# The key of a step's inputs that lets the middle slices write into outputs they keep
# from step to step (SplitModel.run's reuse_outputs; lamina.model.fused_slice).
REUSE_OUTPUTS = "reuse_outputs"


@dataclass
class SliceOutput:
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # inputs of the next attention
    context: list[torch.Tensor]
    output: Any  # the model's output, from the last slice only


# attend(i, q, k, v) -> attention i's output: q [T, Hq, D]; k, v [T, Hkv, D] -> [T, Hq, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
AsyncAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], Awaitable[torch.Tensor]]
# run_slice(j, inputs, attention output (None for slice 0), context) -> slice j's output
RunSlice = Callable[[int, dict[str, Any], torch.Tensor | None, Sequence[torch.Tensor]], Awaitable[SliceOutput]]
# call_slice(j, inputs, attn, context): slice j run in place of calling it
CallSlice = Callable[[int, dict[str, Any], torch.Tensor | None, Sequence[torch.Tensor]], SliceOutput]


@dataclass
class SplitModel:
    slices: list[Slice]
    attention_modules: list[str]  # qualified names of the attention operators, in order
    cut_bytes: list[int] = field(default_factory=list)  # context bytes per cut, for the example input
    # Held by the run whose slices write into the outputs they keep (run's reuse_outputs).
    _reuse: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def num_attention(self) -> int:
        return len(self.attention_modules)

    def run(self, inputs: dict[str, Any], attend: Attend, *, reuse_outputs: bool = False,
            call_slice: CallSlice | None = None) -> Any:
        """Compose the slices with an attention function; equals the unsplit model.
        Grad mode is the caller's. `call_slice(j, inputs, attn, context)`: runs slice j in
        place of calling it (a GPU's CUDA graphs: model/slice_graphs.py).

        reuse_outputs: the middle slices may write into outputs they keep from step to step
        (lamina.model.fused_slice's REUSE_OUTPUTS), so no Q, K, V or context outlives the
        step: only for an `attend` that keeps no K or V it is given (it copies them into
        its KV store) and a caller that keeps nothing but the model's output. A run beside
        another that reuses (another thread) makes new outputs."""
        reusing = reuse_outputs and self._reuse.acquire(blocking=False)
        try:
            if reusing:
                inputs = {**inputs, REUSE_OUTPUTS: True}
            if call_slice is not None:
                out = call_slice(0, inputs, None, ())
                for i in range(self.num_attention):
                    q, k, v = out.qkv  # type: ignore[misc]
                    out = call_slice(i + 1, inputs, attend(i, q, k, v), out.context)
                return out.output
            out = self.slices[0](inputs)
            for i in range(self.num_attention):
                q, k, v = out.qkv  # type: ignore[misc]
                out = self.slices[i + 1](inputs, attend(i, q, k, v), out.context)
            return out.output
        finally:
            if reusing:
                self._reuse.release()

    async def run_async(self, inputs: dict[str, Any], attend: AsyncAttend, run_slice: RunSlice | None = None) -> Any:
        """`run` where attention (and, with `run_slice`, a slice) is awaited: attention on
        other processes, slices on whichever worker is free. Without `run_slice` each
        slice runs here under inference mode, set per call: other tasks run at the
        awaits in between, so no grad mode is held across them."""
        run_slice = run_slice or self._run_slice
        out = await run_slice(0, inputs, None, ())
        for i in range(self.num_attention):
            q, k, v = out.qkv  # type: ignore[misc]
            out = await run_slice(i + 1, inputs, await attend(i, q, k, v), out.context)
        return out.output

    async def _run_slice(self, j: int, inputs: dict[str, Any], attn: torch.Tensor | None,
                         context: Sequence[torch.Tensor]) -> SliceOutput:
        with torch.inference_mode():
            return self.slices[j](inputs, attn, context)


class _Tracer(fx.Tracer):
    def __init__(self, is_attention: Callable[[nn.Module], bool], is_leaf: Callable[[nn.Module], bool] | None) -> None:
        super().__init__()
        self._is_attention = is_attention
        self._is_leaf = is_leaf

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if self._is_attention(m) or (self._is_leaf is not None and self._is_leaf(m)):
            return True
        return super().is_leaf_module(m, qualname)


class _Bytes(fx.Interpreter):
    """Runs the graph on example inputs and records in each node's meta["nbytes"] the
    bytes of the tensor(s) it produces (None for other values: sizes, dtypes). What
    torch.fx's ShapeProp would give the cut, without the sympy it imports (a second of
    every worker's start)."""

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        parts = [result] if isinstance(result, torch.Tensor) else list(result) if isinstance(result, tuple | list) \
            else []
        if parts and all(isinstance(t, torch.Tensor) for t in parts):
            n.meta["nbytes"] = sum(t.numel() * t.element_size() for t in parts)
        return result


def _nbytes(node: fx.Node) -> int | None:
    """Bytes of the tensor(s) a node produces; None for non-tensor values (sizes, dtypes)."""
    return node.meta.get("nbytes")


def split_model(
    model: nn.Module,
    example_inputs: dict[str, Any],
    is_attention: Callable[[nn.Module], bool],
    is_leaf: Callable[[nn.Module], bool] | None = None,
) -> SplitModel:
    """Trace `model` and cut it at every module for which `is_attention` holds.

    `example_inputs` are the forward arguments by name; they drive shape
    propagation (the edge weights) and reach the attention modules during it.
    Modules for which `is_leaf` holds are called whole rather than traced through
    (besides torch.nn's own, which always are).
    """
    graph = _Tracer(is_attention, is_leaf).trace(model)
    gm = fx.GraphModule(model, graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    _Bytes(gm).run(*[example_inputs[str(p.target)] for p in placeholders])

    modules = dict(gm.named_modules())
    attn_nodes = [n for n in graph.nodes if n.op == "call_module" and is_attention(modules[str(n.target)])]
    if not attn_nodes:
        raise ValueError("the model has no attention operators to split at")
    free = _recomputable(graph)
    regular = [n for n in graph.nodes if n.op not in ("placeholder", "output") and n not in free]

    # owner[node] = the slice that computes it; an attention output belongs to the slice after it.
    owner: dict[fx.Node, int] = {}
    computed: set[fx.Node] = set()
    for i, attn in enumerate(attn_nodes):
        for n in _source_side(attn, regular, computed):
            owner.setdefault(n, i)
        owner[attn] = i + 1
        computed = {n for n, o in owner.items() if o <= i} | {attn}
    for n in regular:
        owner.setdefault(n, len(attn_nodes))

    builder = _SliceBuilder(gm, owner, attn_nodes, free, placeholders)
    slices = [builder.build(j) for j in range(len(attn_nodes) + 1)]
    cut_bytes = [sum(_nbytes(builder.by_name[c]) or 0 for c in s.context_out) for s in slices[:-1]]
    return SplitModel(slices, [str(a.target) for a in attn_nodes], cut_bytes)


def _recomputable(graph: fx.Graph) -> set[fx.Node]:
    """Function nodes computed from graph inputs and parameters alone (and get_attr nodes)."""
    free: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "get_attr" or (
            n.op in ("call_function", "call_method")
            and n.all_input_nodes
            and all(a.op == "placeholder" or a in free for a in n.all_input_nodes)
        ):
            free.add(n)
    return free


def _closure(start: fx.Node, step: Callable[[fx.Node], list[fx.Node]]) -> set[fx.Node]:
    seen = {start}
    stack = [start]
    while stack:
        for m in step(stack.pop()):
            if m not in seen:
                seen.add(m)
                stack.append(m)
    return seen


def _source_side(attn: fx.Node, regular: list[fx.Node], computed: set[fx.Node]) -> set[fx.Node]:
    """Regular nodes on the source side of the minimum cut before `attn`.

    Forced to the source: `attn`'s ancestors and what earlier slices computed.
    Forced to the sink: `attn` and its descendants (contracted into the sink).
    Each value is a node pair (producer -> value) joined by an edge of its byte
    size, and the value feeds its consumers, so a value with many consumers costs
    its bytes once. Edges without a capacity are infinite for networkx; the
    consumer -> producer ones keep the cut closed (nothing on the source side
    reads a value computed on the sink side).
    """
    ancestors = _closure(attn, lambda n: n.all_input_nodes) - {attn}
    descendants = _closure(attn, lambda n: list(n.users))
    g = nx.DiGraph()
    src, dst = "__source__", "__sink__"
    g.add_nodes_from((src, dst))
    for n in regular:
        if n in descendants:
            continue
        if n in computed and all(u in computed for u in n.users):
            continue  # interior to earlier slices
        value = ("value", n.name)
        nbytes = _nbytes(n)
        if nbytes is None:
            g.add_edge(n.name, value)  # sizes and dtypes are never shipped: keep them with their consumers
        else:
            g.add_edge(n.name, value, capacity=float(nbytes))
        for user in n.users:
            if user.op == "output" or user in descendants:
                g.add_edge(value, dst)
            else:
                g.add_edge(value, user.name)
                g.add_edge(user.name, n.name)
        if n in ancestors or n in computed:
            g.add_edge(src, n.name)
    _, (source_side, _) = nx.minimum_cut(g, src, dst)
    return {n for n in regular if n.name in source_side} | ancestors & set(regular)


class _SliceBuilder:
    """Builds slice j's GraphModule by copying the nodes it owns from the traced graph."""

    def __init__(
        self,
        gm: fx.GraphModule,
        owner: dict[fx.Node, int],
        attn_nodes: list[fx.Node],
        free: set[fx.Node],
        placeholders: list[fx.Node],
    ) -> None:
        self.gm = gm
        self.owner = owner
        self.attn_nodes = attn_nodes
        self.free = free
        self.placeholders = placeholders
        self.output_node = next(n for n in gm.graph.nodes if n.op == "output")
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.by_name = {n.name: n for n in gm.graph.nodes}

    def _reads(self, n: fx.Node) -> set[fx.Node]:
        """Non-recomputable values `n` reads, looking through recomputable nodes."""
        out: set[fx.Node] = set()
        stack = list(n.all_input_nodes)
        while stack:
            a = stack.pop()
            if a in self.free:
                stack.extend(a.all_input_nodes)
            elif a.op != "placeholder":
                out.add(a)
        return out

    def _context_out(self, j: int) -> list[fx.Node]:
        readers = [n for n, o in self.owner.items() if o > j] + self.attn_nodes[j + 1 :] + [self.output_node]
        handed = {a for r in readers for a in self._reads(r) if self.owner.get(a, j + 1) <= j}
        # The next attention's own inputs leave the slice as q, k, v, not as context,
        # unless a later slice reads them too.
        qkv = set(self.attn_nodes[j].args[:3])
        later_readers = [r for r in readers if r is not self.attn_nodes[j]]
        handed = {a for a in handed if a not in qkv or any(a in self._reads(r) for r in later_readers)}
        return sorted(handed, key=self.order.__getitem__)

    def build(self, j: int) -> Slice:
        is_last = j == len(self.attn_nodes)
        prev_attn = self.attn_nodes[j - 1] if j else None
        if is_last:
            results: list[Any] = [self.output_node.args[0]]
            ctx_out: list[fx.Node] = []
        else:
            results = list(self.attn_nodes[j].args[:3])
            ctx_out = self._context_out(j)

        # Dry walk: which graph inputs and context values this slice needs.
        inputs: set[fx.Node] = set()
        ctx_in: set[fx.Node] = set()
        seen: set[fx.Node] = set()
        stack = [a for r in results for a in _nodes_in(r)] + ctx_out
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder":
                inputs.add(n)
            elif n is prev_attn:
                continue
            elif n in self.free or self.owner.get(n) == j:
                stack.extend(n.all_input_nodes)
            else:
                ctx_in.add(n)

        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        graph_inputs = [p for p in self.placeholders if p in inputs]
        for p in graph_inputs:
            env[p] = g.placeholder(str(p.target))
        if prev_attn is not None:
            env[prev_attn] = g.placeholder("attn_out")
        ordered_ctx_in = sorted(ctx_in, key=self.order.__getitem__)
        for a in ordered_ctx_in:
            env[a] = g.placeholder(f"ctx_{a.name}")

        def copy(n: fx.Node) -> fx.Node:
            if n not in env:
                for a in n.all_input_nodes:
                    copy(a)
                env[n] = g.node_copy(n, lambda a: env[a])
            return env[n]

        if is_last:
            g.output(fx.node.map_arg(results[0], copy))
        else:
            g.output(tuple(copy(a) for a in results) + tuple(copy(a) for a in ctx_out))
        module = fx.GraphModule(self._flatten_targets(g), g)
        # The generated code calls each submodule as `self.name(x)`. Its bound forward in
        # the instance's dict is found first: no nn.Module.__getattr__ and no hook machinery,
        # a few microseconds four times a layer (slices have no hooks; their submodules are
        # only ever changed in place, by .to() and state-dict loads, so the binding holds).
        for name, sub in module.named_children():
            module.__dict__[name] = sub.forward
        return Slice(
            index=j,
            module=module,
            graph_inputs=[str(p.target) for p in graph_inputs],
            context_in=[a.name for a in ordered_ctx_in],
            context_out=[a.name for a in ctx_out],
            takes_attention=prev_attn is not None,
            is_last=is_last,
        )


    def _flatten_targets(self, g: fx.Graph) -> dict[str, Any]:
        """Gives the modules and tensors `g` reads flat names ("model.layers.3.mlp" ->
        "model_layers_3_mlp") and returns them by those names, the slice's attributes.

        The generated code then reaches each with one attribute lookup instead of a
        chain of them, a cost paid at every call of every slice.
        """
        owned: dict[str, Any] = {}
        for n in g.nodes:
            if n.op in ("call_module", "get_attr"):
                obj = self.gm.get_submodule(n.target) if n.op == "call_module" else _get_attr(self.gm, n.target)
                n.target = n.target.replace(".", "_")
                owned[n.target] = obj
        return owned


def _get_attr(root: nn.Module, target: str) -> Any:
    path, _, name = target.rpartition(".")
    return getattr(root.get_submodule(path) if path else root, name)


def _nodes_in(arg: Any) -> list[fx.Node]:
    found: list[fx.Node] = []

    def visit(a: fx.Node) -> fx.Node:
        found.append(a)
        return a

    fx.node.map_arg(arg, visit)
    return found
