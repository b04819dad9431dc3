"""Host-memory page store and the batched host -> device transfer.

Pages live in HND layout ``[B, H, P, 2, page_size, D]`` (K and V of one (sequence, head, page)
side by side), so one (sequence, kv head, page) is one contiguous block and one
``index_select`` gathers every selected page of every head (PRKV's contiguous memory indexing).
The gathered blocks land in a reusable pinned staging buffer and cross PCIe in one copy
(IceCache's bulk loading, PRKV's batched transfer). On a CPU-only machine host and device are
the same memory and the copy is a plain copy, so CI runs the same code.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

import torch

from kvdex.kernels.dispatch import triton_kernel
from kvdex.kernels.pinned import REGISTERED, is_registered  # noqa: F401  (is_registered: kvdex.storage.host's name)
from kvdex.storage.base import TransferStats

_GROW_PAGES = 64
# Pinned buffers at least this large are pinned in place (cudaHostRegister on an ordinary allocation)
# instead of through torch's caching host allocator, which rounds every block up to a power of two:
# at 512k tokens one layer's 2.15 GB of host pages would take 4.3 GB, and 30 layers 129 GB of pinned
# memory on a 128 GiB host. KVDEX_HOST_REGISTER=0 turns this off.
_REGISTER_MIN_BYTES = 64 << 20
_HOST_PAGE = 4096
# data_ptr of every buffer kvdex registered: torch 2.11 (CUDA 13) reports registered memory as not pinned
# (Tensor.is_pinned() is False although cudaHostRegister returned success), so the UVA kernels ask there too.
_REGISTERED = REGISTERED


class HostMemoryError(MemoryError, RuntimeError):
    """Host memory for offloaded KV pages cannot be had (a ``MemoryError``, and a ``RuntimeError`` as torch's
    own allocation failures are): the message says how many bytes were needed, how many are available and
    what to change."""


def available_host_bytes() -> int | None:
    """Host memory available to new allocations without swapping (``MemAvailable`` of ``/proc/meminfo``;
    elsewhere the free physical pages), or None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB ({n} bytes)"


def _host_memory_error(nbytes: int, available: int | None, what: str, cause: str = "") -> HostMemoryError:
    have = "unknown" if available is None else _gib(available)
    return HostMemoryError(
        f"kvdex: offload=True needs {_gib(nbytes)} of host memory for {what}, but {have} is available"
        f"{cause}. The host holds every offloaded layer's middle (all of the context but sink and window): use a "
        "shorter context or a smaller batch, a 16-bit dtype instead of float32, offload=False where the device "
        "has room for the KV, or free host memory (page_cache sizes device slots and does not reduce it). "
        "KVDEX_HOST_MEMORY_CHECK=0 skips this check."
    )


def checked_host_allocation(nbytes: int, what: str, alloc: Callable[[], torch.Tensor], pin: bool) -> torch.Tensor:
    """``alloc()`` (host memory for offloaded KV, ``nbytes`` of it for ``what``), checked against the memory
    available first (``KVDEX_HOST_MEMORY_CHECK=0`` skips the check); a shortfall or a failed allocation is a
    :class:`HostMemoryError` saying what to change, not a crash or torch's bare error. Other errors pass."""
    available = None
    if nbytes and os.environ.get("KVDEX_HOST_MEMORY_CHECK", "1") != "0":
        available = available_host_bytes()
        if available is not None and nbytes > available:
            raise _host_memory_error(nbytes, available, what)
    try:
        return alloc()
    except RuntimeError as e:  # torch: "CUDA error: out of memory" (pinned), "can't allocate memory" (CPU)
        text = str(e).lower()
        if "out of memory" not in text and "can't allocate" not in text and "cannot allocate" not in text:
            raise
        if pin:
            _clear_cuda_error()
        line = next((x for x in str(e).splitlines() if x.strip()), "")
        raise _host_memory_error(nbytes, available_host_bytes(), what, f" (the allocation failed: {line[:200]})") from e


