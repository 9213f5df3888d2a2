"""Atomic memory operations for Numba-compiled code, built with llvmlite.

mkrt/DESIGN.md, "Machine facts": a plain ``while arr[i] != v: pass`` in ``@njit`` is hoisted by LLVM and never
sees another thread's (or the GPU's) write; an acquire load is re-read every iteration.
Everything here works on u64 words, either elements of a 1-D uint64 array or raw
addresses (what the region table holds). Compare uint64 with uint64 only (mixing with
int64 turns the comparison into a float one).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import make_array

_I64 = ir.IntType(64)
_I64P = _I64.as_pointer()
_I8P = ir.IntType(8).as_pointer()


def _element_pointer(context, builder, arrty, arr, index):
    array = make_array(arrty)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arrty, array, [index], wraparound=False)


def _check_array(arr):
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.uint64):
        raise TypeError(f"mkrt.proxy: atomics take a 1-D uint64 array; got {arr}")


@intrinsic
def load_acquire(typingctx, arr, index):
    """``arr[index]`` with an acquire load (never hoisted out of a loop)."""
    _check_array(arr)

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)
    return types.uint64(arr, index), codegen


@intrinsic
def store_release(typingctx, arr, index, value):
    """``arr[index] = value`` with a release store."""
    _check_array(arr)

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
        val = context.cast(builder, args[2], sig.args[2], types.uint64)
        builder.store_atomic(val, ptr, "release", 8)
        return context.get_dummy_value()
    return types.void(arr, index, value), codegen


@intrinsic
def fetch_add(typingctx, arr, index, value):
    """Atomically add `value` to ``arr[index]`` (acq_rel); returns the old value."""
    _check_array(arr)

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
        val = context.cast(builder, args[2], sig.args[2], types.uint64)
        return builder.atomic_rmw("add", ptr, val, "acq_rel")
    return types.uint64(arr, index, value), codegen


@intrinsic
def load_acquire_at(typingctx, address):
    """Acquire load of the u64 at a raw address."""
    def codegen(context, builder, sig, args):
        addr = context.cast(builder, args[0], sig.args[0], types.uint64)
        ptr = builder.inttoptr(addr, _I64P)
        return builder.load_atomic(ptr, "acquire", 8)
    return types.uint64(address), codegen


@intrinsic
def store_release_at(typingctx, address, value):
    """Release store of a u64 to a raw address."""
    def codegen(context, builder, sig, args):
        addr = context.cast(builder, args[0], sig.args[0], types.uint64)
        val = context.cast(builder, args[1], sig.args[1], types.uint64)
        builder.store_atomic(val, builder.inttoptr(addr, _I64P), "release", 8)
        return context.get_dummy_value()
    return types.void(address, value), codegen


@intrinsic
def fetch_add_at(typingctx, address, value):
    """Atomically add `value` (two's complement: a huge value subtracts) to the u64 at a raw
    address (acq_rel); returns the old value."""
    def codegen(context, builder, sig, args):
        addr = context.cast(builder, args[0], sig.args[0], types.uint64)
        val = context.cast(builder, args[1], sig.args[1], types.uint64)
        return builder.atomic_rmw("add", builder.inttoptr(addr, _I64P), val, "acq_rel")
    return types.uint64(address, value), codegen


@intrinsic
def copy_bytes(typingctx, dst, src, nbytes):
    """memmove(dst, src, nbytes) between raw addresses."""
    def codegen(context, builder, sig, args):
        d = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.uint64), _I8P)
        s = builder.inttoptr(context.cast(builder, args[1], sig.args[1], types.uint64), _I8P)
        n = context.cast(builder, args[2], sig.args[2], types.uint64)
        cgutils.raw_memmove(builder, d, s, n, 1)
        return context.get_dummy_value()
    return types.void(dst, src, nbytes), codegen


@intrinsic
def spin_pause(typingctx):
    """A CPU spin-wait hint (x86 ``pause``); nothing elsewhere."""
    def codegen(context, builder, sig, args):
        import platform
        if platform.machine() in ("x86_64", "AMD64"):
            fnty = ir.FunctionType(ir.VoidType(), [])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


def _host_has(feature: str) -> bool:
    try:
        from llvmlite import binding
        return bool(binding.get_host_cpu_features().get(feature, False))
    except (RuntimeError, ImportError):
        return False


#: whether demote_line_at emits ``cldemote`` on this CPU (LLVM's view of the host)
HAS_CLDEMOTE = _host_has("cldemote")


@intrinsic
def demote_line_at(typingctx, address):
    """Move the cache line holding `address` from this core's caches to the shared cache
    (x86 ``cldemote``, a hint), so a device's next read of it need not snoop this core;
    nothing on CPUs without it."""
    def codegen(context, builder, sig, args):
        if HAS_CLDEMOTE:
            addr = context.cast(builder, args[0], sig.args[0], types.uint64)
            fnty = ir.FunctionType(ir.VoidType(), [_I8P])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.cldemote")
            builder.call(fn, [builder.inttoptr(addr, _I8P)])
        return context.get_dummy_value()
    return types.void(address), codegen
