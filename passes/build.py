"""Emitting nodes: every value a pass creates carries its static shape and dtype."""
from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir


class Builder:
    """Inserts new nodes before `anchor`, so they run before the node they feed."""

    def __init__(self, model: ir.Model, anchor: ir.Node, prefix: str):
        self.graph, self.anchor, self.prefix = model.graph, anchor, prefix
        # Numbered per model, so the same graph through the same passes gets the same names.
        self._ids = model.meta.setdefault("builder_ids", itertools.count())
        self._log = _log(model)

    def _name(self, what: str) -> str:
        return f"{self.prefix}/{what}_{next(self._ids)}"

    def const(self, array, what: str = "const") -> ir.Value:
        return self.initializer(ir.tensor(np.asarray(array)), what)

    def initializer(self, tensor: ir.TensorProtocol, what: str = "const") -> ir.Value:
        """A new initializer holding `tensor` as it is (a lazy one stays unevaluated)."""
        value = ir.Value(name=self._name(what), shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype),
                         const_value=tensor)
        self.graph.register_initializer(value)
        self._log.append(value)
        return value

    def op(self, op_type: str, inputs, shape, dtype: ir.DataType, domain: str = "", num_outputs: int = 1,
           shapes=None, dtypes=None, **attributes):
        """One node; `shape`/`dtype` describe its (first) output, `shapes`/`dtypes` all of them."""
        node = ir.node(op_type, list(inputs), attributes=attributes, domain=domain, num_outputs=num_outputs,
                       name=self._name(op_type))
        shapes = shapes or [shape] * num_outputs
        dtypes = dtypes or [dtype] * num_outputs
        for out, s, d in zip(node.outputs, shapes, dtypes):
            out.name = self._name(op_type.lower())
            out.shape, out.type = ir.Shape(list(s)), ir.TensorType(d)
        self.graph.insert_before(self.anchor, node)
        self._log.append(node)
        return node.outputs[0] if num_outputs == 1 else tuple(node.outputs)

    def view(self, source: ir.Value, reshape: tuple, perm: tuple) -> ir.Value:
        """source.reshape(reshape).transpose(perm), skipping whichever step does nothing."""
        value = source
        if tuple(source.shape) != tuple(reshape):
            value = self.op("Reshape", [value, self.const(np.array(reshape, np.int64), "shape")], reshape, source.dtype)
        if tuple(perm) != tuple(range(len(perm))):
            value = self.op("Transpose", [value], [reshape[p] for p in perm], source.dtype, perm=list(perm))
        return value


def replace_value(old: ir.Value, new: ir.Value) -> None:
    """Point every use of `old` at `new`; if `old` is a graph output, `new` takes its place and name."""
    is_output = old.is_graph_output()
    name = old.name
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    if is_output:
        old.name = f"{name}__replaced"
        new.name = name


def _log(model: ir.Model) -> list:
    return model.meta.setdefault("builder_log", [])


def transaction(model: ir.Model) -> int:
    """A mark to roll back to: what every Builder on `model` creates from now on is logged after it."""
    return len(_log(model))


def commit(model: ir.Model, mark: int) -> None:
    """The candidate since `mark` is done: forget its log."""
    del _log(model)[mark:]


def rollback(model: ir.Model, mark: int) -> None:
    """Remove the nodes and initializers created since `mark`; they must not be wired into the graph yet."""
    log = _log(model)
    created = log[mark:]
    del log[mark:]
    nodes = [x for x in created if isinstance(x, ir.Node) and x.graph is not None]
    if nodes:  # safe: refuses (ValueError) if a node is already wired in, detaches their inputs otherwise
        model.graph.remove(nodes, safe=True)
    for value in (x for x in created if isinstance(x, ir.Value)):
        if not value.uses() and model.graph.initializers.get(value.name) is value:
            del model.graph.initializers[value.name]
