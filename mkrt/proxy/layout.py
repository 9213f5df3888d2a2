"""The command queue's wire format, shared by the GPU (producer) and the host proxy.

Pure numpy: device code (mkrt/kernels/device/queue.py) and the host side
(mkrt/proxy/queue.py, the proxy loop, the transports) both build on it.

The command is defined ONCE, here, as a numpy dtype (:data:`COMMAND_DTYPE`). From it come
  * the C struct ``mkrt::Command`` (:func:`command_struct_source`) compiled into kernels,
    with a ``static_assert`` on its size (the dtype is checked to have no padding, and a
    GPU test reads every offset back from a kernel), and
  * the (word, shift, mask) constants the compiled proxy loop decodes with
    (:data:`FIELDS`), so C, the proxy loop and Python cannot drift.

A command is 64 bytes (8 u64 words). Word 0 (``valid``) is written last by the producer
with a release store and holds ``ticket + 1``: the proxy expecting ticket ``t`` at slot
``t % slots`` takes it only when ``valid == t + 1``, so a slot left from the previous lap
never looks ready and slots never need clearing.

Queue header (per queue, :data:`HEADER_WORDS` u64 words in host memory the GPU maps):
  [TAIL]        commands the proxy has consumed (the producer's space bound)
  [DONE]        commands whose transport work has completed
  [ERROR]       0, or the proxy error code | detail << 8 (producers' waits check it)
  [ERROR_TICKET] ticket of the command that failed
  [HOST_HEAD]   the claim counter of host-side producers (GPU producers use device memory)
  [REPLY..]     8 words for flags the proxy writes back to this queue's poster, in the
                allocation it posts into (one machine waited 0.27 us less for them than
                for a flag of its own allocation; later machines showed no consistent
                difference: experiments/notes/proxy.md)
"""

from __future__ import annotations

import numpy as np

# ---- opcodes ---------------------------------------------------------------------------
OP_NOP = 0
OP_PUT = 1          # copy bytes: (src rank = queue's rank, src_region, src_offset) -> (dst_rank, dst_region, dst_offset)
OP_PUT_SIGNAL = 2   # put, then write signal_value at (dst_rank, signal_region, signal_offset)
OP_SIGNAL = 3       # write signal_value at (dst_rank, signal_region, signal_offset)
OP_FENCE = 4        # earlier commands of this queue complete first; optional signal after
OP_BARRIER = 5      # fence, then signal every rank r at (r, signal_region, signal_offset + 8 * my_rank)
OPCODE_NAMES = {OP_NOP: "nop", OP_PUT: "put", OP_PUT_SIGNAL: "put_signal", OP_SIGNAL: "signal",
                OP_FENCE: "fence", OP_BARRIER: "barrier"}
NO_REGION = 0xFFFF  # "no signal" in signal_region (fence without completion signal)

COMMAND_DTYPE = np.dtype([
    ("valid", "<u8"),           # ticket + 1, release-stored last
    ("opcode", "<u2"),
    ("dst_rank", "<u2"),
    ("src_region", "<u2"),
    ("dst_region", "<u2"),
    ("src_offset", "<u8"),
    ("dst_offset", "<u8"),
    ("bytes", "<u8"),
    ("signal_offset", "<u8"),
    ("signal_value", "<u8"),
    ("signal_region", "<u2"),
    ("flags", "<u2"),
    ("reserved", "<u4"),
])
COMMAND_BYTES = 64
COMMAND_WORDS = COMMAND_BYTES // 8
if COMMAND_DTYPE.itemsize != COMMAND_BYTES:  # import-time layout guard
    raise ImportError(f"mkrt.proxy: command is {COMMAND_DTYPE.itemsize} bytes, expected 64")


def _field_constants(dtype: np.dtype) -> dict[str, tuple[int, int, int]]:
    out = {}
    for name, (sub, offset) in dtype.fields.items():
        word, byte = divmod(offset, 8)
        if byte + sub.itemsize > 8:
            raise ImportError(f"mkrt.proxy: field {name} crosses a u64 word ({offset=})")
        mask = (1 << (8 * sub.itemsize)) - 1
        out[name] = (word, 8 * byte, mask)
    return out


def _check_packed(dtype: np.dtype) -> None:
    expected = 0
    for name, (sub, offset) in dtype.fields.items():
        if offset != expected or offset % sub.itemsize:
            raise ImportError(f"mkrt.proxy: command field {name} at {offset=} leaves padding or "
                              f"is misaligned; C's layout would differ from the dtype")
        expected += sub.itemsize
    if expected != dtype.itemsize:
        raise ImportError("mkrt.proxy: command dtype has trailing padding")


_check_packed(COMMAND_DTYPE)

#: field -> (u64 word, bit shift, mask); what the compiled loop decodes with
FIELDS = _field_constants(COMMAND_DTYPE)

