"""einsum_to_matmul: a two-operand Einsum that contracts an index  ==>  Transpose/Unsqueeze + MatMul + Transpose.

`torch.einsum` exports as ONNX Einsum, which no fusion reads. Written as the batched
MatMul it is, attention computed with einsum is the same MatMul -> Softmax -> MatMul
chain fuse_attention matches, and the movement around it is traced like any other:

    bhtd,bhsd->bhts     Q @ Transpose(K)
    bgrtd,bgsd->bgrts   Q5 @ Unsqueeze(Transpose(K), 2): r, free on one side only, becomes a
                        broadcast batch axis of size 1 on the other (a grouped-query score)

Indices are sorted into batch (both operands and output), contracted (both operands,
not output) and free (one operand and output). One free index per side is the MatMul's
row/column; any other becomes a broadcast batch axis. Several contracted indices are
merged by a Reshape. Not rewritten (and noted): other than two operands, an index summed
within one operand, a repeated index (a diagonal), or no contracted index at all.
"""
from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from .analysis import attr, static_shape
from .base import FusionPass, NotFused
from .build import Builder, replace_value


class EinsumToMatMul(FusionPass):
    name = "einsum_to_matmul"
    candidate_ops = ("Einsum",)

    def fuse(self, model: ir.Model, node: ir.Node) -> None:
        if len(node.inputs) != 2:
            raise NotFused(f"Einsum over {len(node.inputs)} operands; expected two")
        a, b = node.inputs
        shapes = [static_shape(a), static_shape(b)]
        if any(s is None for s in shapes):
            raise NotFused("an Einsum operand without a static shape")
        (sa, sb), out_letters = parse(attr(node, "equation", ""), [len(s) for s in shapes])
        plan = Plan(sa, sb, out_letters, dict(zip(sa, shapes[0])), dict(zip(sb, shapes[1])))
        bld = Builder(model, node, f"{self.name}/{node.name}")
        left = plan.operand(bld, a, sa, [*plan.batch, plan.m, *plan.contract], plan.contract)
        right = plan.operand(bld, b, sb, [*plan.batch, *plan.contract, plan.n], plan.contract)
        letters = [*plan.batch, plan.m, plan.n]
        shape = [plan.size(x) for x in letters]
        value = bld.op("MatMul", [left, right], shape, a.dtype)
        for dummy in (plan.n, plan.m):  # a side without a free index got a size-1 axis: drop it
            if dummy.startswith("1"):
                axis = letters.index(dummy)
                letters.pop(axis)
                shape.pop(axis)
                value = bld.op("Squeeze", [value, bld.const(np.array([axis], np.int64), "axes")], shape, a.dtype)
        perm = [letters.index(x) for x in out_letters]
        if perm != list(range(len(perm))):
            value = bld.op("Transpose", [value], [shape[p] for p in perm], a.dtype, perm=perm)
        replace_value(node.outputs[0], value)


def parse(equation: str, ranks: list[int]) -> tuple[list[list[str]], list[str]]:
    """Operand and output index lists, with an ellipsis spelled out as indices '0', '1', ... (right-aligned)."""
    eq = equation.replace(" ", "")
    if not eq:
        raise NotFused("Einsum without an equation")
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise NotFused(f"equation {equation!r} names {len(terms)} operands; the node has {len(ranks)}")
    width = max((r - len(t.replace("...", "")) for t, r in zip(terms, ranks) if "..." in t), default=0)
    ellipsis = [f"{i}" for i in range(width)]

    def spell(term: str, rank: int | None) -> list[str]:
        if "..." not in term:
            letters = list(term)
        else:
            head, tail = term.split("...")
            n = width if rank is None else rank - len(head) - len(tail)
            letters = list(head) + ellipsis[width - n:] + list(tail)
        if rank is not None and len(letters) != rank:
            raise NotFused(f"equation {equation!r} gives operand {term!r} {len(letters)} indices; it has rank {rank}")
        return letters

    operands = [spell(t, r) for t, r in zip(terms, ranks)]
    if "->" in eq:
        out = spell(rhs, None)
    else:  # implicit output: indices that appear once, in alphabetical order, after the ellipsis
        counts = [x for term in operands for x in term]
        out = [x for x in ellipsis if x in counts] + sorted(x for x in set(counts) if counts.count(x) == 1
                                                              and x not in ellipsis)
    for letters in operands + [out]:
        if len(set(letters)) != len(letters):
            raise NotFused(f"equation {equation!r} repeats an index within one term (a diagonal)")
    return operands, out


class Plan:
    """How the two operands line up as [batch..., M, K] @ [batch..., K, N]."""

    def __init__(self, sa, sb, out, dims_a: dict, dims_b: dict):
        both = [x for x in sa if x in sb]
        self.contract = [x for x in both if x not in out]
        if not self.contract:
            raise NotFused("Einsum contracts no index (an outer product): nothing for a MatMul to do")
        if any(x not in out and x not in sb for x in sa) or any(x not in out and x not in sa for x in sb):
            raise NotFused("Einsum sums an index within one operand")
        if any(x not in sa and x not in sb for x in out):
            raise NotFused("Einsum output names an index no operand has")
        free_a = [x for x in out if x in sa and x not in sb]
        free_b = [x for x in out if x in sb and x not in sa]
        self.m = free_a[-1] if free_a else "1m"
        self.n = free_b[-1] if free_b else "1n"
        self.batch = [x for x in out if x not in (self.m, self.n)]
        self.dims = {"1m": 1, "1n": 1}
        for x in set(dims_a) | set(dims_b):
            sizes = {d for d in (dims_a.get(x), dims_b.get(x)) if d is not None}
            if len(sizes - {1}) > 1:
                raise NotFused(f"index {x} has sizes {sorted(sizes)} in the two operands")
            self.dims[x] = max(sizes)

    def size(self, letter: str) -> int:
        return self.dims[letter]

    def operand(self, b: Builder, value: ir.Value, letters: list[str], order: list[str], contract: list[str]) -> ir.Value:
        """`value` (indexed by `letters`) laid out as `order`, with size-1 axes for indices it lacks and its
        contracted indices merged into one axis."""
        dims = dict(zip(letters, static_shape(value)))
        present = [x for x in order if x in dims]
        perm = [letters.index(x) for x in present]
        if perm != list(range(len(perm))):
            value = b.op("Transpose", [value], [dims[x] for x in present], value.dtype, perm=perm)
        full = [dims.get(x, 1) for x in order]
        if len(present) != len(order):
            missing = [i for i, x in enumerate(order) if x not in dims]
            value = b.op("Unsqueeze", [value, b.const(np.array(missing, np.int64), "axes")], full, value.dtype)
        if len(contract) > 1:
            first = order.index(contract[0])
            merged = full[:first] + [math.prod(full[first:first + len(contract)])] + full[first + len(contract):]
            value = b.op("Reshape", [value, b.const(np.array(merged, np.int64), "shape")], merged, value.dtype)
        return value
