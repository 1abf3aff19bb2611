"""What the benchmark's state dict looks like: uniform tensors, or a transformer with its Adam state.

A :class:`Layout` names each tensor's key path in the (nested) state dict and
its shape, in order; every method moves the same tensors, and the receive is
checked tensor by tensor in that order. All tensors are float32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KeyPath = tuple[str | int, ...]

UNIFORM = "uniform"
TRANSFORMER = "transformer"
LAYOUTS = (UNIFORM, TRANSFORMER)
_FLOAT32 = 4


@dataclass(frozen=True)
class Layout:
    """Each tensor's key path and shape, in order, and the state's non-tensor leaves."""

    paths: tuple[KeyPath, ...]
    shapes: tuple[tuple[int, ...], ...]
    extras: tuple[tuple[KeyPath, Any], ...] = ()  # e.g. an optimizer's param_groups
    description: str = ""

    @property
    def sizes(self) -> list[int]:
        """Bytes of each tensor, in order."""
        return [math.prod(shape) * _FLOAT32 for shape in self.shapes]

    def state(self, tensors: Sequence[Any]) -> dict[Any, Any]:
        """The state dict holding ``tensors`` (one per path, in order) and the extras."""
        state: dict[Any, Any] = {}
        for path, value in [*zip(self.paths, tensors, strict=True), *self.extras]:
            node = state
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value
        return state

    def tensors_in(self, state: Any) -> list[Any]:
        """The tensors of a received ``state``, in layout order (a missing path raises KeyError)."""
        found = []
        for path in self.paths:
            node = state
            for key in path:
                node = node[key]
            found.append(node)
        return found


def uniform(total_bytes: int, tensor_bytes: int) -> Layout:
    """``total_bytes`` as flat tensors of ``tensor_bytes`` (the last one smaller), named ``layerNNNNNN.weight``."""
    full, rest = divmod(total_bytes, tensor_bytes)
    sizes = [tensor_bytes] * full + ([rest] if rest else [])
    return Layout(
        tuple((f"layer{index:06d}.weight",) for index in range(len(sizes))),
        tuple((max(1, nbytes // _FLOAT32),) for nbytes in sizes),
    )


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer: embedding, blocks of attention and MLP with biases and norms, head."""

    layers: int
    hidden: int
    vocab: int

    @property
    def ffn(self) -> int:
        return 4 * self.hidden

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        """``model.named_parameters()``: names and shapes, in module order."""
        h, f = self.hidden, self.ffn
        params: list[tuple[str, tuple[int, ...]]] = [("embed_tokens.weight", (self.vocab, h))]
        for layer in range(self.layers):
            block = f"layers.{layer}."
            params += [(block + "input_norm.weight", (h,)), (block + "input_norm.bias", (h,))]
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                params += [(block + f"attn.{proj}.weight", (h, h)), (block + f"attn.{proj}.bias", (h,))]
            params += [(block + "post_attn_norm.weight", (h,)), (block + "post_attn_norm.bias", (h,))]
            params += [(block + "mlp.up_proj.weight", (f, h)), (block + "mlp.up_proj.bias", (f,))]
            params += [(block + "mlp.down_proj.weight", (h, f)), (block + "mlp.down_proj.bias", (h,))]
        params += [("norm.weight", (h,)), ("norm.bias", (h,)), ("lm_head.weight", (self.vocab, h))]
        return params

    def per_layer_parameters(self) -> int:
        h, f = self.hidden, self.ffn
        return 4 * (h * h + h) + (f * h + f) + (h * f + h) + 4 * h


def transformer_shape(total_bytes: int) -> TransformerShape:
    """The shape whose weights and two Adam moments (float32) come closest to ``total_bytes``.

    GiB-sized states get hidden 768 and a 32,000-token vocabulary (about
    7.1 M parameters, 85 MiB with Adam, per block); small ones, for smoke
    runs, hidden 64 and 256 tokens.
    """
    hidden, vocab = (768, 32000) if total_bytes >= 1 << 30 else (64, 256)
    shape = TransformerShape(1, hidden, vocab)
    fixed = 2 * vocab * hidden + 2 * hidden  # embedding, head, final norm
    per_param_bytes = 3 * _FLOAT32  # the weight and Adam's exp_avg and exp_avg_sq
    layers = round((total_bytes / per_param_bytes - fixed) / shape.per_layer_parameters())
    return TransformerShape(max(1, layers), hidden, vocab)


def transformer(total_bytes: int) -> Layout:
    """A transformer's state as a trainer checkpoints it: ``{"model": ..., "optim": Adam's state_dict}``.

    The model's parameters by name, then for each parameter (by index, as
    ``torch.optim.Adam.state_dict()`` has it) its ``step`` (a 0-d tensor),
    ``exp_avg`` and ``exp_avg_sq``, and the optimizer's ``param_groups``.
    """
    shape = transformer_shape(total_bytes)
    params = shape.parameters()
    paths: list[KeyPath] = [("model", name) for name, _ in params]
    shapes: list[tuple[int, ...]] = [dims for _, dims in params]
    for index, (_, dims) in enumerate(params):
        paths += [("optim", "state", index, "step"), ("optim", "state", index, "exp_avg")]
        paths += [("optim", "state", index, "exp_avg_sq")]
        shapes += [(), dims, dims]
    group = {
        "lr": 3e-4,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "params": list(range(len(params))),
    }
    description = (
        f"a transformer: blocks {shape.layers}, hidden {shape.hidden}, vocabulary {shape.vocab}; "
        f"{len(params)} parameters, each with Adam's step, exp_avg and exp_avg_sq"
    )
    return Layout(tuple(paths), tuple(shapes), ((("optim", "param_groups"), [group]),), description)


@functools.cache
def layout_of(kind: str, total_bytes: int, tensor_bytes: int) -> Layout:
    """The layout a scenario names (``tensor_bytes`` matters for ``uniform`` only)."""
    if kind == UNIFORM:
        return uniform(total_bytes, tensor_bytes)
    if kind == TRANSFORMER:
        return transformer(total_bytes)
    raise ValueError(f"unknown layout {kind!r}; expected one of {', '.join(LAYOUTS)}")