# ---- queue header ----------------------------------------------------------------------
HEADER_WORDS = 32            # 256 bytes per queue; hot words on separate 64-byte lines
H_TAIL = 0
H_DONE = 8
H_ERROR = 9
H_ERROR_TICKET = 10
H_HOST_HEAD = 16
H_REPLY = 24
REPLY_WORDS = 8

# ---- proxy error codes (low 8 bits of the error word; detail above) --------------------
E_OPCODE = 1
E_RANK = 2
E_REGION = 3
E_BOUNDS = 4
E_ALIGN = 5
E_TRANSPORT = 6
E_STOPPED = 7
ERROR_NAMES = {E_OPCODE: "unknown opcode", E_RANK: "destination rank out of range",
               E_REGION: "region not registered", E_BOUNDS: "offset out of the region",
               E_ALIGN: "signal offset not 8-byte aligned", E_TRANSPORT: "transport failure",
               E_STOPPED: "proxy stopped"}

# ---- region table ----------------------------------------------------------------------
REGION_DEVICE = 0
REGION_HOST = 1
REGION_WORDS = 4             # base, size, kind, registered


def new_region_table(ranks: int, regions: int) -> np.ndarray:
    """(rank, region) -> [base address, size, kind, registered] as u64 words."""
    if ranks < 1 or regions < 1 or ranks > 0xFFFF or regions >= NO_REGION:
        raise ValueError(f"mkrt.proxy: region table needs 1 <= ranks <= 65535 and "
                         f"1 <= regions < {NO_REGION}; got {ranks=}, {regions=}")
    return np.zeros((ranks, regions, REGION_WORDS), dtype=np.uint64)


def set_region(table: np.ndarray, rank: int, region: int, base: int, size: int,
               kind: int = REGION_DEVICE) -> None:
    """Register memory the proxy may read or write: what memory.py fills per buffer."""
    ranks, regions, _ = table.shape
    if not (0 <= rank < ranks and 0 <= region < regions):
        raise ValueError(f"mkrt.proxy: region ({rank=}, {region=}) outside the table "
                         f"({ranks} ranks x {regions} regions)")
    if base <= 0 or size <= 0:
        raise ValueError(f"mkrt.proxy: region ({rank=}, {region=}) needs base > 0 and size > 0; "
                         f"got {base=:#x}, {size=}")
    if kind not in (REGION_DEVICE, REGION_HOST):
        raise ValueError(f"mkrt.proxy: region kind must be 0 (device) or 1 (host); got {kind=}")
    table[rank, region] = (base, size, kind, 1)


# ---- the C side, generated from the dtype ----------------------------------------------
_C_TYPES = {np.dtype("<u2"): "unsigned short", np.dtype("<u4"): "unsigned int",
            np.dtype("<u8"): "unsigned long long"}


def command_struct_source() -> str:
    """``struct Command`` and the constants above, as C for namespace mkrt."""
    lines = ["struct __align__(64) Command {"]
    for name, (sub, _) in COMMAND_DTYPE.fields.items():
        lines.append(f"    {_C_TYPES[sub]} {name};")
    lines.append("};")
    lines.append(f"static_assert(sizeof(Command) == {COMMAND_BYTES}, \"mkrt::Command size\");")
    # Offsets: the dtype is checked to be packed with naturally aligned fields (no
    # padding), so C's natural layout of these members in this order equals it; the GPU
    # test reads the offsets back from a kernel (command_layout). (__builtin_offsetof is
    # not accepted by every NVRTC version.)
    constants = {
        "OP_NOP": OP_NOP, "OP_PUT": OP_PUT, "OP_PUT_SIGNAL": OP_PUT_SIGNAL, "OP_SIGNAL": OP_SIGNAL,
        "OP_FENCE": OP_FENCE, "OP_BARRIER": OP_BARRIER, "NO_REGION": NO_REGION,
        "QUEUE_HEADER_WORDS": HEADER_WORDS, "QUEUE_TAIL": H_TAIL, "QUEUE_DONE": H_DONE,
        "QUEUE_ERROR": H_ERROR,
    }
    lines += [f"constexpr unsigned {k} = {v}u;" for k, v in constants.items()]
    return "\n".join(lines)


#: the descriptor a kernel gets per queue (device memory), mirrored in C as mkrt::Queue
QUEUE_DESC_DTYPE = np.dtype([
    ("ring", "<u8"),         # Command* in mapped host memory (device address)
    ("header", "<u8"),       # u64* queue header, mapped host memory (device address)
    ("head", "<u8"),         # u64* claim counter, device memory
    ("tail_cache", "<u8"),   # u64* last tail seen, device memory
    ("slots", "<u8"),
    ("rank", "<u8"),
])
