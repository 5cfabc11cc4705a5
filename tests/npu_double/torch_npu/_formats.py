"""NPU tensor formats: ``npu_format_cast``, ``get_npu_format`` and
``torch.npu.config.allow_internal_format``, as torch_npu 2.8.0 defines them
(op-plugin 7.2.0 ``docs/context/（beta）torch_npu-npu_format_cast.md``,
``（beta）torch_npu-npu-config-allow_internal_format.md``).

The format of an NPU tensor belongs to its storage (torch_npu keeps it in
the storage's ``npu_desc_``): a view, or a Parameter whose ``.data`` was set
to the tensor, has the format of the storage it shares. The double's tensors
are CPU tensors, so the format lives here, by storage; a storage the double
never cast has its base format (ND; NCHW for 4-D, the doc's example,
npu_format_cast.md:58-60).

What the double refuses, as the device does:

- an internal format while ``allow_internal_format`` is False: the cast
  makes the tensor in its base format instead and warns once (torch_npu's
  ``unsafe_empty_with_format``: "Cannot create tensor with interal format
  while allow_internel_format=False, tensor will be created with base
  format."), so the kernels then read ND. The switch defaults to True on an
  Atlas A2 and False on an Atlas A3
  (npu-config-allow_internal_format.md:24-25);
- a cast to FRACTAL_NZ of a non-contiguous tensor: the docs cast a
  contiguous (k, n) layout (torch_npu-npu_quant_matmul.md:370,432, "please
  ensure that the input is continuous");
- an NZ tensor where an op takes ND only, and an NZ weight that is a
  transposed or sliced view (``check_nd``, ``check_nz_weight``): a cast
  changes the physical layout of the whole base tensor and keeps the view's
  metadata, so a view of NZ storage is not an NZ matrix of its shape.

An NZ tensor's storage is padded to whole fractals: the last two dims
(rows, cols) are stored as [ceil(cols / C0), ceil(rows / 16), 16, C0] with
C0 = 32 bytes / element size (16 for 16-bit types, 32 for int8), the cube
unit (npu_format_cast.md:33 describes C0 as the cube size; the layout is
CANN's "数据排布格式", linked at :46). ``storage_bytes`` gives that size.
"""

import math
import warnings
from typing import Union

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import npu as _npu
from ._trace import record

# torch_npu.Format (npu_format_cast.md:27-43).
NCHW, NHWC, ND, NC1HWC0, FRACTAL_Z = 0, 1, 2, 3, 4
NC1HWC0_C04, HWCN, NDHWC, FRACTAL_NZ, NCDHW = 12, 16, 27, 29, 30
NDC1HWC0, FRACTAL_Z_3D, NC, NCL = 32, 33, 35, 47
BASE_FORMATS = frozenset({NCHW, NHWC, ND, HWCN, NDHWC, NCDHW, NC, NCL})
KNOWN_FORMATS = BASE_FORMATS | {
    NC1HWC0, FRACTAL_Z, NC1HWC0_C04, FRACTAL_NZ, NDC1HWC0, FRACTAL_Z_3D
}
# The formats the double computes a cast to; the others are refused as
# not modelled (the plugin casts to FRACTAL_NZ and ND only).
MODELLED = BASE_FORMATS | {FRACTAL_NZ}

_formats = WeakIdKeyDictionary()  # untyped storage -> format
_warned = False


class _Config:
    """``torch.npu.config``: ``allow_internal_format`` defaults by SoC."""

    def __init__(self) -> None:
        self._allow = None

    @property
    def allow_internal_format(self) -> bool:
        if self._allow is None:
            # Atlas A3 (SoC 250-255): False; otherwise True (:24-25).
            return not 250 <= _npu.soc_version() <= 255
        return self._allow

    @allow_internal_format.setter
    def allow_internal_format(self, value: bool) -> None:
        self._allow = bool(value)

    def reset(self) -> None:
        """Back to the SoC's default (tests)."""
        self._allow = None


config = _Config()


def base_format(t: torch.Tensor) -> int:
    """The format torch_npu gives a tensor it did not cast."""
    return {4: NCHW, 5: NCDHW}.get(t.dim(), ND)


def format_of(t: torch.Tensor) -> int:
    """``get_npu_format`` without recording a call site (the double's own
    checks)."""
    return _formats.get(t.untyped_storage(), base_format(t))