def _registered_zeros(shape, dtype) -> torch.Tensor | None:
    """A zeroed CPU tensor pinned with cudaHostRegister (exact size up to a 4 KiB page), or None if that fails.

    The registered range starts and ends on a host page boundary (an over-allocation of one page is
    sliced), as cudaHostRegister requires on some drivers; the tensor is a view at its start.
    """
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    size = max(_HOST_PAGE, -(-nbytes // _HOST_PAGE) * _HOST_PAGE)
    raw = torch.zeros(size + _HOST_PAGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % _HOST_PAGE
    region = raw[off : off + size]
    cudart = torch.cuda.cudart()
    try:
        rc = int(cudart.cudaHostRegister(region.data_ptr(), size, 0))
    except (RuntimeError, AttributeError):
        return None
    if rc != 0:
        _clear_cuda_error()
        return None
    _REGISTERED.add(raw.untyped_storage().data_ptr())
    return region[:nbytes].view(dtype).view(shape)


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed cudaHostRegister.

    The runtime keeps the error until someone reads it, and PyTorch's check after the next kernel
    launch would report it there ("invalid argument" from an unrelated op). A tiny launch reads and
    clears it.
    """
    try:
        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        pass


def _unregister(tensors: list, device) -> None:
    """Unpin registered buffers once no copy or kernel can still read them."""
    if not tensors:
        return
    torch.cuda.synchronize(device)
    cudart = torch.cuda.cudart()
    for t in tensors:
        # the registered range starts at the tensor's first byte (an empty tensor's data_ptr may be 0)
        cudart.cudaHostUnregister(t.untyped_storage().data_ptr() + _aligned_offset(t))
        _REGISTERED.discard(t.untyped_storage().data_ptr())
    tensors.clear()


def _aligned_offset(t: torch.Tensor) -> int:
    return (-t.untyped_storage().data_ptr()) % _HOST_PAGE


def _key_rows(page: torch.Tensor, offset: torch.Tensor, page_size: int) -> torch.Tensor:
    """The row of each token's key in host pages [..., 2, page_size, D] viewed as rows of D values: ``page``
    counted from the first page of the view, ``offset`` within it; the value's row is ``page_size`` further."""
    return page * (2 * page_size) + offset


def store_pages_reference(dst: torch.Tensor, pages: torch.Tensor, blocks: torch.Tensor) -> None:
    """The spec of :func:`kvdex.kernels.uva.store_pages` (PyTorch, on ``dst``'s device; no host read of ``pages``)."""
    b = dst.shape[0]
    p = pages.to(dst.device).long()
    blk = blocks.to(dst.device)
    bi = torch.arange(b, device=dst.device)
    at = p.clamp(min=0, max=dst.shape[2] - 1)
    cur = dst[bi, :, at]  # [B, H, 2, ps, D]
    dst[bi, :, at] = torch.where((p >= 0)[:, None, None, None, None], blk, cur)


def _uva_kernels():
    """kvdex.kernels.uva when triton is importable and KVDEX_UVA is not "0", else None."""
    return triton_kernel("uva")


class HostPages:
    def __init__(self, batch: int, kv_heads: int, page_size: int, head_dim: int, dtype, device, stats: TransferStats):
        self.batch, self.kv_heads, self.page_size, self.head_dim = batch, kv_heads, page_size, head_dim
        self.dtype, self.device, self.stats = dtype, torch.device(device), stats
        self.pin = self.device.type == "cuda" and torch.cuda.is_available()
        # The Triton kernel that reads selected pages straight from pinned memory (kvdex.kernels.uva);
        # None: the index_select + staging + copy path below (CPU, no triton, or KVDEX_UVA=0).
        self._uva = _uva_kernels() if self.pin else None
        self._registered: list[torch.Tensor] = []  # buffers pinned by cudaHostRegister (unpinned when dropped)
        if self.pin:
            weakref.finalize(self, _unregister, self._registered, self.device)
        self.data = self._alloc(0)
        self._staging: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # CUDA event: the last host->device copy out of the staging buffer

    # ---- memory ------------------------------------------------------------------------
    def _alloc(self, pages: int) -> torch.Tensor:
        """Zeroed host pages [B, H, pages, 2, ps, D] (pinned with CUDA). Checked against the host memory available
        first, and a failed allocation is reported as :class:`HostMemoryError`, not a crash or torch's bare error."""
        shape = (self.batch, self.kv_heads, pages, 2, self.page_size, self.head_dim)
        nbytes = self.batch * self.kv_heads * pages * 2 * self.page_size * self.head_dim * self.dtype.itemsize
        what = (
            f"one layer's KV pages ({self.batch} sequence(s) x {self.kv_heads} kv heads x {pages} pages of "
            f"{self.page_size} tokens x head dim {self.head_dim}, {str(self.dtype).replace('torch.', '')}"
            f"{', pinned' if self.pin else ''})"
        )
        return checked_host_allocation(nbytes, what, lambda: self._alloc_unchecked(shape, nbytes), self.pin)

    def _alloc_unchecked(self, shape, nbytes: int) -> torch.Tensor:
        if self.pin and nbytes >= max(_REGISTER_MIN_BYTES, 1) and os.environ.get("KVDEX_HOST_REGISTER", "1") != "0":
            t = _registered_zeros(shape, self.dtype)
            if t is not None:
                self._registered.append(t)
                return t
        return torch.zeros(shape, dtype=self.dtype, pin_memory=self.pin)

    @property
    def capacity(self) -> int:
        return self.data.shape[2]

    def reserve(self, pages: int) -> None:
        if pages <= self.capacity:
            return
        # the first allocation (the prompt) keeps _GROW_PAGES of slack: growing copies into a new
        # buffer, which at long contexts needs old + new in host memory at once
        grow = _GROW_PAGES if self.capacity == 0 else max(_GROW_PAGES, self.capacity // 4)
        new = self._alloc(max(pages + (_GROW_PAGES if self.capacity == 0 else 0), self.capacity + grow))
        new[:, :, : self.capacity] = self.data
        if self._uva is not None:  # a UVA kernel may still read the old pinned buffer: let it finish
            torch.cuda.current_stream(self.device).synchronize()
        old = [t for t in self._registered if t is self.data]
        self.data = new
        if old:  # unpin the replaced buffer (after the device is done with it)
            self._registered.remove(old[0])
            _unregister(old, self.device)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def _stage(self, shape) -> torch.Tensor:
        if self._copied is not None:  # the previous async copy must finish reading the buffer
            self._copied.synchronize()
        n = 1
        for s in shape:
            n *= s
        staging = self._staging
        if staging is None or staging.numel() < n:
            self._staging = staging = torch.empty(max(n, 1), dtype=self.dtype, pin_memory=self.pin)
        return staging[:n].view(shape)

    # ---- device -> host ------------------------------------------------------------------
    def write(self, b: int, first_page: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store pages ``first_page...`` of sequence b: k/v [H, n, ps, D] (any device)."""
        n = k.shape[1]
        self.reserve(first_page + n)
        dst = self.data[b, :, first_page : first_page + n]
        if self.pin and k.is_cuda and n > 1:
            # interleave K/V on the device, then one contiguous DMA per head into pinned memory
            # (a copy into the strided K or V half goes through a pageable host temporary)
            kv = torch.stack([k, v], dim=2)  # [H, n, 2, ps, D]
            for h in range(kv.shape[0]):
                dst[h].copy_(kv[h])
        else:
            dst[:, :, 0].copy_(k)
            dst[:, :, 1].copy_(v)
        self.stats.d2h_bytes += 2 * k.numel() * k.element_size()

    def write_join(self, pages: torch.Tensor, blocks: torch.Tensor) -> None:
        """Store page ``pages[b]`` of every sequence b with ``pages[b] >= 0``: blocks [B, H, 2, ps, D] (device),
        pages [B] (device). UVA (pinned + triton): one kernel writing host memory, no host read of the
        page ids (graph-capturable); else the PyTorch twin. Capacity is reserved by the caller
        (:meth:`reserve`); bytes are counted by the caller (on the host)."""
        if self._uva is not None:
            self._uva.store_pages(self.data, pages.to(self.device), blocks)
            return
        store_pages_reference(self.data, pages, blocks)

    def permute_tokens(self, order: torch.Tensor) -> None:
        """Reorder the first M tokens (M / ps pages) of every (sequence, head): token j <- token order[..., j].

        order [B, H, M] (CPU, a permutation per row; validated by the store). PRKV's restructuring.
        """
        b, h, m = order.shape
        p, ps, d = m // self.page_size, self.page_size, self.head_dim
        if self.pin:  # a copy or kernel may still be reading these pages: let it finish first
            torch.cuda.current_stream(self.device).synchronize()
        # Whole rows move (one token's key or value, D values), one (sequence, head) at a time through one scratch
        # buffer: an index_select of its rows in the order its first p pages take them, then a copy back (not a
        # gather of single elements over a fresh copy of the whole middle, many times slower on a CPU).
        # A permutation that moves few tokens (PRKV's relocate="swap") moves only those rows.
        slots = torch.arange(m)
        both = torch.tensor([0, ps]).view(1, 2, 1)  # a token's key row, then its value row
        scratch: torch.Tensor | None = None
        for s in range(b):
            for k in range(h):
                rows = self.data[s, k].view(-1, d)  # the (sequence, head)'s pages as rows, spare pages included
                o = order[s, k]
                moved = torch.nonzero(o != slots).flatten()
                if 4 * moved.numel() < m:  # those rows alone: read every source first, then write
                    dst, frm = _key_rows(moved // ps, moved % ps, ps), _key_rows(o[moved] // ps, o[moved] % ps, ps)
                    rows.index_copy_(0, torch.cat([dst, dst + ps]), rows.index_select(0, torch.cat([frm, frm + ps])))
                    continue
                src = _key_rows(o // ps, o % ps, ps).view(p, 1, ps) + both  # [p, 2, ps]: rows in page order
                if scratch is None:
                    scratch = torch.empty(p * 2 * ps, d, dtype=self.data.dtype)
                torch.index_select(rows, 0, src.reshape(-1), out=scratch)
                rows[: p * 2 * ps].copy_(scratch)

    # ---- host -> device ------------------------------------------------------------------
    def fetch_pages(self, pages: torch.Tensor, keys_only: bool = False) -> torch.Tensor:
        """pages [B, H, P] page ids (>= 0) -> device tensor [B, H, P, 2, ps, D] in one transfer (``keys_only``:
        [B, H, P, 1, ps, D], the keys alone, half the bytes: what a rerank of candidate pages reads)."""
        b, h, p = pages.shape
        kv = 1 if keys_only else 2
        if self._uva is not None:  # UVA zero-copy: ids stay on the device, no host sync, no staging
            out = self._uva.gather_pages(self.data, pages.to(self.device), keys_only=keys_only)
            self._count_uva(out)
            return out
        flat = (torch.arange(b)[:, None, None] * h + torch.arange(h)[None, :, None]) * self.capacity
        ids = (flat + pages.cpu()).reshape(-1)
        src = self.data.view(b * h * self.capacity, 2, self.page_size, self.head_dim)[:, :kv]
        stage = self._stage((ids.numel(), kv, self.page_size, self.head_dim))
        torch.index_select(src, 0, ids, out=stage)
        out = stage.to(self.device, non_blocking=True)
        self._count(stage)
        return out.view(b, h, p, kv, self.page_size, self.head_dim)

    def fetch_rows(self, positions: torch.Tensor, sink: int) -> torch.Tensor:
        """positions [B, H, T] middle token positions (>= sink) -> device [B, H, T, 2, D]."""
        b, h, t = positions.shape
        if self._uva is not None:
            out = self._uva.gather_rows(self.data, positions.to(self.device), sink)
            self._count_uva(out)
            return out
        rel = positions.cpu() - sink
        page, off = rel // self.page_size, rel % self.page_size
        page = (torch.arange(b)[:, None, None] * h + torch.arange(h)[None, :, None]) * self.capacity + page
        ids_k = _key_rows(page, off, self.page_size).reshape(-1)
        ids_v = ids_k + self.page_size
        src = self.data.view(-1, self.head_dim)
        stage = self._stage((2, ids_k.numel(), self.head_dim))
        torch.index_select(src, 0, ids_k, out=stage[0])
        torch.index_select(src, 0, ids_v, out=stage[1])
        out = stage.to(self.device, non_blocking=True)
        self._count(stage)
        return out.view(2, b, h, t, self.head_dim).permute(1, 2, 3, 0, 4)

    def fill_slots(self, pages: torch.Tensor, dst: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, base: int):
        """Copy host page ``pages[b, h, j]`` into rows ``base + dst*ps ...`` of k_buf / v_buf [B, H, S, D]
        wherever ``dst[b, h, j] >= 0`` (the misses of a device page cache); other entries move nothing.

        UVA (pinned + triton): one kernel over every entry, no host sync (graph-capturable). Else the
        misses are found on the host, gathered with ``index_select`` and copied (a host sync).
        Transfer bytes are counted by the caller (on the device).
        """
        if self._uva is not None:
            self._uva.fill_slots(self.data, pages.to(self.device), dst.to(self.device), k_buf, v_buf, base)
            self.stats.h2d_calls += 1
            return
        ok = ((dst >= 0) & (pages >= 0)).cpu()
        bi, hi, ji = ok.nonzero(as_tuple=True)
        if bi.numel() == 0:
            return
        pg, slot = pages.cpu()[bi, hi, ji], dst.cpu()[bi, hi, ji]
        ids = (bi * self.kv_heads + hi) * self.capacity + pg
        src = self.data.view(-1, 2, self.page_size, self.head_dim)
        stage = self._stage((ids.numel(), 2, self.page_size, self.head_dim))
        torch.index_select(src, 0, ids, out=stage)
        blocks = stage.to(k_buf.device, non_blocking=True)
        if self.pin:
            self._copied = copied = torch.cuda.Event()
            copied.record()
        self.stats.h2d_calls += 1
        dev = k_buf.device
        rows = base + slot[:, None].to(dev) * self.page_size + torch.arange(self.page_size, device=dev)
        bi, hi = bi.to(dev)[:, None], hi.to(dev)[:, None]
        k_buf[bi, hi, rows] = blocks[:, 0]
        v_buf[bi, hi, rows] = blocks[:, 1]

    def read_prefix(self, pages: int) -> torch.Tensor:
        """The first ``pages`` pages of every (sequence, head) on the device, [B, H, pages, 2, ps, D]:
        one contiguous copy per (sequence, head) (pinned: DMA at the PCIe rate, no pageable bounce)."""
        out = torch.empty(
            (self.batch, self.kv_heads, pages, 2, self.page_size, self.head_dim), dtype=self.dtype, device=self.device
        )
        for b in range(self.batch):
            for h in range(self.kv_heads):
                out[b, h].copy_(self.data[b, h, :pages], non_blocking=self.pin)
        self.stats.h2d_bytes += out.numel() * out.element_size()
        self.stats.h2d_calls += self.batch * self.kv_heads
        return out

    def _count_uva(self, out: torch.Tensor) -> None:
        self.stats.h2d_bytes += out.numel() * out.element_size()  # bytes read over PCIe (-1 padding included)
        self.stats.h2d_calls += 1

    def _count(self, stage: torch.Tensor) -> None:
        if self.pin:
            self._copied = copied = torch.cuda.Event()
            copied.record()
        self.stats.h2d_bytes += stage.numel() * stage.element_size()
        self.stats.h2d_calls += 1
