"""Arrays as ferry sees them: a pointer, a size, where the bytes live, the element type.

ferry takes any C-contiguous array: torch tensors (CPU or CUDA), objects with
__cuda_array_interface__ (CuPy, Numba), and host objects with the buffer protocol (NumPy,
array.array, bytearray, memoryview). bf16 data may come as torch.bfloat16 or as 2-byte integers
(NumPy has no bf16), fp8 e4m3 as torch.float8_e4m3fn or bytes.
"""

import math

from . import _ferry
from ._errors import InvalidArgument


def _c_strides(shape, item_bytes):
    strides, step = [], item_bytes
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


_TORCH_KINDS = {}  # torch dtype -> its array-interface kind letter


def _torch_kind(tensor):
    dtype = tensor.dtype
    kind = _TORCH_KINDS.get(dtype)
    if kind is None:
        name = str(dtype)
        kind = ("f" if dtype.is_floating_point else "c" if dtype.is_complex
                else "b" if name == "torch.bool" else "u" if name.startswith("torch.uint")
                else "i")
        _TORCH_KINDS[dtype] = kind
    return kind


def as_array(obj, device=None):
    """A ferry.Array describing obj (kept alive by it).

    device: the CUDA ordinal of a __cuda_array_interface__ object that does not say its own
    (ferry.CUDA_UNKNOWN_DEVICE otherwise); ignored for other objects.
    """
    if isinstance(obj, _ferry.Array):
        return obj
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):  # torch.Tensor
        array = _ferry.torch_array(obj)  # a torch tensor of CPU or CUDA memory, read in C++
        if array is not None:
            return array
        # Anything else shaped like one (a subclass's stand-in, a tensor on another device):
        # read here, saying what is wrong.
        if not obj.is_contiguous():
            raise InvalidArgument("expected a contiguous tensor (call .contiguous())")
        device = obj.device
        on_gpu = device.type == "cuda"
        if not on_gpu and device.type != "cpu":
            raise InvalidArgument(f"tensors on {device.type} are not supported")
        item = obj.element_size()
        return _ferry.Array(obj.data_ptr(), obj.numel() * item,
                            (device.index or 0) if on_gpu else _ferry.HOST_MEMORY,
                            _torch_kind(obj), item, False, list(obj.shape), obj)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(cai["shape"])
        typestr = cai["typestr"]
        item_bytes = int(typestr[2:])
        strides = cai.get("strides")
        if strides is not None and tuple(strides) != _c_strides(shape, item_bytes):
            raise InvalidArgument("expected a C-contiguous CUDA array")
        pointer, readonly = cai["data"]
        if device is None:
            own = getattr(getattr(obj, "device", None), "id", None)  # CuPy
            device = own if isinstance(own, int) else _ferry.CUDA_UNKNOWN_DEVICE
        return _ferry.Array(pointer, math.prod(shape) * item_bytes, device, typestr[1],
                            item_bytes, bool(readonly), list(shape), obj)
    return _ferry.host_array(obj)