def get_npu_format(t: torch.Tensor) -> int:
    """``torch_npu.get_npu_format(tensor) -> int``
    (（beta）at_npu-native-get_npu_format.md:10-15)."""
    record("torch_npu.get_npu_format")
    if not isinstance(t, torch.Tensor):
        raise TypeError("get_npu_format(): argument 'self' must be Tensor, "
                        f"not {type(t).__name__}")
    return format_of(t)


def npu_format_cast(input: torch.Tensor,
                    acl_format: Union[int, torch.Tensor]) -> torch.Tensor:
    """``torch_npu.npu_format_cast(input, acl_format) -> Tensor``
    (npu_format_cast.md:19): a new tensor of the same values in
    ``acl_format`` (an int, a torch_npu.Format or a tensor whose format to
    take); ``input`` is left as it was (:14)."""
    record("torch_npu.npu_format_cast")
    op = "npu_format_cast"
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{op}(): argument 'input' must be Tensor")
    if isinstance(acl_format, torch.Tensor):
        acl_format = format_of(acl_format)
    if not isinstance(acl_format, int) or isinstance(acl_format, bool):
        raise TypeError(f"{op}(): argument 'acl_format' must be int, not "
                        f"{type(acl_format).__name__}")
    if acl_format not in KNOWN_FORMATS:
        raise RuntimeError(f"{op}: unknown format {acl_format}")
    if acl_format not in MODELLED:
        raise NotImplementedError(
            f"the double casts to base formats and FRACTAL_NZ only, not "
            f"{acl_format}")
    current = format_of(input)
    if current == acl_format:
        return input  # torch_npu returns the input itself
    if acl_format in BASE_FORMATS and current in BASE_FORMATS:
        # Base to base relabels the storage (format_cast_as_base_format).
        _formats[input.untyped_storage()] = acl_format
        return input
    if acl_format == FRACTAL_NZ:
        if input.dim() < 2:
            raise RuntimeError(f"{op}: FRACTAL_NZ needs at least 2 dims, got "
                               f"{list(input.shape)}")
        if not input.is_contiguous():
            raise RuntimeError(
                f"{op}: cast a contiguous tensor to FRACTAL_NZ "
                f"(npu_quant_matmul.md:432); got strides "
                f"{list(input.stride())} for shape {list(input.shape)}")
    _npu.state.kernel_launched()  # a TransData kernel
    out = input.clone()
    if acl_format == FRACTAL_NZ and not config.allow_internal_format:
        global _warned
        if not _warned:
            _warned = True
            warnings.warn(
                "Cannot create tensor with interal format while "
                "allow_internel_format=False, tensor will be created with "
                "base format.", stacklevel=2)
        acl_format = base_format(input)
    _formats[out.untyped_storage()] = acl_format
    return out


def storage_bytes(t: torch.Tensor) -> int:
    """Device bytes of ``t``'s data in its format: NZ pads the last two
    dims to whole fractals."""
    if format_of(t) != FRACTAL_NZ:
        return t.numel() * t.element_size()
    *batch, rows, cols = t.shape
    c0 = 32 // t.element_size()
    padded = math.ceil(rows / 16) * 16 * math.ceil(cols / c0) * c0
    return math.prod(batch) * padded * t.element_size()


def check_nd(t, op: str, name: str) -> None:
    """``name`` of ``op`` takes ND only (the op's doc: 数据格式支持ND)."""
    if isinstance(t, torch.Tensor) and format_of(t) not in BASE_FORMATS:
        raise RuntimeError(f"{op}: {name} must be ND; got format "
                           f"{format_of(t)}")


def check_nz_weight(t: torch.Tensor, op: str, name: str) -> None:
    """A weight the op takes in ND or FRACTAL_NZ: an NZ one must be the
    whole contiguous tensor that was cast ((k, n) per matrix), not a
    transposed or sliced view of it."""
    fmt = format_of(t)
    if fmt in BASE_FORMATS:
        return
    if fmt != FRACTAL_NZ:
        raise RuntimeError(f"{op}: {name} must be ND or FRACTAL_NZ; got "
                           f"format {fmt}")
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    if not (t.is_contiguous() and t.storage_offset() == 0 and whole):
        raise RuntimeError(
            f"{op}: a FRACTAL_NZ {name} must be the contiguous (k, n) "
            f"tensor that was cast, not a view of it (shape "
            f"{list(t.shape)}, strides {list(t.stride())}): transpose "
            "before npu_format_cast (npu_quant_matmul.md:96-97,432)")
