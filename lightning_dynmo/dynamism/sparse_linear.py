"""A Linear layer with a pruning mask that can run on a sparse kernel: CSR, BSR or 2:4 semi-structured.

Read in this order: :class:`MaskedLinear` (the module: its state and its two kernels), :class:`_CSRLinear`
(the sparse autograd function), then :func:`time_kernels` (the measurement that picks a kernel).

State, all in the module so that it migrates, re-packs and checkpoints with the layer (no hooks):

- ``weight_mask``: a boolean buffer, ``False`` where the weight is pruned. Pruned entries of ``weight``
  are also exactly zero (:meth:`MaskedLinear.set_mask` zeroes them) and stay zero: both kernels give
  them a zero gradient, so AdamW (whose moments the pruner zeroes too) leaves them at zero.
- ``kernel``: ``"dense"`` (``F.linear`` on ``weight * weight_mask``), ``"csr"`` (the CSR kernel, any
  mask), ``"bsr"`` (block-sparse, for block-pruned masks) or ``"semi_structured"`` (2:4, for 2:4 masks;
  CUDA float16/bfloat16 only), saved in checkpoints through ``get_extra_state`` with ``bsr_block``.
- ``rows_seen``: how many rows (tokens) the last forward multiplied, the shape the kernel choice is
  measured at.

The CSR kernel. Forward ``y = x W^T + b`` is computed as ``(W @ x^T)^T`` with ``W`` in CSR form
(``torch.sparse.mm``); backward computes ``dx = (W^T @ dy^T)^T`` with the transposed pattern in CSR form
and ``dW`` only at the kept entries (SDDMM, ``torch.sparse.sampled_addmm``), scattered into the dense
gradient the optimizer expects. The parameter itself stays a dense tensor (optimizer, migration and
checkpoints are unchanged); the CSR values are gathered from it at each forward, the CSR index pattern
is cached until the mask changes (and rebuilt after a migration, which does not carry it). Both kernels
compute the same function: ``tests/unit/dynamism/test_sparse_linear.py`` compares them forward and
backward in float64.

The structured kernels (:class:`_StructuredLinear`). The forward multiplies by the masked weight
converted to torch's sparse layout at each call (``to_sparse_bsr`` or ``to_sparse_semi_structured``; a
pass over the weight, small next to the product with a micro-batch). BSR also runs the input gradient
on the transposed blocks (two of a training step's three products sparse); 2:4 runs it dense, since a
transposed 2:4 mask is not 2:4. The weight gradient is the dense product restricted to the mask (the
optimizer needs a dense gradient anyway). Where a structured
kernel cannot run the layer's dtype or device (BSR on CPU needs float32/64; semi-structured needs CUDA
and float16/bfloat16), the layer computes the same function on the dense kernel, as the CSR kernel
does under autocast; the pruner refuses to force such a kernel
(:class:`~lightning_dynmo.dynamism.pruning.PruningConfig`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynmo.dynamism.pruning_patterns import is_two_four

__all__ = ["KERNELS", "MaskedLinear", "SparsePattern", "time_kernels"]

#: The kernels a :class:`MaskedLinear` can run.
KERNELS = ("dense", "csr", "bsr", "semi_structured")


@dataclass(frozen=True)
class SparsePattern:
    """The CSR index structure of a mask and of its transpose (a cache; never saved or sent).

    Attributes:
        crow: Row offsets of the mask, ``[out + 1]``.
        col: Column of each kept entry, row-major order, ``[nnz]``.
        flat: Position of each kept entry in the flattened weight (row-major), ``[nnz]``.
        crow_t, col_t, flat_t: The same for the transposed mask (``[in + 1]``, ``[nnz]``, ``[nnz]``);
            ``flat_t`` indexes the flattened (untransposed) weight.
    """

    crow: Tensor
    col: Tensor
    flat: Tensor
    crow_t: Tensor
    col_t: Tensor
    flat_t: Tensor

    @classmethod
    def of(cls, mask: Tensor) -> SparsePattern:
        """The pattern of a boolean ``[out, in]`` mask."""
        out_features, in_features = mask.shape
        rows, cols = mask.nonzero(as_tuple=True)
        rows_t, cols_t = mask.t().nonzero(as_tuple=True)
        return cls(
            crow=_row_offsets(rows, out_features),
            col=cols,
            flat=rows * in_features + cols,
            crow_t=_row_offsets(rows_t, in_features),
            col_t=cols_t,
            flat_t=cols_t * in_features + rows_t,
        )


def _csr(crow: Tensor, col: Tensor, values: Tensor, size: tuple[int, int]) -> Tensor:
    with warnings.catch_warnings():  # torch warns (once) that CSR support is "beta"; we test what we use
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow, col, values, size=size, check_invariants=False)


def _row_offsets(rows: Tensor, num_rows: int) -> Tensor:
    offsets = torch.zeros(num_rows + 1, dtype=torch.int64, device=rows.device)
    offsets[1:] = torch.bincount(rows, minlength=num_rows).cumsum(0)
    return offsets


class _CSRLinear(torch.autograd.Function):
    """``y = x W^T + b`` with ``W`` restricted to ``pattern``, on CSR kernels forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, pattern: SparsePattern) -> Tensor:
        out_features, in_features = weight.shape
        rows = x.reshape(-1, in_features)
        values = weight.detach().reshape(-1)[pattern.flat]
        w_csr = _csr(pattern.crow, pattern.col, values, (out_features, in_features))
        y: Tensor = torch.sparse.mm(w_csr, rows.t()).t()
        y = y + bias if bias is not None else y.contiguous()
        ctx.save_for_backward(rows, weight)
        ctx.pattern, ctx.x_shape, ctx.has_bias = pattern, x.shape, bias is not None
        return y.reshape(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        rows, weight = ctx.saved_tensors
        pattern: SparsePattern = ctx.pattern
        out_features, in_features = weight.shape
        grad_rows = grad_out.reshape(-1, out_features)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            values_t = weight.detach().reshape(-1)[pattern.flat_t]
            wt_csr = _csr(pattern.crow_t, pattern.col_t, values_t, (in_features, out_features))
            grad_x = torch.sparse.mm(wt_csr, grad_rows.t()).t().reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            zeros = weight.new_zeros(pattern.col.numel())
            sampled = _csr(pattern.crow, pattern.col, zeros, (out_features, in_features))
            kept = torch.sparse.sampled_addmm(sampled, grad_rows.t(), rows, beta=0.0).values()
            grad_w = weight.new_zeros(weight.numel())
            grad_w[pattern.flat] = kept
            grad_w = grad_w.view(weight.shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_rows.sum(0)
        return grad_x, grad_w, grad_b, None


class _StructuredLinear(torch.autograd.Function):
    """``y = x (W * mask)^T + b``: forward (and, if ``transposed_too``, the input gradient) on
    ``to_sparse`` of the masked weight (of its transpose)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        mask: Tensor,
        to_sparse: Callable[[Tensor], Tensor],
        transposed_too: bool,
    ) -> Tensor:
        in_features = weight.shape[1]
        rows = x.reshape(-1, in_features)
        masked = weight.detach() * mask
        y = F.linear(rows, to_sparse(masked), bias)
        ctx.save_for_backward(rows, masked, mask)
        ctx.to_sparse, ctx.transposed_too = to_sparse, transposed_too
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(
        ctx: Any, grad_out: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None, None]:
        rows, masked, mask = ctx.saved_tensors
        grad_rows = grad_out.reshape(-1, masked.shape[0]).contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            weight_t = masked.t().contiguous()
            sparse_t = ctx.to_sparse(weight_t) if ctx.transposed_too else weight_t
            grad_x = F.linear(grad_rows, sparse_t).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = (grad_rows.t() @ rows) * mask
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_rows.sum(0)
        return grad_x, grad_w, grad_b, None, None, None


def _bsr(weight: Tensor, block: tuple[int, int]) -> Tensor:
    with warnings.catch_warnings():  # torch warns (once) that BSR support is "beta"; we test what we use
        warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta")
        return weight.to_sparse_bsr(block)


def _semi_structured(weight: Tensor) -> Tensor:
    result: Tensor = torch.sparse.to_sparse_semi_structured(weight)
    return result


class MaskedLinear(nn.Linear):
    """``nn.Linear`` whose weight is masked by ``weight_mask`` and that runs a dense or a CSR kernel.

    Build one directly, or turn an existing ``nn.Linear`` into one in place with :meth:`convert_`
    (its parameters, their optimizer entries and its attributes stay the same objects). A fresh mask
    keeps everything, and the layer computes exactly what ``nn.Linear`` does until something is pruned.
    """

    weight_mask: Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_pruning_state()

    @classmethod
    def convert_(cls, linear: nn.Linear) -> MaskedLinear:
        """Make ``linear`` (exactly an ``nn.Linear``) a :class:`MaskedLinear` in place and return it.

        Only the class changes and the mask buffer is added (as ``torch.nn.utils.parametrize`` swaps the
        class of the modules it parametrizes), so anything holding the module or its parameters (the
        block, an optimizer) keeps working, and no random number is drawn.

        Raises:
            TypeError: ``linear`` is not exactly an ``nn.Linear`` (a subclass may compute something else).
        """
        if isinstance(linear, MaskedLinear):
            return linear
        if type(linear) is not nn.Linear:
            raise TypeError(
                f"MaskedLinear.convert_ takes a plain nn.Linear, got {type(linear).__qualname__}; a subclass "
                "may compute more than x W^T + b. Leave it out of pruning, or build a MaskedLinear instead."
            )
        linear.__class__ = cls
        masked: MaskedLinear = linear  # type: ignore[assignment]
        masked._init_pruning_state()
        return masked

    def _init_pruning_state(self) -> None:
        self.register_buffer("weight_mask", torch.ones_like(self.weight, dtype=torch.bool))
        self._init_flags()

    def _init_flags(self) -> None:
        self.kernel = "dense"
        self.bsr_block = 0  # the block side of a block-pruned mask (set with the "bsr" kernel)
        self.rows_seen = 0
        self._pruned = False
        self._two_four = False
        self._pattern: SparsePattern | None = None

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation; the layer is unpruned again (mask all ``True``, dense kernel).

        Local construction (:mod:`lightning_dynmo.pipeline.model.construction`) materialises a meta-declared
        unit by calling this, so the mask gets defined values there too.
        """
        super().reset_parameters()
        if "weight_mask" in self._buffers:  # nn.Linear.__init__ calls this before the mask exists
            with torch.no_grad():
                self.weight_mask.fill_(True)
            self._init_flags()

    # -- state -----------------------------------------------------------------------------------

    @property
    def sparsity(self) -> float:
        """Fraction of the weight's entries that are pruned."""
        return 1.0 - int(self.weight_mask.sum()) / self.weight_mask.numel()

    @torch.no_grad()
    def set_mask(self, mask: Tensor) -> None:
        """Keep the weight where ``mask`` is ``True``; zero it (for good) where it is ``False``.

        Raises:
            ValueError: ``mask`` has another shape than the weight, or would revive a pruned entry.
        """
        if mask.shape != self.weight.shape:
            raise ValueError(
                f"MaskedLinear.set_mask: the mask has shape {tuple(mask.shape)} but the weight "
                f"{tuple(self.weight.shape)}; give one boolean per weight entry."
            )
        mask = mask.to(device=self.weight_mask.device, dtype=torch.bool)
        if bool((mask & ~self.weight_mask).any()):
            raise ValueError(
                "MaskedLinear.set_mask: the new mask keeps weights that are already pruned; pruning only "
                "removes weights (their values and optimizer state are gone). Pass a mask that is False "
                "wherever weight_mask is False (e.g. new_mask & layer.weight_mask)."
            )
        self.weight_mask.copy_(mask)
        self.weight.mul_(mask)
        self._pruned = not bool(mask.all())
        self._two_four = is_two_four(mask)
        self._pattern = None

    def set_kernel(self, kernel: str, *, bsr_block: int | None = None) -> None:
        """Run ``kernel`` (one of :data:`KERNELS`) from the next forward on.

        Args:
            kernel: The kernel.
            bsr_block: The block side of the mask's blocks; required with ``"bsr"``.
        """
        if kernel not in KERNELS:
            raise ValueError(f"MaskedLinear.set_kernel(kernel={kernel!r}): use one of {KERNELS}.")
        if bsr_block is not None:
            self.bsr_block = bsr_block
        if kernel == "bsr" and self.bsr_block < 1:
            raise ValueError(
                "MaskedLinear.set_kernel(kernel='bsr') needs bsr_block, the side of the mask's square blocks "
                "(PruningConfig.block_size), e.g. set_kernel('bsr', bsr_block=32)."
            )
        self.kernel = kernel

    def get_extra_state(self) -> dict[str, Any]:
        """The kernel choice, saved with the mask in checkpoints."""
        return {"kernel": self.kernel, "bsr_block": self.bsr_block}

    def set_extra_state(self, state: Any) -> None:
        """Restore the kernel choice of a checkpoint (the mask is a buffer, loaded by torch)."""
        self.set_kernel(state["kernel"], bsr_block=state.get("bsr_block", 0))
        self._pattern = None

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._pruned = not bool(self.weight_mask.all())  # the mask may have changed on load
        self._two_four = is_two_four(self.weight_mask)
        self._pattern = None

    def __getstate__(self) -> dict[str, Any]:
        # The CSR pattern is a cache of the mask (and sparse tensors cannot migrate): rebuilt on arrival.
        state = dict(super().__getstate__())  # type: ignore[no-untyped-call]
        state["_pattern"] = None
        return state

    # -- compute ---------------------------------------------------------------------------------

    @property
    def csr_supported(self) -> bool:
        """Whether the CSR kernel can run this layer's dtype here (torch's CPU CSR kernels: float32/64)."""
        return self.weight.device.type != "cpu" or self.weight.dtype in (torch.float32, torch.float64)

    def supports(self, kernel: str) -> bool:
        """Whether ``kernel`` can run this layer here (BSR and CSR on CPU: float32/64; semi-structured:
        CUDA float16/bfloat16, and a mask that keeps at most 2 of every 4 consecutive inputs)."""
        if kernel == "semi_structured":  # and only once the mask keeps at most 2 of every 4
            half = self.weight.dtype in (torch.float16, torch.bfloat16)
            return self.weight.is_cuda and half and self._two_four
        if kernel in ("csr", "bsr"):
            return self.csr_supported
        return kernel == "dense"

    def forward(self, x: Tensor) -> Tensor:
        """``x W^T + b`` with the pruned entries of ``W`` left out, on the chosen kernel.

        The CSR kernel computes in the weight's dtype; under autocast, or for an input of another dtype,
        or a dtype the device's CSR kernels lack, the layer runs the dense kernel (same function).
        """
        self.rows_seen = x.numel() // self.in_features
        if not self._pruned:
            return F.linear(x, self.weight, self.bias)
        if self.kernel != "dense" and self._sparse_runs(x):
            return self.forward_kernel(self.kernel)(x)
        return self.forward_dense(x)

    def _sparse_runs(self, x: Tensor) -> bool:
        autocast = torch.is_autocast_enabled(x.device.type)
        return not autocast and x.dtype == self.weight.dtype and self.supports(self.kernel)

    def forward_kernel(self, kernel: str) -> Callable[[Tensor], Tensor]:
        """The forward of ``kernel`` (one of :data:`KERNELS`), whatever the layer's current choice."""
        kernels = {
            "dense": self.forward_dense,
            "csr": self.forward_csr,
            "bsr": self.forward_bsr,
            "semi_structured": self.forward_semi_structured,
        }
        return kernels[kernel]

    def forward_dense(self, x: Tensor) -> Tensor:
        """The dense kernel: ``F.linear`` on the masked weight."""
        return F.linear(x, self.weight * self.weight_mask, self.bias)

    def forward_csr(self, x: Tensor) -> Tensor:
        """The sparse kernel (CSR forward, CSR and SDDMM backward)."""
        if self._pattern is None or self._pattern.crow.device != self.weight.device:
            self._pattern = SparsePattern.of(self.weight_mask.to(self.weight.device))
        result: Tensor = _CSRLinear.apply(x, self.weight, self.bias, self._pattern)  # type: ignore[no-untyped-call]
        return result

    def forward_bsr(self, x: Tensor) -> Tensor:
        """The block-sparse kernel (BSR forward and input gradient; ``bsr_block`` must tile the mask)."""
        block = (self.bsr_block, self.bsr_block)
        return self._structured(x, lambda w: _bsr(w, block), transposed_too=True)

    def forward_semi_structured(self, x: Tensor) -> Tensor:
        """The 2:4 semi-structured kernel (CUDA float16/bfloat16; the mask must be a 2:4 sub-pattern)."""
        # A 2:4 mask transposed is not 2:4: the input gradient multiplies the dense masked weight.
        return self._structured(x, _semi_structured, transposed_too=False)

    def _structured(
        self, x: Tensor, to_sparse: Callable[[Tensor], Tensor], *, transposed_too: bool
    ) -> Tensor:
        mask = self.weight_mask.to(self.weight.dtype)
        result: Tensor = _StructuredLinear.apply(x, self.weight, self.bias, mask, to_sparse, transposed_too)  # type: ignore[no-untyped-call]
        return result

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sparsity={self.sparsity:.3f}, kernel={self.kernel}"


def time_kernels(
    layer: MaskedLinear,
    rows: int,
    *,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    sparse_kernel: str = "csr",
) -> dict[str, float]:
    """Seconds of one forward + backward of ``layer`` on dense and on ``sparse_kernel``, at ``rows`` rows.

    Runs on the layer's device and dtype with a random input, without touching the layer's ``.grad``
    (gradients come from ``torch.autograd.grad``). The kernels alternate, after one warm-up of each, so
    a change of machine load hits both alike, and each kernel's figure is its fastest of ``repeats``
    runs: load from other processes only ever adds time, so the minimum is the least disturbed estimate
    of what the kernel costs. On CUDA each timing synchronises the device.

    Returns:
        ``{"dense": seconds, sparse_kernel: seconds}``.
    """
    weight = layer.weight
    x = torch.randn(rows, layer.in_features, device=weight.device, dtype=weight.dtype, requires_grad=True)
    grad_out = torch.randn(rows, layer.out_features, device=weight.device, dtype=weight.dtype)
    inputs = [t for t in (x, weight, layer.bias) if t is not None and t.requires_grad]
    kernels = {"dense": layer.forward_dense, sparse_kernel: layer.forward_kernel(sparse_kernel)}
    on_cuda = weight.device.type == "cuda"

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize(weight.device)

    def once(kernel: Callable[[Tensor], Tensor]) -> float:
        sync()
        start = clock()
        torch.autograd.grad(kernel(x), inputs, grad_out)
        sync()
        return clock() - start

    times: dict[str, list[float]] = {name: [] for name in kernels}
    for kernel in kernels.values():
        once(kernel)  # warm-up: allocator, CSR pattern
    for _ in range(repeats):
        for name, kernel in kernels.items():
            times[name].append(once(kernel))
    return {name: min(values) for name, values in times.items()}
