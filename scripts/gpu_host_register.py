"""Does cudaHostRegister pin kvdex's host pages on this machine? (H200 check for kvdex/storage/host.py)

Registers a tiny unaligned buffer, a page-aligned one and a 256 MiB one, prints the return codes and
whether torch sees them as pinned, then fills HostPages through the registered path and reads them
back with the UVA gather and the staging path.

    PYTHONPATH=$PWD python3 scripts/gpu_host_register.py
"""

import torch

from kvdex.storage import host as host_mod
from kvdex.storage.base import TransferStats

cudart = torch.cuda.cudart()
for label, nbytes, aligned in (("tiny, malloc", 1280, False), ("tiny, aligned", 1280, True),
                               ("256 MiB, malloc", 256 << 20, False), ("256 MiB, aligned", 256 << 20, True)):
    raw = torch.zeros(nbytes + 8192, dtype=torch.uint8)
    off = (-raw.data_ptr()) % 4096 if aligned else 16
    size = -(-nbytes // 4096) * 4096 if aligned else nbytes
    region = raw[off : off + size]
    rc = int(cudart.cudaHostRegister(region.data_ptr(), size, 0))
    pinned = region.is_pinned() if rc == 0 else None
    print(f"{label:<18} ptr % 4096 = {region.data_ptr() % 4096:>4}  rc = {rc}  is_pinned = {pinned}")
    if rc == 0:
        cudart.cudaHostUnregister(region.data_ptr())
    else:
        host_mod._clear_cuda_error()

host_mod._REGISTER_MIN_BYTES = 0
hp = host_mod.HostPages(1, 2, 4, 8, torch.float32, "cuda", TransferStats())
k, v = torch.randn(2, 10, 4, 8, device="cuda"), torch.randn(2, 10, 4, 8, device="cuda")
hp.write(0, 0, k, v)
print("HostPages registered:", bool(hp._registered), "pinned:", hp.data.is_pinned())
pages = torch.tensor([[[3, 0, 1], [9, 2, 5]]], device="cuda")
a = hp.fetch_pages(pages)
uva, hp._uva = hp._uva, None
b = hp.fetch_pages(pages)
hp._uva = uva
print("UVA == staging:", torch.equal(a, b), " == written:", torch.equal(a[0, 0, 0, 0], k[0, 3]))
