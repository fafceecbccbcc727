"""Reading kernel parameter layouts out of a cubin, and packing arguments to match them.

cuTile's calling convention ``cutile_python_v1``: parameters in Python order, ``ct.Constant``
parameters omitted; an array passes a 64-bit pointer, then its shape, then its strides (in
elements; int32 unless the array was declared with int64 indices); a scalar passes its C type.
The driver copies each parameter from the address we give it, so what must match the cubin is
the number, order and size of the parameters. The cubin's ``.nv.info.<symbol>`` section records
them (``EIATTR_KPARAM_INFO``, or its second form in cubins that use TMA); :func:`param_info`
reads it so that the launcher can refuse to
launch a kernel whose parameters disagree with our packing instead of passing garbage.
"""

from __future__ import annotations

import struct

_EIATTR_KPARAM_INFO = 0x17  # index u32, ordinal u16, offset u16, flags u32 (size in bits 18..31)
_EIATTR_KPARAM_INFO_V2 = 0x45  # index u32, ordinal u16, offset u16, size u16, ..., flags u8
_EIFMT_SVAL = 0x04

#: struct codes and sizes of the scalar types a kernel may take.
SCALAR_CODES = {"float32": "f", "float64": "d", "int32": "i", "int64": "q", "bool": "?"}


def _sections(data: bytes):
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = heads[shstrndx][4]
    for name_off, _typ, _flags, _addr, offset, size in heads:
        end = data.index(b"\0", strtab + name_off)
        yield data[strtab + name_off:end].decode(), offset, size


def param_info(cubin: bytes, symbol: str) -> list[tuple[int, int]]:
    """(offset, size) in bytes of every parameter of ``symbol``, in ordinal order.

    Raises:
        KeyError: the cubin has no ``.nv.info`` section for ``symbol``.
        ValueError: the data is not a cubin.
    """
    for name, offset, size in _sections(cubin):
        if name != f".nv.info.{symbol}":
            continue
        params = {}
        p, end = offset, offset + size
        while p < end:
            fmt, attr = cubin[p], cubin[p + 1]
            if fmt == _EIFMT_SVAL:
                length = struct.unpack_from("<H", cubin, p + 2)[0]
                payload = cubin[p + 4:p + 4 + length]
                p += 4 + length
            else:
                payload = b""
                p += 4
            if attr == _EIATTR_KPARAM_INFO:
                _index, ordinal, poffset, flags = struct.unpack_from("<IHHI", payload)
                params[ordinal] = (poffset, (flags >> 18) & 0x3FFF)
            elif attr == _EIATTR_KPARAM_INFO_V2:
                _index, ordinal, poffset, psize = struct.unpack_from("<IHHH", payload)
                params[ordinal] = (poffset, psize)
        return [params[i] for i in sorted(params)]
    raise KeyError(f"no parameter info for {symbol} in cubin")


class ArgPacker:
    """Packs a call's arguments into the byte layout of ``cutile_python_v1``.

    Built once per variant from the manifest's parameter list. :meth:`values` flattens the
    arguments (pointer, shape, strides per array; the value per scalar); :attr:`struct` packs them
    with C alignment; :attr:`offsets` are the byte offsets of the driver-visible parameters.
    """

    def __init__(self, params: list[dict]):
        fmt, offsets, sizes, pos = ["<"], [], [], 0
        self.plan = []  # per non-constant param: (kind, ndim, size-1 stride fixups)
        for i, p in enumerate(params):
            if p["kind"] == "constant":
                continue
            if p["kind"] == "array":
                idx = "q" if p["index_dtype"] == "int64" else "i"
                codes = ["Q"] + [idx] * (2 * p["ndim"])
                fix = tuple(1 if d in p["stride_one"] else p["stride_divisible_by"][d] for d in range(p["ndim"]))
                self.plan.append(("array", i, p["ndim"], fix))
            elif p["kind"] == "scalar":
                codes = [SCALAR_CODES[p["dtype"]]]
                self.plan.append(("scalar", i, 0, ()))
            else:
                raise ValueError(f"unknown parameter kind {p['kind']!r}")
            for code in codes:
                size = struct.calcsize(code)
                pad = -pos % size
                if pad:
                    fmt.append(f"{pad}x")
                pos += pad
                offsets.append(pos)
                sizes.append(size)
                fmt.append(code)
                pos += size
        self.struct = struct.Struct("".join(fmt))
        self.offsets = offsets
        self.sizes = sizes

    @property
    def layout(self) -> list[tuple[int, int]]:
        """(offset, size) of each driver-visible parameter, comparable with :func:`param_info`."""
        return list(zip(self.offsets, self.sizes))

    def template(self, args) -> tuple[list, list, list]:
        """The parameter values of a call whose shapes and strides are fixed, with the slots that
        change from call to call: ``(values, [(slot, arg index) of pointers], [(slot, arg index)
        of scalars])``. :meth:`values` equals ``values`` with those slots filled in."""
        values = self.values(args)
        ptr_slots, scalar_slots, pos = [], [], 0
        for kind, i, ndim, _fix in self.plan:
            if kind == "scalar":
                scalar_slots.append((pos, i))
                pos += 1
            else:
                ptr_slots.append((pos, i))
                pos += 1 + 2 * ndim
        return values, ptr_slots, scalar_slots

    def values(self, args) -> list:
        """The flat parameter values of a call (``args`` in Python order, constants included).

        A dimension of size 1 is only ever indexed at 0, so its stride does not matter to the
        kernel; torch gives such dimensions arbitrary strides, so it is replaced by the
        contiguous stride rounded up to the variant's divisibility (what TMA descriptors accept).
        """
        out = []
        for kind, i, ndim, fix in self.plan:
            a = args[i]
            if kind == "scalar":
                out.append(a)
                continue
            shape, strides = a.shape, a.stride()
            out.append(a.data_ptr())
            out.extend(shape)
            if 1 in shape:
                strides = [_unit_dim_stride(shape, d, fix[d]) if shape[d] == 1 else strides[d] for d in range(ndim)]
            out.extend(strides)
        return out


def _unit_dim_stride(shape, d: int, divisor: int) -> int:
    inner = 1
    for s in shape[d + 1:]:
        inner *= max(int(s), 1)
    return -(-inner // divisor) * divisor
