"""The ``commfuse`` namespace of ``torch.library``: how commfuse.torch's operators become
dispatcher ops, with a thinner call path than ``torch.library.custom_op``'s.

An op is defined from its Python implementation's type hints (``torch.library.infer_schema``),
the implementation registered as its CPU and CUDA kernel, a fake kernel for tracing, and one
autograd kernel of our own. That kernel is where a call spends its host time, so it takes the
shortest road it may:

* no input needs a gradient and nothing traces the call (no ``Python`` dispatch key: no fake,
  functional or proxy tensors, no dispatch mode): it runs the implementation itself, instead of
  redispatching through the dispatcher back into Python as ``custom_op``'s autograd kernel does
  (which also checks the outputs' aliasing on every call);
* an input needs a gradient: an ``autograd.Function`` built from the op's backward and
  setup-context functions (the signatures of ``register_autograd``), whose forward runs the
  implementation the same way;
* a traced call: the redispatch below autograd, so that fake kernels and functionalization see
  it exactly as they see any ``custom_op``.

An op that mutates arguments bumps their version counters, as PyTorch's in-place ops do, so
that autograd notices a tensor it saved being overwritten.

With the C++ dispatcher kernels (``_native``) the autograd kernel is C++ instead: it takes the
same three roads, the first without entering Python, and sends a call needing a gradient to the
op's twin ``commfuse::<name>_autograd`` (the same schema), whose autograd kernel is the one
above. An op whose calls Python prepares gets a C++ CUDA kernel too, which queues prepared
calls itself and sends the others to the twin's CUDA kernel: the implementation, after which
the C++ table learns what later calls of the signature take.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from . import _native

_LIB = torch.library.Library("commfuse", "DEF")
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_PYTHON, _PYTHON_TLS = torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot


def _traced(keyset) -> bool:
    # two calls rather than a loop over the keys: this runs on every call
    return keyset.has(_PYTHON) or keyset.has(_PYTHON_TLS)


class Op:
    """One op ``commfuse::<name>``: call it as a function to run its implementation directly
    (below the dispatcher), or through ``torch.ops.commfuse.<name>``."""

    def __init__(self, impl: Callable, mutates_args: Sequence[str], native: Optional[int] = None):
        self.name = impl.__name__
        self.impl = impl
        schema = torch.library.infer_schema(impl, mutates_args=tuple(mutates_args))
        _LIB.define(self.name + schema)
        _LIB.impl(self.name, impl, "CPU")
        if _native.loaded:
            twin = self.name + "_autograd"
            _LIB.define(twin + schema)
            _LIB.impl(twin, impl, "CPU")
            if native is None:
                _LIB.impl(self.name, impl, "CUDA")
                _LIB.impl(twin, impl, "CUDA")
            else:
                _native.kernel(self.name, native)
                _LIB.impl(twin, self._serve_miss, "CUDA")
            _LIB.impl(twin, self._autograd_kernel, "Autograd", with_keyset=True)
            _native.route(self.name, twin)
        else:
            _LIB.impl(self.name, impl, "CUDA")
            _LIB.impl(self.name, self._autograd_kernel, "Autograd", with_keyset=True)
        self.overload = getattr(torch.ops.commfuse, self.name).default
        schema_args = self.overload._schema.arguments
        arguments = [a.name for a in schema_args]
        self._mutated = tuple(arguments.index(a) for a in mutates_args)
        # where the tensors are: every call asks whether one needs a gradient, and looking at
        # these alone costs less than torch._C._any_requires_grad over every argument
        types = [str(a.type) for a in schema_args]
        if any(t not in ("Tensor", "Optional[Tensor]") and "Tensor" in t for t in types):
            raise TypeError(f"commfuse::{self.name}: tensor lists are not supported ({types})")
        self._tensors = tuple(i for i, t in enumerate(types) if t in ("Tensor", "Optional[Tensor]"))
        self._function: Optional[type] = None
        self.__doc__ = impl.__doc__

    def __call__(self, *args):
        return self.impl(*args)

    def _serve_miss(self, *args):
        """The twin's CUDA kernel, for a call the C++ table had no prepared call for: the
        implementation, then the table told what later calls of this signature take."""
        _native.last = None
        result = self.impl(*args)
        _native.bind(_native.last, self.name)
        return result

    def register_fake(self, fake: Callable) -> Callable:
        torch.library.register_fake(f"commfuse::{self.name}", fake, lib=_LIB)
        return fake

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """``backward(ctx, *grads)`` gives one gradient (or None) per argument;
        ``setup_context(ctx, inputs, output)`` saves what it needs, as in
        ``torch.library.register_autograd``."""
        op = self

        def forward(*args):
            # (no ctx: setup_context takes it) the last argument is the dispatch key set the
            # call arrived with
            return op._below_autograd(args[-1], args[:-1])

        def setup(ctx, inputs, output):
            setup_context(ctx, inputs[:-1], output)

        def differentiate(ctx, *grads):
            return (*backward(ctx, *grads), None)

        self._function = type(
            f"{self.name}_backward",
            (torch.autograd.Function,),
            {
                "forward": staticmethod(forward),
                "setup_context": staticmethod(setup),
                "backward": staticmethod(differentiate),
            },
        )

    def _below_autograd(self, keyset, args):
        if _traced(keyset):
            with torch._C._AutoDispatchBelowAutograd():
                return self.overload.redispatch(keyset & _AFTER_AUTOGRAD, *args)
        if not self._mutated:
            # no input needs a gradient, so the torch ops inside record none; the outputs are
            # new tensors (opcheck checks they alias nothing)
            return self.impl(*args)
        # below autograd and the version counters, as a backend kernel runs: the torch ops
        # inside bump no versions (the op bumps its own, once)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return self.impl(*args)

    def _needs_grad(self, args) -> bool:
        if not torch.is_grad_enabled():
            return False
        for i in self._tensors:
            t = args[i]
            if t is not None and t.requires_grad:
                return True
        return False

    def _autograd_kernel(self, keyset, *args):
        if self._needs_grad(args):
            if self._function is None:
                raise RuntimeError(
                    f"commfuse::{self.name} has no gradient (it writes into its arguments):"
                    " call it on tensors that do not require grad"
                )
            return self._function.apply(*args, keyset)
        result = self._below_autograd(keyset, args)
        for i in self._mutated:
            torch.autograd.graph.increment_version(args[i])
        return result


def op(mutates_args: Sequence[str] = (), native: Optional[int] = None) -> Callable[[Callable], Op]:
    """Defines ``commfuse::<function name>`` from the decorated implementation; ``native``: the
    C++ CUDA kernel that serves its prepared calls (``_native.GEMM_RS`` and the others)."""
    return lambda impl: Op(impl, mutates_args, native)
