"""Backs a model's large CPU weight buffers with 2 MiB pages (Linux transparent huge pages), once, at load.

A forward streams every weight from memory each call, and with 4 KiB pages that is a TLB miss and a page walk
every 4 KiB of every weight stream. Where `transparent_hugepage/enabled` is madvise, nothing gets huge pages
unless it asks, so the loader asks for the weights' buffers (docs/cpu.md has the measured effect).

XLA owns the buffers, so they are not allocated on huge pages: `collapse` asks the kernel to move the pages of each
large buffer that already exist into huge pages in place (`madvise(MADV_HUGEPAGE)`, then `MADV_COLLAPSE`, Linux
6.1+; the contents do not change). It does what the system allows and nothing else: no Linux, THP disabled
(`never`), an old kernel or a non-CPU array are skipped, and a failure leaves the 4 KiB pages. A buffer only gains
the 2 MiB-aligned part inside it. `DDD_JAX_NO_HUGE_PAGES=1` turns it off. `load_target` calls it (a draft head's
buffers are too small to gain).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import os
import sys

import jax

HUGE = 2 << 20  # bytes of one x86-64 / arm64 (4 KiB granule) huge page
MIN_BYTES = 4 * HUGE  # smaller buffers are skipped: little to gain, and collapsing costs ~2 ms per MiB
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


@dataclasses.dataclass(frozen=True)
class Collapsed:
    """What `collapse` did."""
    buffers: int = 0  # buffers of at least MIN_BYTES on the CPU
    collapsed: int = 0  # of those, buffers whose aligned range the kernel collapsed
    bytes: int = 0  # bytes now on huge pages (the 2 MiB-aligned ranges of the collapsed buffers)
    skipped: str | None = None  # why nothing was tried, when nothing was
    error: str | None = None  # the first madvise failure (errno name), when one failed


def thp_mode() -> str | None:
    """The system's transparent huge page mode ("always" / "madvise" / "never"), None when there is none."""
    try:
        with open(_THP) as f:
            text = f.read()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("["):
            return word.strip("[]")
    return None


def _libc():
    name = ctypes.util.find_library("c") or "libc.so.6"
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _cpu_buffers(tree, min_bytes: int):
    """(address, bytes) of every single-device CPU jax.Array leaf of `tree` of at least min_bytes."""
    seen = set()
    for a in jax.tree.leaves(tree):
        if not isinstance(a, jax.Array) or a.nbytes < min_bytes or len(a.devices()) != 1:
            continue
        if next(iter(a.devices())).platform != "cpu":
            continue
        try:
            p = a.unsafe_buffer_pointer()
        except Exception:  # noqa: BLE001  (deleted or not addressable here)
            continue
        if p not in seen:
            seen.add(p)
            yield p, a.nbytes


def aligned_range(address: int, nbytes: int) -> tuple[int, int]:
    """The 2 MiB-aligned [start, end) inside [address, address + nbytes) (empty: start >= end)."""
    return (address + HUGE - 1) // HUGE * HUGE, (address + nbytes) // HUGE * HUGE


def collapse(tree, min_bytes: int = MIN_BYTES) -> Collapsed:
    """Move the pages of `tree`'s large CPU buffers into huge pages (see the module docstring)."""
    if os.environ.get("DDD_JAX_NO_HUGE_PAGES", "") not in ("", "0"):
        return Collapsed(skipped="DDD_JAX_NO_HUGE_PAGES is set")
    if not sys.platform.startswith("linux"):
        return Collapsed(skipped=f"not Linux ({sys.platform})")
    mode = thp_mode()
    if mode in (None, "never"):
        return Collapsed(skipped=f"transparent huge pages are {'absent' if mode is None else 'off (never)'}")
    bufs = list(_cpu_buffers(tree, min_bytes))
    if not bufs:
        return Collapsed(skipped=f"no CPU buffer of {min_bytes} bytes or more")
    libc = _libc()
    done = nbytes = 0
    error = None
    for p, n in bufs:
        lo, hi = aligned_range(p, n)
        if hi <= lo:
            continue
        # MADV_COLLAPSE fails with EINVAL before Linux 6.1, EAGAIN / ENOMEM when no huge page can be had now
        if libc.madvise(lo, hi - lo, MADV_HUGEPAGE) != 0 or libc.madvise(lo, hi - lo, MADV_COLLAPSE) != 0:
            error = error or errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
            continue
        done += 1
        nbytes += hi - lo
    return Collapsed(buffers=len(bufs), collapsed=done, bytes=nbytes, error=error)


def huge_page_bytes(address: int, end: int | None = None) -> int | None:
    """AnonHugePages (bytes) of the mapping that holds `address` (/proc/self/smaps), None when not found. With
    `end`: summed over every mapping that overlaps [address, end) (a range can span several, e.g. where earlier
    madvise calls in this process split the mappings)."""
    stop = address + 1 if end is None else end
    total, found, inside = 0, False, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < stop and address < hi
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
                    found = True
    except OSError:
        return None
    return total if found else None
