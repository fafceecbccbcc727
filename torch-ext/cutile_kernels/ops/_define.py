"""One definition per op: the ``torch.library`` custom op, its fake, its autograd and its CPU path.

Every op of this package has the same shape. A public function (``rms_norm``, ``attention``, ...)
checks dtypes and calls an :class:`Op`; the ``Op`` goes through its custom op when a graph or a
gradient needs it (:func:`~..dispatch.needs_op`) and calls its implementation directly otherwise,
skipping the dispatcher's overhead in eager decode. The implementation launches the cuTile kernel;
on a tensor that is not on a GPU the ``Op`` runs the reference instead (counted in
``stats()["reference_calls"]``), and ``CUTILE_KERNELS_DISABLE=1`` sends every launch to the fallback
in :func:`~..dispatch.run`. Gradients come from differentiating the reference on the saved inputs
until a backward kernel exists; one then plugs in as ``backward=``.

    _rms_norm = define_op("rms_norm", _rms_norm_cuda, reference=rms_norm_reference,
                          fake=_rms_norm_fake, check=_check_shapes)
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Callable

import torch

from .. import dispatch
from .._ops import add_op_namespace_prefix

#: name -> Op, every op defined in this process (the contract tests walk it).
OPS: dict[str, "Op"] = {}


def contiguous(out):
    """``out`` (a tensor or a tuple of them) with each tensor contiguous: the layout the kernels write."""
    return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out.contiguous()


def _is_tensor_annotation(annotation) -> bool:
    if isinstance(annotation, str):  # postponed annotations: "torch.Tensor", "torch.Tensor | None"
        return "Tensor" in annotation
    return annotation is torch.Tensor or torch.Tensor in typing.get_args(annotation)


class Op:
    """A cuTile op: see the module docstring. Build it with :func:`define_op`.

    Attributes:
        name: the op's name (``<namespace>::<name>`` in ``torch.ops``; the kernel's name in stats).
        op: the ``torch.library`` custom op (what a compiled graph records).
        reference: the PyTorch formula, with the op's arguments (the fallback and the gradient).
        flexible: whether inductor may hand the op its inputs in the layout it chose (the op carries
            ``torch.Tag.flexible_layout``).
    """

    def __init__(self, name: str, cuda: Callable, *, reference: Callable, fake: Callable,
                 check: Callable | None = None, cpu: Callable | None = None,
                 backward: Callable | None | str = "reference", device_arg: int = 0, mutates_args: tuple = (),
                 flexible: bool | None = None):
        self.name = name
        self.reference = reference
        self._cuda = cuda
        self._check = check
        self._cpu = cpu or (lambda *args: contiguous(reference(*args)))
        self._device_arg = device_arg
        params = list(inspect.signature(cuda).parameters.values())
        self._tensor_args = tuple(i for i, p in enumerate(params) if _is_tensor_annotation(p.annotation))
        #: Positions of the arguments the op writes in place (``mutates_args``).
        self.mutated = tuple(i for i, p in enumerate(params) if p.name in mutates_args)
        self.differentiable = backward is not None

        @functools.wraps(cuda)  # the op's schema comes from the implementation's annotations
        def body(*args):
            return self.run(*args)

        @functools.wraps(fake)
        def checked_fake(*args):
            if check is not None:
                check(*args)
            return fake(*args)

        # flexible_layout: inductor hands the op its inputs as they are, where its default copies an
        # input it has not stored yet into a buffer of the traced strides for every op call that
        # reads it (a compiled step then built the attention mask once per layer). The kernels check
        # strides before a launch and fall back on a layout their variant does not take. Ops that
        # write an argument keep the default as a precaution unless declared flexible (rope_append and
        # rope_append_attention, whose cos/sin and mask every layer of a compiled step reads) or named
        # in CUTILE_KERNELS_FLEXIBLE (an A/B switch); CUTILE_KERNELS_FIXED_LAYOUT=1 restores the default
        # for all. Inductor's FX graph cache does not key on these tags: an A/B across processes
        # disables it.
        declared = not mutates_args if flexible is None else flexible
        self.flexible = (declared or name in dispatch.flexible_ops()) and not dispatch.fixed_layout()
        tags = (torch.Tag.flexible_layout,) if self.flexible else ()
        self.op = torch.library.custom_op(add_op_namespace_prefix(name), mutates_args=mutates_args,
                                          tags=tags)(body)
        self.op.register_fake(checked_fake)
        if backward == "reference":
            self.op.register_autograd(self._reference_backward, setup_context=_save_inputs)
        elif backward is not None:
            self.op.register_autograd(backward, setup_context=_save_inputs)

    # __call__ and call_checked run on every eager op call: the steps are inlined, not delegated
    # (each Python frame is ~0.1 us of host time per op, per layer, per decode step).
    def __call__(self, *args):
        """The op on ``args`` (positional, as the implementation takes them)."""
        if self._needs_op(args):
            return self.op(*args)
        if self._check is not None:
            self._check(*args)
        if not args[self._device_arg].is_cuda:
            dispatch.reference_call(self.name)
            return self._cpu(*args)
        return self._cuda(*args)

    def call_checked(self, *args):
        """:meth:`__call__` for a caller that has just run the op's check itself (saves repeating it)."""
        if self._needs_op(args):
            return self.op(*args)
        if not args[self._device_arg].is_cuda:
            dispatch.reference_call(self.name)
            return self._cpu(*args)
        return self._cuda(*args)

    def run(self, *args):
        """The op's eager body: check, then the kernel on CUDA or the reference elsewhere."""
        if self._check is not None:
            self._check(*args)
        return self._run_checked(*args)

    def _run_checked(self, *args):
        if not args[self._device_arg].is_cuda:
            dispatch.reference_call(self.name)
            return self._cpu(*args)
        return self._cuda(*args)

    def _needs_op(self, args) -> bool:
        if torch.compiler.is_compiling():
            return True
        if self.differentiable and torch.is_grad_enabled():
            for i in self._tensor_args:  # a loop, not any(<generator>): this runs on every op call
                t = args[i]
                if t is not None and t.requires_grad:
                    return True
        return False

    def _reference_backward(self, ctx, *grads):
        # No backward kernel: differentiate the reference on the saved inputs.
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if slot is _TENSOR else slot for slot in ctx.slots]
        with torch.enable_grad():
            leaves = []
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    args[i] = a.detach().requires_grad_(True)
                    leaves.append(i)
            outputs = self.reference(*args)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None]
            got = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in leaves], [g for _, g in pairs],
                                      allow_unused=True)
        result = [None] * len(args)
        for i, g in zip(leaves, got):
            result[i] = g
        return tuple(result)


