"""lower_npu: the fused `onnx` graph  ==>  static primitives at opset 17, the cache and mask owned by the host.

The NPU step (what QNN, OpenVINO NPU and Vitis AI compile):

    npu_step(hidden_states [B,T,E], position_ids [B,T] int32, attention_mask [B,1,T,C+T] additive,
             past_key [B,Hkv,C,D], past_value [B,Hkv,C,D]) -> output [B,T,E], key [B,Hkv,T,D], value [B,Hkv,T,D]

- RotaryEmbedding becomes x*cos + rotate_half(x)*sin with cos/sin gathered by the int32
  positions from constant tables (the ones the graph's RotaryEmbedding held), rotate_half
  over halves or, for an interleaved one, over pairs;
- RMSNormalization becomes x/m / sqrt(mean((x/m)^2) + eps/m^2), m = max|x|/16 per row floored at sqrt(eps), in
  fp32 primitives when it stashed fp32: bounded intermediates for fp16 and 16-bit quantized graphs;
- Attention over a TensorScatter-written cache (checked causal by position, see
  causal.py) becomes attention over Concat(past, new): query heads are grouped as
  [B, Hkv, rep*T, D] against [B, Hkv, C+T, D], so K/V are never repeated, soft-capping
  (cap * tanh(s / cap)) comes before the mask as in the op, and the mask is the
  `attention_mask` input, whose values the host fills with 0 or the target's mask value (registry.py) (finite and
  fp16-safe: a fully masked row stays finite). The new K/V rows become the
  outputs `key`/`value`; the host writes them into its cache at the step's positions.
  A layer that attends within a sliding window W (checked by the same evaluation) takes
  its mask from its own input `attention_mask.slidingW` instead, which the host fills
  the same way but leaves visible only the rows within W of each query's position (a
  standard op has no window, so the mask stays an input; one input per distinct window).
- ops whose opset-18+ form has an opset-17 equivalent are rewritten to it (reduction axes
  as an attribute, Split's num_outputs as explicit sizes, Gelu as Erf or Tanh arithmetic).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

import registry
from runtime.drivers import mask_input_name

from .analysis import attr, const, static_shape
from .base import GraphPass, NotFused
from .build import Builder, replace_value
from .causal import cache_writes, check_cache_writes
from .model_io import structure

OPSET = registry.NPU_OPSET


# Reductions whose axes were an attribute up to opset 17 (an input from 18 on).
AXES_ATTRIBUTE_BEFORE_18 = {"ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                            "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"}


def _axes_to_attribute(node: ir.Node) -> None:
    axes = const(node.inputs[1])
    if axes is None:
        raise NotFused(f"{node.name}: {node.op_type} over axes computed at run time has no opset-{OPSET} form")
    if axes.size == 0 and attr(node, "noop_with_empty_axes", 0):
        raise NotFused(f"{node.name}: {node.op_type} with no axes and noop_with_empty_axes has no opset-{OPSET} form")
    node.attributes["axes"] = ir.AttrInt64s("axes", [int(a) for a in axes.reshape(-1)])
    node.attributes.pop("noop_with_empty_axes", None)  # an opset-18 attribute; with axes given it changes nothing
    node.resize_inputs(1)


def _split_sizes_to_input(model: ir.Model, node: ir.Node) -> None:
    """Split(num_outputs=n) (opset 18) as Split(x, sizes): chunks of ceil(L / n), the last one smaller, as opset
    18 defines it (opset 17's Split without sizes only splits evenly)."""
    n, shape = attr(node, "num_outputs"), static_shape(node.inputs[0])
    if shape is None:
        raise NotFused(f"{node.name}: Split(num_outputs) of a tensor of unknown shape has no opset-{OPSET} form")
    length = shape[attr(node, "axis", 0)]
    chunk = -(-length // n)
    sizes = Builder(model, node, f"lower_npu/{node.name}").const(np.array([chunk] * (n - 1) + [length - chunk * (n - 1)],
                                                                          np.int64), "split")
    node.resize_inputs(2)
    node.replace_input_with(1, sizes)
    del node.attributes["num_outputs"]


def _gelu_to_primitives(model: ir.Model, node: ir.Node) -> None:
    """Gelu (opset 20) as its definition: x/2 * (1 + erf(x / sqrt 2)), or with tanh for approximate='tanh'."""
    x = node.inputs[0]
    shape, dtype = list(static_shape(x) or x.shape), x.dtype
    b = Builder(model, node, f"lower_npu/{node.name}")
    num = lambda v: b.const(np.array(v, dtype.numpy()), "gelu_const")  # noqa: E731
    if attr(node, "approximate", "none") == "tanh":
        cube = b.op("Mul", [b.op("Mul", [x, x], shape, dtype), x], shape, dtype)
        inner = b.op("Add", [x, b.op("Mul", [cube, num(0.044715)], shape, dtype)], shape, dtype)
        squashed = b.op("Tanh", [b.op("Mul", [inner, num(np.sqrt(2 / np.pi))], shape, dtype)], shape, dtype)
    else:
        squashed = b.op("Erf", [b.op("Div", [x, num(np.sqrt(2))], shape, dtype)], shape, dtype)
    gate = b.op("Add", [squashed, num(1.0)], shape, dtype)
    replace_value(node.outputs[0], b.op("Mul", [b.op("Mul", [x, num(0.5)], shape, dtype), gate], shape, dtype))


class LowerNPU(GraphPass):
    name = "lower_npu"

    def run(self, model: ir.Model) -> bool:
        graph = model.graph
        old = next((v for v in graph.inputs if v.name == "position_ids"), None)
        if old is None or old.dtype != ir.DataType.INT64:
            encoder = [n for n in graph if n.op_type == "Attention" and n.domain == "" and cache_writes(n) is None]
            raise NotFused("no int64 position_ids input: not a step-contract graph" + (
                f" ({len(encoder)} Attention op(s) without a cache write, as an encoder's: the npu form is a decoder "
                "step over a host-owned cache and mask, so they stay the onnx target's Attention)" if encoder else ""))
        attention = [n for n in graph if n.op_type == "Attention" and n.domain == ""]
        if not attention:
            raise NotFused("no fused Attention to lower (run the onnx pipeline first)")
        batch, length = static_shape(old)
        old.name = "position_ids.int64"
        pos = ir.Value(name="position_ids", shape=ir.Shape([batch, length]), type=ir.TensorType(ir.DataType.INT32))
        graph.inputs.insert(graph.inputs.index(old) + 1, pos)
        masks: dict[int, ir.Value] = {}  # sliding window (0: none) -> its host mask input
        for node in attention:
            window = self._attention(model, node, old, masks)
            self.stats["attention"] += 1
            if window:
                self.stats["sliding_window"] += 1
        for node in [n for n in graph if n.op_type == "RotaryEmbedding" and n.domain == ""]:
            self._rope(model, node, old, pos)
            self.stats["rope"] += 1
        for node in [n for n in graph if n.op_type == "RMSNormalization"]:
            self._rmsnorm(model, node)
            self.stats["rmsnorm"] += 1
        ir.passes.common.RemoveUnusedNodesPass()(model)
        if old.uses():
            raise NotFused(f"position_ids is still used by {[u.op_type for u, _ in old.uses()]} after lowering")
        graph.inputs.remove(old)
        for other in [v for v in graph.inputs if v.dtype == ir.DataType.INT64]:
            self._int32_input(model, other)
        for node in [n for n in graph if n.op_type in AXES_ATTRIBUTE_BEFORE_18 and len(n.inputs) > 1]:
            _axes_to_attribute(node)
        for node in [n for n in graph if n.op_type == "Split" and "num_outputs" in n.attributes]:
            _split_sizes_to_input(model, node)
        for node in [n for n in graph if n.op_type == "Gelu" and n.domain == ""]:
            _gelu_to_primitives(model, node)
        ir.passes.common.RemoveUnusedNodesPass()(model)
        model.opset_imports[""] = OPSET
        try:
            onnx.checker.check_model(structure(model))
        except onnx.checker.ValidationError as e:
            raise NotFused(f"the lowered graph is not valid at opset {OPSET}: {str(e).splitlines()[0]}") from None
        return True

    def _attention(self, model, node, old_pos, masks):
        q, k, v = node.inputs[:3]
        writes = cache_writes(node)
        if writes is None:
            raise NotFused(f"{node.name}: K/V are not TensorScatter cache writes")
        (batch, heads, length, dim), (_, kv_heads, capacity, _) = static_shape(q), static_shape(k)
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        pos, window = check_cache_writes(model, writes, mask, batch, length, capacity, windowed=True)
        if pos is not old_pos:
            raise NotFused(f"{node.name}: the cache is written at another input than position_ids")
        graph, dtype, rep, total = model.graph, q.dtype, heads // kv_heads, capacity + length
        if window not in masks:
            masks[window] = ir.Value(name=mask_input_name(window), shape=ir.Shape([batch, 1, length, total]),
                                     type=ir.TensorType(dtype))
            graph.inputs.insert(graph.inputs.index(old_pos) + 1 + len(masks), masks[window])
        mask_input = masks[window]
        b = Builder(model, node, f"{self.name}/{node.name}")
        shape = lambda *dims: b.const(np.array(dims, np.int64), "shape")  # noqa: E731
        new_k, new_v = writes[0].inputs[1], writes[1].inputs[1]
        keys = b.op("Concat", [writes[0].inputs[0], new_k], [batch, kv_heads, total, dim], dtype, axis=2)
        values = b.op("Concat", [writes[1].inputs[0], new_v], [batch, kv_heads, total, dim], dtype, axis=2)
        grouped = b.op("Reshape", [q, shape(batch, kv_heads, rep * length, dim)], [batch, kv_heads, rep * length, dim], dtype)
        keys_t = b.op("Transpose", [keys], [batch, kv_heads, dim, total], dtype, perm=[0, 1, 3, 2])
        scores = b.op("MatMul", [grouped, keys_t], [batch, kv_heads, rep * length, total], dtype)
        scale = float(attr(node, "scale", dim ** -0.5))
        scores = b.op("Mul", [scores, b.const(np.array(scale, dtype.numpy()), "scale")], [batch, kv_heads, rep * length, total], dtype)
        cap = float(attr(node, "softcap", 0.0))
        if cap:  # logit soft-capping (Gemma-2), before the mask as the op defines it
            capped = [batch, kv_heads, rep * length, total]
            limit = b.const(np.array(cap, dtype.numpy()), "softcap")
            scores = b.op("Mul", [b.op("Tanh", [b.op("Div", [scores, limit], capped, dtype)], capped, dtype), limit], capped, dtype)
        fp32 = dtype != ir.DataType.FLOAT and attr(node, "softmax_precision", 0) == int(ir.DataType.FLOAT)
        sdt = ir.DataType.FLOAT if fp32 else dtype
        five = [batch, kv_heads, rep, length, total]
        scores = b.op("Reshape", [scores, shape(*five)], five, dtype)
        m = b.op("Reshape", [mask_input, shape(batch, 1, 1, length, total)], [batch, 1, 1, length, total], dtype)
        if fp32:
            scores = b.op("Cast", [scores], five, sdt, to=int(sdt))
            m = b.op("Cast", [m], [batch, 1, 1, length, total], sdt, to=int(sdt))
        probs = b.op("Softmax", [b.op("Add", [scores, m], five, sdt)], five, sdt, axis=-1)
        if fp32:
            probs = b.op("Cast", [probs], five, dtype, to=int(dtype))
        probs = b.op("Reshape", [probs, shape(batch, kv_heads, rep * length, total)], [batch, kv_heads, rep * length, total], dtype)
        out = b.op("MatMul", [probs, values], [batch, kv_heads, rep * length, dim], dtype)
        out = b.op("Reshape", [out, shape(batch, heads, length, dim)], [batch, heads, length, dim], dtype)
        replace_value(node.outputs[0], out)
        for write, name in zip(writes, ("key", "value")):
            outputs = model.graph.outputs
            if write.outputs[0] in outputs:  # present_key(.i) -> key(.i): the step's new rows
                present = write.outputs[0].name
                outputs[outputs.index(write.outputs[0])] = write.inputs[1]
                write.inputs[1].name = present.removeprefix("present_") if present.startswith("present_") else name
        return window

    def _int32_input(self, model, old: ir.Value) -> None:
        """An int64 graph input (token ids) taken as int32, what NPUs index with: gathers read it as is."""
        graph = model.graph
        new = ir.Value(name=old.name, shape=old.shape, type=ir.TensorType(ir.DataType.INT32))
        old.name += ".int64"
        graph.inputs.insert(graph.inputs.index(old), new)
        b = Builder(model, next(iter(graph)), f"{self.name}/{new.name}")
        wide = None
        for user, index in list(old.uses()):
            if user.op_type == "Gather" and index == 1:
                user.replace_input_with(index, new)
                continue
            if wide is None:
                wide = b.op("Cast", [new], list(old.shape), ir.DataType.INT64, to=int(ir.DataType.INT64))
            user.replace_input_with(index, wide)
        graph.inputs.remove(old)

    def _rope(self, model, node, old_pos, pos):
        x, cos_cache, sin_cache, positions = node.inputs[:4]
        tables = [const(cos_cache), const(sin_cache)]
        shape = static_shape(x)
        heads = attr(node, "num_heads", 0)
        if positions is not old_pos or any(t is None for t in tables) or len(shape) != 3 or not heads \
                or attr(node, "rotary_embedding_dim", 0):
            raise NotFused(f"{node.name}: RotaryEmbedding is not a whole-head rotation at position_ids")
        batch, length, width = shape
        dim, dtype = width // heads, x.dtype
        interleaved = bool(attr(node, "interleaved", 0))
        b = Builder(model, node, f"{self.name}/{node.name}")
        shp = lambda *dims: b.const(np.array(dims, np.int64), "shape")  # noqa: E731
        four = [batch, length, heads, dim]
        x4 = b.op("Reshape", [x, shp(*four)], four, dtype)
        angles = []
        for table in tables:  # each angle twice, in the order the rotation pairs the elements
            full = np.repeat(table, 2, axis=-1) if interleaved else np.concatenate([table, table], axis=-1)
            rows = b.op("Gather", [b.const(full.astype(dtype.numpy()), "rope_table"), pos], [batch, length, dim], dtype, axis=0)
            angles.append(b.op("Reshape", [rows, shp(batch, length, 1, dim)], [batch, length, 1, dim], dtype))
        # halves: (x1, x2) = x[..., :D/2], x[..., D/2:]; pairs: x viewed as [..., D/2, 2], (x1, x2) = [..., 0], [..., 1]
        parts = [batch, length, heads, dim // 2, 2] if interleaved else four
        xs = b.op("Reshape", [x4, shp(*parts)], parts, dtype) if interleaved else x4
        axis, half = len(parts) - 1, parts[-1] // 2
        part = parts[:-1] + [half]
        cut = lambda lo, hi: b.op("Slice", [xs, shp(lo), shp(hi), shp(axis)], part, dtype)  # noqa: E731
        first, second = cut(0, half), cut(half, 2 * half)
        rotated = b.op("Concat", [b.op("Neg", [second], part, dtype), first], parts, dtype, axis=axis)
        if interleaved:
            rotated = b.op("Reshape", [rotated, shp(*four)], four, dtype)
        out = b.op("Add", [b.op("Mul", [x4, angles[0]], four, dtype), b.op("Mul", [rotated, angles[1]], four, dtype)], four, dtype)
        replace_value(node.outputs[0], b.op("Reshape", [out, shp(batch, length, width)], shape, dtype))

    def _rmsnorm(self, model, node):
        x, scale = node.inputs[:2]
        if attr(node, "axis", -1) not in (-1, len(x.shape) - 1):
            raise NotFused(f"{node.name}: RMSNormalization over axis {attr(node, 'axis')}; expected the last")
        shape, dtype = list(static_shape(x)), x.dtype
        stash = ir.DataType(attr(node, "stash_type", int(ir.DataType.FLOAT)))
        b = Builder(model, node, f"{self.name}/{node.name}")
        xs = b.op("Cast", [x], shape, stash, to=int(stash)) if stash != dtype else x
        reduced = shape[:-1] + [1]
        # x / sqrt(mean(x^2) + eps) as y / sqrt(mean(y^2) + eps/m^2) with y = x/m, m = max|x|/16 per row: trained
        # models' residual rows reach |x| ~ 25000 (SmolLM2-135M), whose square overflows fp16 and spans 6e8 in a 16-bit
        # quantized tensor, where every other row's squares round to 0 (measured: w8a16 prefill max_rel 1.99). Every
        # intermediate here is bounded: y in [-16, 16], mean(y^2) in [256/E, 256], under the range a QDQ graph keeps
        # 16-bit (export/quantize.py WIDE_RANGE). m is max|x|/16, not max|x|: QNN's HTP divides in fp16 by a
        # reciprocal, and 1/25000 is subnormal there, flushed to 0 (measured: such rows' y all zero, layer 0's K/V off
        # by 86%); 16/25000 is not. The identity holds for any m > 0: m is floored at sqrt(eps), so that a zero row (a
        # padding token's embedding) adds at most 1 under the root, not eps/tiny^2, whose range would leave every other
        # row's eps term and root at 0 in a quantized graph.
        epsilon = attr(node, "epsilon", 1e-5)
        floor = b.const(np.array(max(epsilon ** 0.5, np.finfo(stash.numpy()).tiny ** 0.25), stash.numpy()), "floor")
        top = b.op("ReduceMax", [b.op("Abs", [xs], shape, stash)], reduced, stash, axes=[-1], keepdims=1)
        peak = b.op("Max", [b.op("Mul", [top, b.const(np.array(1 / 16, stash.numpy()), "headroom")], reduced, stash),
                            floor], reduced, stash)
        ys = b.op("Div", [xs, peak], shape, stash)
        mean = b.op("ReduceMean", [b.op("Mul", [ys, ys], shape, stash)], reduced, stash, axes=[-1], keepdims=1)
        eps = b.const(np.array(epsilon, stash.numpy()), "epsilon")
        scaled_eps = b.op("Div", [b.op("Div", [eps, peak], reduced, stash), peak], reduced, stash)
        # y / sqrt(...), not y * Reciprocal(sqrt(...)): QNN's HTP computes a 16-bit quantized Reciprocal wrongly
        # (measured: 85% error on the QDQ graph), and one Div is one op fewer.
        rms = b.op("Sqrt", [b.op("Add", [mean, scaled_eps], reduced, stash)], reduced, stash)
        normed = b.op("Div", [ys, rms], shape, stash)
        if stash != dtype:
            normed = b.op("Cast", [normed], shape, dtype, to=int(dtype))
        replace_value(node.outputs[0], b.op("Mul", [normed, scale], shape, dtype))