_TENSOR = object()  # marks a tensor argument's slot in ctx.slots (the tensor itself is saved)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*(a for a in inputs if isinstance(a, torch.Tensor)))
    ctx.slots = [_TENSOR if isinstance(a, torch.Tensor) else a for a in inputs]


def define_op(name: str, cuda: Callable, *, reference: Callable, fake: Callable, check: Callable | None = None,
              cpu: Callable | None = None, backward: Callable | None | str = "reference",
              device_arg: int = 0, mutates_args: tuple = (), flexible: bool | None = None) -> Op:
    """Define the op ``name`` and register it in :data:`OPS`.

    Args:
        name: the op name (also the kernel name the dispatcher counts launches and fallbacks under).
        cuda: the implementation on CUDA tensors, with type annotations (``torch.library`` reads the
            op's schema from them): launches the kernel, or falls back through
            :func:`~..dispatch.fallback` itself.
        reference: the PyTorch formula with the same arguments; the CPU path and the gradient.
        fake: the output's shapes, dtypes and strides for fake tensors (must match ``cuda``'s).
        check: raises on arguments the op does not take (runs in eager, in the op and in the fake).
        cpu: the CPU path (default: the reference, made contiguous like the kernels' outputs).
        backward: ``"reference"`` (differentiate ``reference``), a ``register_autograd`` backward
            (a backward kernel), or None (no gradient: the op is only used where none is wanted).
        device_arg: the argument whose device picks the CUDA or the CPU path.
        mutates_args: the arguments the op writes in place (``torch.library``'s ``mutates_args``;
            such an op returns None, its fake too, and has no gradient).
        flexible: whether inductor may hand the op its inputs in the layout it chose
            (``torch.Tag.flexible_layout``); default: when the op writes no argument. Off for every
            op under ``CUTILE_KERNELS_FIXED_LAYOUT=1``.

    Raises:
        ValueError: ``name`` is already defined in this process.
    """
    if name in OPS:
        raise ValueError(f"op {name!r} is defined twice")
    op = Op(name, cuda, reference=reference, fake=fake, check=check, cpu=cpu, backward=backward,
            device_arg=device_arg, mutates_args=mutates_args, flexible=flexible)
    OPS[name] = op
    return op
